"""Row-addressable passage store: `docs.jsonl` (one {"id","contents"} per line) + `doc_offsets.npy`.

Row i of the store is row i of the embedding matrix. Reads use os.pread (no shared file position),
so concurrent server threads may call `get` freely.
"""
from __future__ import annotations

import json
import os

import numpy as np

from rexrag_jax.retrieval.corpus import CorpusError, iter_corpus

DOCS, OFFSETS = "docs.jsonl", "doc_offsets.npy"


def write_docstore(corpus_path: str, out_dir: str, progress=None, check_duplicate_ids: bool = True) -> int:
    """Stream the corpus into out_dir/docs.jsonl + doc_offsets.npy (atomic renames); returns the row count."""
    docs_tmp, off_tmp = os.path.join(out_dir, DOCS + ".tmp"), os.path.join(out_dir, "doc_offsets.tmp.npy")
    offsets, seen, pos = [0], set(), 0
    with open(docs_tmp, "wb") as f:
        for p in iter_corpus(corpus_path):
            if check_duplicate_ids:
                if p.id in seen:
                    raise CorpusError(f"{corpus_path}: duplicate passage id {p.id!r} (row {len(offsets) - 1})")
                seen.add(p.id)
            line = (json.dumps(p.as_dict(), ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            pos += len(line)
            offsets.append(pos)
            if progress is not None:
                progress.update(1)
    if len(offsets) == 1:
        raise CorpusError(f"{corpus_path}: corpus has no passages")
    np.save(off_tmp, np.asarray(offsets, np.int64))
    os.replace(docs_tmp, os.path.join(out_dir, DOCS))
    os.replace(off_tmp, os.path.join(out_dir, OFFSETS))
    return len(offsets) - 1


class DocStore:
    def __init__(self, index_dir: str):
        self.path = os.path.join(index_dir, DOCS)
        self.offsets = np.load(os.path.join(index_dir, OFFSETS), mmap_mode="r")
        size = os.path.getsize(self.path)
        if int(self.offsets[-1]) != size:
            raise ValueError(f"{self.path}: size {size} bytes does not match {OFFSETS} (expected {int(self.offsets[-1])})")
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self):
        return len(self.offsets) - 1

    def get(self, i: int) -> dict:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return json.loads(os.pread(self._fd, b - a, a))

    def texts(self, start: int, stop: int) -> list[str]:
        """Contents of rows [start, stop) in one read (used when encoding a shard)."""
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        return [json.loads(line)["contents"] for line in os.pread(self._fd, b - a, a).splitlines()]

    def close(self):
        os.close(self._fd)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
