"""Search-R1 compatible retrieval server: `POST /retrieve` (SPEC §7), stdlib only.

Request  `{"queries": [str], "topk": int = 3, "return_scores": bool = false}`; a missing, null or 0 topk
means the server's default top-k (ServerLimits.default_topk, 3), as Search-R1's server does
(`if not request.topk: request.topk = config.retrieval_topk`).
Response `{"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}`, or bare
documents per query when return_scores is false. `GET /health` -> `{"status": "ok", "count": N}`.

Bad requests get a 4xx with `{"error": "..."}` saying which field is wrong and what was expected; the
server keeps serving. Concurrent requests are micro-batched: one worker thread drains the queue and
runs a single `retriever.search` over all waiting queries (at the largest requested topk), then each
request gets its own rows cut to its own topk.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_queries: int = 4096          # per request; Search-R1 sends a whole turn's batch (512 x 5 = 2560)
    max_topk: int = 100
    default_topk: int = 3            # answers a request whose topk is missing, null or 0
    max_query_chars: int = 8192
    max_body_bytes: int = 8 << 20
    max_batch_queries: int = 512     # per micro-batch of concurrent requests


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body -> (queries, topk, return_scores); raises BadRequest(status, msg)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(req, dict):
        raise BadRequest(400, f"expected a JSON object with field 'queries', got {type(req).__name__}")
    if "queries" not in req:
        raise BadRequest(400, "field 'queries' is missing (expected a list of strings)")
    qs = req["queries"]
    if not isinstance(qs, list):
        raise BadRequest(400, f"field 'queries' must be a list of strings, got {type(qs).__name__}")
    if not qs:
        raise BadRequest(400, "field 'queries' is empty (expected at least one query)")
    if len(qs) > limits.max_queries:
        raise BadRequest(413, f"field 'queries' has {len(qs)} items, at most {limits.max_queries} allowed")
    for i, q in enumerate(qs):
        if not isinstance(q, str):
            raise BadRequest(400, f"queries[{i}] must be a string, got {type(q).__name__}")
        if not q.strip():
            raise BadRequest(400, f"queries[{i}] is empty")
        try:
            q.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(400, f"queries[{i}] contains an unpaired surrogate escape (not valid Unicode)") from None
        if len(q) > limits.max_query_chars:
            raise BadRequest(413, f"queries[{i}] has {len(q)} characters, at most {limits.max_query_chars} allowed")
    topk = req.get("topk")
    if isinstance(topk, bool) or not isinstance(topk, (int, type(None))):
        raise BadRequest(400, f"field 'topk' must be an integer, got {json.dumps(topk)}")
    if not topk:  # missing, null or 0 -> the server's default (Search-R1: `if not request.topk`)
        topk = limits.default_topk
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(400, f"field 'topk' must be in [1, {limits.max_topk}], got {topk}")
    rs = req.get("return_scores", False)
    if not isinstance(rs, bool):
        raise BadRequest(400, f"field 'return_scores' must be true or false, got {json.dumps(rs)}")
    return qs, topk, rs


class _Batcher:
    """Single worker that merges concurrently queued requests into one search call."""

    def __init__(self, retriever, max_batch_queries: int):
        self.retriever, self.max_batch = retriever, max_batch_queries
        self.q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="retrieve-batcher", daemon=True)
        self._thread.start()

    def submit(self, queries: list[str], topk: int) -> list[list[dict]]:
        job = {"queries": queries, "topk": topk, "done": threading.Event()}
        self.q.put(job)
        job["done"].wait()
        if "error" in job:
            raise job["error"]
        return job["result"]

    def _run(self):
        while True:
            jobs = [self.q.get()]
            if jobs[0] is None:
                return
            total = len(jobs[0]["queries"])
            while total < self.max_batch:
                try:
                    j = self.q.get_nowait()
                except queue.Empty:
                    break
                if j is None:
                    self.q.put(None)
                    break
                jobs.append(j)
                total += len(j["queries"])
            try:
                flat = [q for j in jobs for q in j["queries"]]
                res = self.retriever.search(flat, max(j["topk"] for j in jobs))
                pos = 0
                for j in jobs:
                    j["result"] = [r[:j["topk"]] for r in res[pos:pos + len(j["queries"])]]
                    pos += len(j["queries"])
            except Exception as e:  # reported to every waiting request as a 500
                for j in jobs:
                    j["error"] = e
            for j in jobs:
                j["done"].set()

    def close(self):
        self.q.put(None)


def make_server(retriever, host: str = "127.0.0.1", port: int = 8000,
                limits: ServerLimits = ServerLimits(), verbose: bool = False) -> ThreadingHTTPServer:
    batcher = _Batcher(retriever, limits.max_batch_queries)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            if verbose:
                sys.stderr.write("%s - %s\n" % (self.address_string(), fmt % args))

        def _send(self, status: int, obj) -> None:
            data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.split("?")[0] in ("/health", "/"):
                self._send(200, {"status": "ok", "count": len(retriever)})
            else:
                self._send(404, {"error": f"unknown path {self.path}; use POST /retrieve"})

        def do_POST(self):
            if self.path.split("?")[0] != "/retrieve":
                self.close_connection = True
                return self._send(404, {"error": f"unknown path {self.path}; use POST /retrieve"})
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                return self._send(411, {"error": "Content-Length header required"})
            if int(length) > limits.max_body_bytes:
                self.close_connection = True  # body left unread: drop the connection after replying
                return self._send(413, {"error": f"body of {length} bytes exceeds {limits.max_body_bytes}"})
            body = self.rfile.read(int(length))
            try:
                queries, topk, return_scores = parse_request(body, limits)
            except BadRequest as e:
                return self._send(e.status, {"error": str(e)})
            try:
                res = batcher.submit(queries, topk)
            except Exception as e:
                return self._send(500, {"error": f"search failed: {type(e).__name__}: {e}"})
            if not return_scores:
                res = [[h["document"] for h in row] for row in res]
            self._send(200, {"result": res})

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256  # the default (5) drops connections under many concurrent clients

        def server_close(self):
            super().server_close()
            batcher.close()

    return Server((host, port), Handler)


@contextlib.contextmanager
def running_server(retriever, host: str = "127.0.0.1", port: int = 0, limits: ServerLimits = ServerLimits()):
    """Serve in a background thread (port 0 = any free port); yields the base URL."""
    httpd = make_server(retriever, host, port, limits)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://{host}:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=5)


def serve(retriever, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits = ServerLimits(),
          verbose: bool = False) -> None:
    """Serve until interrupted. Binding a non-loopback host exposes the corpus to the network."""
    httpd = make_server(retriever, host, port, limits, verbose)
    print(f"serving POST http://{host}:{httpd.server_address[1]}/retrieve ({len(retriever)} passages)", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
