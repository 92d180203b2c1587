"""Merge per-host part indexes into one index (the multi-host wiki-18 build, docs/retrieval.md).

Each host h of H builds an exact index over its line-aligned slice of the corpus (`split -n l/H`), the
part directories are copied to one host, and `merge_indexes` concatenates them in part order:

    docs.jsonl / doc_offsets.npy   byte-concatenated, offsets shifted by the bytes before each part
    embeddings.f32                 row-concatenated (streamed in chunks; never all in memory at once)
    manifest corpus.sha256         sha256 of the part corpus files concatenated in order, which is the
                                   sha256 of the original corpus when the parts are its `split` output,
                                   so `Index.load(merged, corpus_path=original)` verifies the merge
    searcher                       exact or ScaNN, built once over the merged embeddings

Every part must be a finished index with the same encoder record and dimension, and passage ids must
be unique across parts. The merge writes only under `index_dir.partial/` and swaps the result in by
rename, so an existing index at `index_dir` survives any failure (a failed merge starts over: it is a
copy, cheap next to encoding).

Parts, corpus files and the output may be gs:// URLs (rexrag_jax.io.paths): remote parts are read from
their local cache copies (`index.local_dir_of`), a remote output is merged in its local cache dir and
uploaded, manifest last (`index.staged_output`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
from tqdm.auto import tqdm

from rexrag_jax.io import paths
from rexrag_jax.retrieval.docstore import DOCS, OFFSETS
from rexrag_jax.retrieval.index import (EMB, MANIFEST, IndexLoadError, check_index_files, choose_searcher,
                                        finish_index, local_dir_of, normalize_dir, read_manifest, staged_output)


def _check_parts(part_dirs: list[str], local_dirs: list[str]) -> list[dict]:
    manifests = []
    for d, local in zip(part_dirs, local_dirs):
        m = read_manifest(local)
        check_index_files(local, m).close()
        if manifests:
            first, mpath = manifests[0], paths.join(d, MANIFEST)
            diff = {k: (first["encoder"].get(k), m["encoder"].get(k))
                    for k in set(first["encoder"]) | set(m["encoder"]) if first["encoder"].get(k) != m["encoder"].get(k)}
            if diff:
                raise IndexLoadError(f"{mpath}: encoder differs from {part_dirs[0]}, (first, this) per field: {diff}")
            if m["dim"] != first["dim"]:
                raise IndexLoadError(f"{mpath}: dim {m['dim']} differs from {part_dirs[0]} ({first['dim']})")
        manifests.append(m)
    return manifests


def _corpus_sha(manifests: list[dict], corpus_paths: list[str] | None, progress: bool) -> str:
    """sha256 of the parts' corpus files concatenated in order; each file must still hash to the
    checksum its part was built from (a part file edited after its build is refused)."""
    files = corpus_paths or [m["corpus"]["path"] for m in manifests]
    if len(files) != len(manifests):
        raise ValueError(f"merge_indexes: {len(files)} corpus_paths for {len(manifests)} parts")
    h = hashlib.sha256()
    for i, (path, m) in enumerate(zip(files, manifests)):
        if not paths.isfile(path):
            raise IndexLoadError(f"part {i}: corpus file {path} not found (it is hashed to record the merged "
                                 f"corpus checksum; pass corpus_paths= if the part files moved)")
        part_h = hashlib.sha256()
        total = None if paths.is_remote(path) else os.path.getsize(path)
        with paths.open_file(path, "rb") as f, tqdm(total=total, unit="B", unit_scale=True,
                                                    desc=f"hash corpus part {i}", disable=not progress) as bar:
            while block := f.read(1 << 22):
                h.update(block)
                part_h.update(block)
                bar.update(len(block))
        if part_h.hexdigest() != m["corpus"]["sha256"]:
            raise IndexLoadError(f"part {i}: corpus file {path} has sha256 {part_h.hexdigest()[:12]}…, but the "
                                 f"part was built from sha256 {m['corpus']['sha256'][:12]}…")
    return h.hexdigest()


def _merge_docstores(part_dirs: list[str], work: str, check_duplicate_ids: bool, progress: bool) -> None:
    offsets, base, seen = [np.zeros(1, np.int64)], 0, set()
    tmp_docs, tmp_off = os.path.join(work, DOCS + ".tmp"), os.path.join(work, "doc_offsets.tmp.npy")
    with open(tmp_docs, "wb") as out:
        for i, d in enumerate(part_dirs):
            off = np.load(os.path.join(d, OFFSETS))
            with open(os.path.join(d, DOCS), "rb") as f:
                if not check_duplicate_ids:
                    shutil.copyfileobj(f, out, 1 << 22)
                else:  # one pass: check each id and copy its line
                    for row, line in enumerate(tqdm(f, total=len(off) - 1, desc=f"docstore part {i}",
                                                    unit="passage", disable=not progress)):
                        pid = json.loads(line)["id"]
                        if pid in seen:
                            raise IndexLoadError(f"{os.path.join(d, DOCS)}: passage id {pid!r} (row {row}) is "
                                                 f"already in an earlier part; parts must not overlap")
                        seen.add(pid)
                        out.write(line)
            offsets.append(off[1:] + base)
            base += int(off[-1])
    np.save(tmp_off, np.concatenate(offsets))
    os.replace(tmp_docs, os.path.join(work, DOCS))
    os.replace(tmp_off, os.path.join(work, OFFSETS))


def merge_indexes(part_dirs: list[str], index_dir: str, *, searcher: str = "auto", exact_max_rows: int = 100_000,
                  scann_params: dict | None = None, corpus_paths: list[str] | None = None,
                  check_duplicate_ids: bool = True, chunk_rows: int = 262_144,
                  extra_files: dict[str, str] | None = None, progress: bool = True) -> str:
    """Concatenate finished part indexes (in the given order) into one index at `index_dir`; returns it.

    Row r of part p becomes row (rows of parts before p) + r. `corpus_paths` overrides the part corpus
    files recorded in the part manifests (they are hashed for the merged checksum).
    """
    if not part_dirs:
        raise ValueError("merge_indexes: no part directories given")
    part_dirs = [normalize_dir(d) for d in part_dirs]
    index_dir = normalize_dir(index_dir)
    if index_dir in part_dirs:
        raise ValueError(f"merge_indexes: the output {index_dir} is also a part")
    if paths.is_remote(index_dir):
        paths.check_remote_dir(index_dir)  # a bad output bucket fails before any part is downloaded
    local_parts = [local_dir_of(d) for d in part_dirs]
    manifests = _check_parts(part_dirs, local_parts)
    kind = choose_searcher(sum(m["count"] for m in manifests), searcher, exact_max_rows)  # validates `searcher`
    sha = _corpus_sha(manifests, corpus_paths, progress)
    with staged_output(index_dir) as (index_dir, local_out):
        _merge_local(part_dirs, local_parts, manifests, local_out, kind, sha, scann_params, check_duplicate_ids,
                     chunk_rows, extra_files, progress)
    return index_dir


def _merge_local(part_dirs, local_parts, manifests, index_dir, kind, sha, scann_params, check_duplicate_ids,
                 chunk_rows, extra_files, progress) -> str:
    work = index_dir + ".partial"
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    _merge_docstores(local_parts, work, check_duplicate_ids, progress)

    n, dim = sum(m["count"] for m in manifests), manifests[0]["dim"]
    emb = np.memmap(os.path.join(work, EMB), np.float32, "w+", shape=(n, dim))
    row = 0
    with tqdm(total=n, desc="merge embeddings", unit="row", disable=not progress) as bar:
        for d, m in zip(local_parts, manifests):
            src = np.memmap(os.path.join(d, EMB), np.float32, "r", shape=(m["count"], dim))
            for lo in range(0, m["count"], chunk_rows):
                hi = min(m["count"], lo + chunk_rows)
                emb[row + lo: row + hi] = src[lo:hi]
                bar.update(hi - lo)
            row += m["count"]
            del src
    emb.flush()

    parts = [{"index_dir": d, "count": m["count"], "corpus": m["corpus"]} for d, m in zip(part_dirs, manifests)]
    corpus = {"path": f"concatenation of {len(parts)} part corpus files", "sha256": sha, "parts": parts}
    return finish_index(work, index_dir, emb, kind, scann_params, {"encoder": manifests[0]["encoder"], "corpus": corpus},
                        extra_files, progress)
