"""Retriever clients with one interface: `search(queries, topk) -> list[list[{"document", "score"}]]`.

`LocalRetriever` searches an `Index` in-process; `HttpRetriever` talks to `rexrag serve-retriever` (or
any Search-R1 `POST /retrieve` server) and returns the same structure.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Protocol, Sequence


class Retriever(Protocol):
    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[dict]]: ...


class LocalRetriever:
    """In-process search: encode queries (kind="query") then top-k over the index.

    A lock serialises calls: JAX dispatch is thread-safe, but one big batch beats many racing ones
    on a shared host, and the server batches concurrent requests before calling here anyway.
    """

    def __init__(self, index, encoder):
        enc, got = index.manifest["encoder"], encoder.describe()
        if enc != got:
            raise ValueError(f"{index.dir}: index encoder {enc} does not match the query encoder {got}")
        self.index, self.encoder = index, encoder
        self._lock = threading.Lock()

    def __len__(self):
        return len(self.index)

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[dict]]:
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings, got a single str")
        if topk <= 0:
            raise ValueError(f"topk must be positive, got {topk}")
        if not queries:
            return []
        with self._lock:
            q = self.encoder.encode(list(queries), kind="query")
            return self.index.search_embeddings(q, topk)


class HttpRetriever:
    """Client for `POST {url}` with the Search-R1 payload; always asks for scores."""

    def __init__(self, url: str, timeout: float = 60.0):
        self.url = url if url.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"
        self.timeout = timeout

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[dict]]:
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings, got a single str")
        body = json.dumps({"queries": list(queries), "topk": topk, "return_scores": True}).encode("utf-8")
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())["result"]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}: HTTP {e.code}: {e.read().decode('utf-8', 'replace')}") from None
