"""Build, save and load a retrieval index directory.

Layout of `index_dir/`:
```
manifest.json      encoder {name, dim, max_length, prefixes}, count, corpus {path, sha256}, searcher, params
docs.jsonl         row i = passage of embedding row i;  doc_offsets.npy  byte offsets [count + 1]
embeddings.f32     np.memmap float32 [count, dim], L2-normalised
scann/             serialized ScaNN searcher (searcher == "scann" only)
config.gin         resolved gin config (written by the CLI)
```
Crash safety: everything is built in `index_dir + ".partial"`. Embeddings are encoded shard by shard
into the memmap; after each shard is flushed `build_state.json` records it, so a rerun with the same
corpus/encoder/shard size resumes at the first unfinished shard. Only a complete build is swapped in
(rename), so an existing good index is never clobbered by a failed build. `partial` says what happens to
a partial build: "resume" (library default: resume a compatible one, discard a stale one), "strict"
(`rexrag build-index`: resume a compatible one, refuse a stale one with IndexExistsError naming
--overwrite) or "discard" (--overwrite: always start over). `check_output_dir` is the CLIs' check of the
output before anything loads: a finished index there is refused unless --overwrite, a non-empty
directory that is not an index always.

`index_dir` may be a gs:// URL (through rexrag_jax.io.paths). ScaNN and the memmaps need local files, so a
remote index is built in its local cache dir (`paths.local_cache_dir(url)`: $REXRAG_REMOTE_CACHE, else
~/.cache/rexrag_jax/remote/gs/BUCKET/KEY; `.partial` and its resume state live there too) and then
uploaded, manifest.json last (deleted first, and stale objects of an older build removed), so a reader that
finds the manifest finds a finished upload. `Index.load(url)` checks the remote manifest, downloads the
index into the same cache dir unless the cached manifest is byte-equal to the remote one, and opens the
local copy. GCS has no rename: while an index is being re-uploaded over an old one, readers see no
manifest ("not an index directory") rather than a mix.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time

import numpy as np
from tqdm.auto import tqdm

from rexrag_jax.io import paths
from rexrag_jax.retrieval.corpus import file_sha256
from rexrag_jax.retrieval.docstore import DocStore, write_docstore
from rexrag_jax.retrieval.searcher import ExactSearcher, ScannSearcher

MANIFEST, STATE, EMB = "manifest.json", "build_state.json", "embeddings.f32"
FORMAT_VERSION = 1


class IndexLoadError(ValueError):
    """An index directory that is missing, incomplete, or does not match what the caller expects."""


class IndexExistsError(ValueError):
    """The output of build-index / merge-index holds a finished index or a stale partial build (one line,
    naming --overwrite), or is a directory that is not an index."""


def check_output_dir(index_dir: str, overwrite: bool) -> None:
    """Raises IndexExistsError unless `index_dir` may be (re)written: missing or empty, or a finished index
    with `overwrite`. A local non-empty directory without manifest.json is never replaced (it is not an
    index: the build swaps whole indexes in by rename); a remote prefix without one (an upload that stopped
    part way) only with `overwrite`."""
    index_dir = normalize_dir(index_dir)
    mpath = paths.join(index_dir, MANIFEST)
    if paths.isfile(mpath):
        if not overwrite:
            raise IndexExistsError(f"{index_dir}: a finished index is already there ({MANIFEST}); pass --overwrite "
                                   "to rebuild it, or pick another --index_dir")
        return
    names = paths.listdir(index_dir) if paths.is_remote(index_dir) or os.path.isdir(index_dir) else []
    if not paths.is_remote(index_dir) and os.path.exists(index_dir) and not os.path.isdir(index_dir):
        raise IndexExistsError(f"{index_dir}: exists and is not a directory; pass another --index_dir")
    if names and (not paths.is_remote(index_dir) or not overwrite):
        hint = ("pass a new or empty --index_dir" if not paths.is_remote(index_dir) else
                "pass --overwrite to replace what is there (an upload that stopped part way?)")
        raise IndexExistsError(f"{index_dir}: not empty and not an index ({MANIFEST} missing; holds "
                               f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}); {hint}")


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def choose_searcher(count: int, searcher: str, exact_max_rows: int) -> str:
    """'auto' -> exact for corpora of at most exact_max_rows passages, ScaNN above."""
    if searcher not in ("auto", "exact", "scann"):
        raise ValueError(f"searcher must be 'auto', 'exact' or 'scann', got {searcher!r}")
    if searcher == "auto":
        return "exact" if count <= exact_max_rows else "scann"
    return searcher


def build_index(corpus_path: str, index_dir: str, encoder, *, searcher: str = "auto",
                exact_max_rows: int = 100_000, shard_size: int = 65_536, scann_params: dict | None = None,
                extra_files: dict[str, str] | None = None, progress: bool = True, partial: str = "resume") -> str:
    """Encode `corpus_path` with `encoder` and write a complete index to `index_dir`; returns index_dir.
    `partial`: "resume" / "strict" / "discard", what to do with a partial build (module docstring).

    `extra_files` ({name: text}) are written into the index (e.g. the resolved gin config). `corpus_path`
    and `index_dir` may be gs:// URLs (a remote index is built in its local cache dir, then uploaded).
    """
    corpus_path = paths.as_str(corpus_path)
    with staged_output(index_dir) as (index_dir, local_dir):
        _build_local(corpus_path, local_dir, encoder, searcher=searcher, exact_max_rows=exact_max_rows,
                     shard_size=shard_size, scann_params=scann_params, extra_files=extra_files, progress=progress,
                     partial=partial)
    return index_dir


def normalize_dir(index_dir: str) -> str:
    """An absolute local path, or the URL (syntax-checked), without a trailing '/'."""
    s = os.fspath(index_dir)
    return paths.as_str(s.rstrip("/")) if paths.is_remote(s) else os.path.abspath(s.rstrip("/"))


@contextlib.contextmanager
def staged_output(index_dir: str):
    """(index_dir normalised, the local dir to write the finished index to). For a URL the bucket is checked
    first (RemotePathError, one line), the index is written to its local cache dir, and uploaded when the
    block finishes without error."""
    index_dir = normalize_dir(index_dir)
    if not paths.is_remote(index_dir):
        yield index_dir, index_dir
        return
    paths.check_remote_dir(index_dir)
    local = paths.local_cache_dir(index_dir)
    yield index_dir, local
    publish(local, index_dir)


def publish(local_dir: str, url: str) -> None:
    """Upload a finished local index to `url`: manifest deleted first and uploaded last, stale objects of an
    older index under `url` removed."""
    with _cache_lock(local_dir):
        paths.upload_dir(local_dir, url, last=(MANIFEST,), prune=True)


@contextlib.contextmanager
def _cache_lock(local_dir: str):
    """An exclusive lock on `local_dir + ".lock"` (processes on one host sharing a cache dir)."""
    os.makedirs(os.path.dirname(local_dir), exist_ok=True)
    with open(local_dir + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def local_dir_of(index_dir: str) -> str:
    """A local directory holding `index_dir`'s files: the path itself when local; for a URL its cache dir,
    downloaded unless the cached manifest.json equals the remote one byte for byte. Raises IndexLoadError
    (no remote manifest, or it changed during the download) or RemotePathError (bad or unreachable bucket)."""
    index_dir = normalize_dir(index_dir)
    if not paths.is_remote(index_dir):
        return index_dir
    paths.check_remote_dir(index_dir)
    read_manifest(index_dir)  # a finished remote index (uploaded manifest last), fields checked
    remote_m = paths.join(index_dir, MANIFEST)
    want = paths.read_text(remote_m)
    local = paths.local_cache_dir(index_dir)
    with _cache_lock(local):
        lpath = os.path.join(local, MANIFEST)
        have = open(lpath, encoding="utf-8").read() if os.path.isfile(lpath) else None
        if have != want:
            paths.download_dir(index_dir, local)
            got = open(lpath, encoding="utf-8").read() if os.path.isfile(lpath) else None
            if got != want or paths.read_text(remote_m) != want:
                raise IndexLoadError(f"{index_dir}: the index changed while it was downloaded to {local}; "
                                     "load it again once its upload has finished")
    return local


def _build_local(corpus_path: str, index_dir: str, encoder, *, searcher: str, exact_max_rows: int, shard_size: int,
                 scann_params: dict | None, extra_files: dict[str, str] | None, progress: bool,
                 partial: str = "resume") -> str:
    if partial not in ("resume", "strict", "discard"):
        raise ValueError(f"partial must be 'resume', 'strict' or 'discard', got {partial!r}")
    work = index_dir + ".partial"
    desc = encoder.describe()
    sha = file_sha256(corpus_path)
    key = {"corpus_sha256": sha, "encoder": desc, "shard_size": shard_size, "format": FORMAT_VERSION}
    state = _read_json(os.path.join(work, STATE)) if os.path.isfile(os.path.join(work, STATE)) else None
    if partial == "strict" and os.path.exists(work) and (state is None or state.get("key") != key):
        old = (state or {}).get("key") or {}
        differs = [k for k in key if old.get(k) != key[k]] or ["build_state.json missing"]
        raise IndexExistsError(f"{work}: an unfinished build with other settings ({', '.join(differs)} differ); "
                               "pass --overwrite to discard it and start over, or rerun with its settings to resume")
    if partial == "discard" and os.path.exists(work):
        shutil.rmtree(work)
        state = None
    if state is None or state.get("key") != key:
        if os.path.exists(work):
            shutil.rmtree(work)  # a stale partial build for another corpus/encoder: start over
        os.makedirs(work)
        state = {"key": key, "count": None, "shards_done": 0}
        _write_json(os.path.join(work, STATE), state)
    elif progress:
        print(f"resuming partial build in {work}: {state['shards_done']} shard(s) already encoded")

    if state["count"] is None:
        with tqdm(desc="read corpus", unit="passage", disable=not progress) as bar:
            state["count"] = write_docstore(corpus_path, work, progress=bar)
        _write_json(os.path.join(work, STATE), state)
    n, dim = state["count"], encoder.dim
    docs = DocStore(work)
    emb_path = os.path.join(work, EMB)
    emb = np.memmap(emb_path, np.float32, "r+" if os.path.exists(emb_path) else "w+", shape=(n, dim))
    num_shards = -(-n // shard_size)
    with tqdm(total=n, initial=min(n, state["shards_done"] * shard_size), desc="encode passages",
              unit="passage", disable=not progress) as bar:
        for s in range(state["shards_done"], num_shards):
            lo, hi = s * shard_size, min(n, (s + 1) * shard_size)
            emb[lo:hi] = encoder.encode(docs.texts(lo, hi), kind="passage", progress=bar)
            emb.flush()
            state["shards_done"] = s + 1
            _write_json(os.path.join(work, STATE), state)
    docs.close()

    return finish_index(work, index_dir, emb, choose_searcher(n, searcher, exact_max_rows), scann_params,
                        {"encoder": desc, "corpus": {"path": corpus_path, "sha256": sha}}, extra_files, progress)


def finish_index(work: str, index_dir: str, emb: np.ndarray, kind: str, scann_params: dict | None,
                 manifest: dict, extra_files: dict[str, str] | None, progress: bool) -> str:
    """Last steps of a build (or merge) in `work` whose docstore and embeddings `emb` [n, dim] are written:
    the ScaNN searcher (kind == "scann"), `extra_files`, the manifest (`manifest` + format, dim, count,
    searcher, params), then the build state is dropped and `work` replaces `index_dir`. Returns index_dir."""
    params = None
    if kind == "scann":
        t = time.time()
        s = ScannSearcher.build(np.asarray(emb), **(scann_params or {}))
        s.save(os.path.join(work, "scann"))
        params = s.params
        if progress:
            print(f"ScaNN searcher built in {time.time() - t:.1f}s: {params}")
    for name, text in (extra_files or {}).items():
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write(text)
    _write_json(os.path.join(work, MANIFEST), {
        "format": FORMAT_VERSION, "dim": emb.shape[1], "count": emb.shape[0], **manifest, "searcher": kind,
        "scann_params": params, "created_unix": int(time.time())})
    if os.path.exists(os.path.join(work, STATE)):
        os.remove(os.path.join(work, STATE))
    _swap_in(work, index_dir)
    return index_dir


def _swap_in(new_dir: str, index_dir: str) -> None:
    """Replace index_dir with new_dir by renames; the old index survives until the new one is in place."""
    if os.path.exists(index_dir):
        old = f"{index_dir}.old-{os.getpid()}"
        os.replace(index_dir, old)
        os.replace(new_dir, index_dir)
        shutil.rmtree(old)
    else:
        os.replace(new_dir, index_dir)


def read_manifest(index_dir: str) -> dict:
    """The manifest of a finished index directory (a local path or a URL), with its required fields checked."""
    index_dir = normalize_dir(index_dir)
    mpath = paths.join(index_dir, MANIFEST)
    if not paths.isfile(mpath):
        partial = (paths.local_cache_dir(index_dir) if paths.is_remote(index_dir) else index_dir) + ".partial"
        hint = " (a build was interrupted; rerun build-index to resume)" if os.path.isdir(partial) else ""
        raise IndexLoadError(f"{index_dir}: not an index directory, {MANIFEST} missing{hint}")
    m = paths.read_json(mpath)
    for field in ("format", "encoder", "dim", "count", "corpus", "searcher"):
        if field not in m:
            raise IndexLoadError(f"{mpath}: field {field!r} missing")
    if m["format"] != FORMAT_VERSION:
        raise IndexLoadError(f"{mpath}: format {m['format']} not supported (expected {FORMAT_VERSION})")
    return m


def check_index_files(index_dir: str, m: dict) -> DocStore:
    """Embeddings file size and docstore length against the manifest; returns the opened DocStore."""
    n, dim = m["count"], m["dim"]
    emb_path = os.path.join(index_dir, EMB)
    want = n * dim * 4
    if not os.path.isfile(emb_path) or os.path.getsize(emb_path) != want:
        got = os.path.getsize(emb_path) if os.path.isfile(emb_path) else "missing"
        raise IndexLoadError(f"{emb_path}: expected {want} bytes ({n} x {dim} float32), got {got}")
    docs = DocStore(index_dir)
    if len(docs) != n:
        docs.close()
        raise IndexLoadError(f"{index_dir}: docstore has {len(docs)} rows, manifest count is {n}")
    return docs


class Index:
    """A loaded index: manifest, searcher over the embeddings, and the passage store."""

    def __init__(self, index_dir: str, manifest: dict, searcher, docs: DocStore, local_dir: str | None = None):
        self.dir, self.manifest, self.searcher, self.docs = index_dir, manifest, searcher, docs
        self.local_dir = local_dir or index_dir  # the files searched (a URL's local cache copy)

    def __len__(self):
        return self.manifest["count"]

    @classmethod
    def load(cls, index_dir: str, encoder=None, corpus_path: str | None = None,
             searcher: str | None = None) -> "Index":
        """Open and verify an index. `encoder` (if given) must match the recorded name/dim/prefixes;
        `corpus_path` (if given) must hash to the recorded checksum. `searcher="exact"` forces brute force.
        `index_dir` may be a gs:// URL: it is opened from its local cache copy (`local_dir_of`)."""
        index_dir = normalize_dir(index_dir)
        local = local_dir_of(index_dir)
        m = read_manifest(local)
        mpath = paths.join(index_dir, MANIFEST)
        if encoder is not None:
            got = encoder.describe()
            diff = {k: (m["encoder"].get(k), got[k]) for k in got if m["encoder"].get(k) != got[k]}
            if diff:
                raise IndexLoadError(f"{mpath}: encoder mismatch, (index, given) per field: {diff}")
        if corpus_path is not None:
            sha = file_sha256(corpus_path)
            if sha != m["corpus"]["sha256"]:
                raise IndexLoadError(f"{mpath}: corpus checksum mismatch: index was built from "
                                  f"{m['corpus']['path']} (sha256 {m['corpus']['sha256'][:12]}…), "
                                  f"{corpus_path} has sha256 {sha[:12]}…")
        n, dim = m["count"], m["dim"]
        emb_path = os.path.join(local, EMB)
        docs = check_index_files(local, m)
        kind = searcher or m["searcher"]
        if kind == "scann":
            if m["searcher"] != "scann":
                raise IndexLoadError(f"{mpath}: index was built without ScaNN (searcher={m['searcher']!r})")
            s = ScannSearcher.load(os.path.join(local, "scann"), n, m["scann_params"])
        elif kind == "exact":
            s = ExactSearcher(np.memmap(emb_path, np.float32, "r", shape=(n, dim)))
        else:
            raise IndexLoadError(f"searcher must be 'exact' or 'scann', got {kind!r}")
        return cls(index_dir, m, s, docs, local_dir=local)

    def search_embeddings(self, q: np.ndarray, topk: int) -> list[list[dict]]:
        idx, scores = self.searcher.search(q, topk)
        return [[{"document": self.docs.get(int(i)), "score": float(s)} for i, s in zip(ri, rs) if i >= 0]
                for ri, rs in zip(idx, scores)]
