"""Maximum-inner-product search over unit embeddings: exact (blocked matmul) and ScaNN.

Both return `(indices int64 [Q, k], scores float32 [Q, k])`, best first, k = min(topk, N).
ScaNN = tree partitioning (k-means leaves) + asymmetric hashing (anisotropic PQ scoring) +
exact float32 reordering of the best `reorder_k` candidates. `num_leaves=0` drops the tree: every
point is scored by asymmetric hashing (ScaNN's recommended setting for mid-sized corpora, and the only
one that helps on data without cluster structure, where a partition loses the true neighbours).
"""
from __future__ import annotations

import math
import os

import numpy as np


def exact_topk(db: np.ndarray, queries: np.ndarray, k: int, block_rows: int = 1 << 18):
    """Top-k of queries @ db.T by scanning db in row blocks (db may be a memmap larger than RAM)."""
    n = db.shape[0]
    k = min(k, n)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    best_s = np.full((q.shape[0], 0), -np.inf, np.float32)
    best_i = np.zeros((q.shape[0], 0), np.int64)
    for start in range(0, n, block_rows):
        s = q @ np.asarray(db[start:start + block_rows], dtype=np.float32).T
        kk = min(k, s.shape[1])
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        best_s = np.concatenate([best_s, np.take_along_axis(s, part, 1)], 1)
        best_i = np.concatenate([best_i, part + start], 1)
        if best_s.shape[1] > k:
            keep = np.argpartition(-best_s, k - 1, axis=1)[:, :k]
            best_s, best_i = np.take_along_axis(best_s, keep, 1), np.take_along_axis(best_i, keep, 1)
    order = np.lexsort((best_i, -best_s), axis=1) if best_s.size else np.zeros_like(best_i)
    return np.take_along_axis(best_i, order, 1), np.take_along_axis(best_s, order, 1)


class ExactSearcher:
    kind = "exact"

    def __init__(self, db: np.ndarray):
        self.db = db

    def __len__(self):
        return self.db.shape[0]

    def search(self, queries: np.ndarray, k: int):
        return exact_topk(self.db, queries, k)

    def save(self, path: str):  # the embeddings file is the whole index
        pass


def default_scann_params(n: int) -> dict:
    """Rule-of-thumb ScaNN settings: ~sqrt(n) leaves, search ~5% of them (>= 8), reorder 100.

    For wiki-18 (21M) this gives 4,583 leaves, 229 searched; see docs/retrieval.md.
    """
    num_leaves = max(2, min(int(math.sqrt(n)), n // 50))
    return {"num_leaves": num_leaves, "num_leaves_to_search": max(min(8, num_leaves), num_leaves // 20),
            "dimensions_per_block": 2, "anisotropic_quantization_threshold": 0.2,
            "reorder_k": 100, "training_sample_size": min(n, 250_000), "spherical": False, "soar_lambda": None}


class ScannSearcher:
    kind = "scann"

    def __init__(self, searcher, n: int, params: dict):
        self._s, self.n, self.params = searcher, n, params

    def __len__(self):
        return self.n

    @classmethod
    def build(cls, db: np.ndarray, **overrides) -> "ScannSearcher":
        import scann

        n = db.shape[0]
        params = {**default_scann_params(n), **{k: v for k, v in overrides.items() if v is not None}}
        if params["num_leaves"] < 0 or (params["num_leaves"] > 0 and params["num_leaves_to_search"] < 1):
            raise ValueError(f"ScaNN num_leaves must be >= 0 (0 = no tree) and num_leaves_to_search >= 1, "
                             f"got {params['num_leaves']} / {params['num_leaves_to_search']}")
        b = scann.scann_ops_pybind.builder(np.ascontiguousarray(db, dtype=np.float32), 10, "dot_product")
        if params["num_leaves"] > 0:
            # spherical: k-means on the unit sphere; soar_lambda: SOAR spilling (each point also goes to a
            # second leaf chosen for orthogonal residuals), more recall per leaf searched for ~2x the codes
            b = b.tree(num_leaves=params["num_leaves"], num_leaves_to_search=params["num_leaves_to_search"],
                       training_sample_size=params["training_sample_size"],
                       spherical=bool(params.get("spherical", False)), soar_lambda=params.get("soar_lambda"))
            ah = {}
        else:  # no tree: the AH codebooks are trained on the same sample the tree would have used
            params["num_leaves_to_search"] = 0
            ah = {"training_sample_size": params["training_sample_size"]}
        b = b.score_ah(params["dimensions_per_block"],
                       anisotropic_quantization_threshold=params["anisotropic_quantization_threshold"], **ah)
        b = b.reorder(params["reorder_k"])
        return cls(b.build(), n, params)

    def _knobs(self, k: int) -> dict:
        knobs = {"final_num_neighbors": k, "pre_reorder_num_neighbors": max(self.params["reorder_k"], k)}
        if self.params["num_leaves"] > 0:
            knobs["leaves_to_search"] = self.params["num_leaves_to_search"]
        return knobs

    def search(self, queries: np.ndarray, k: int):
        k = min(k, self.n)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        idx, dist = self._s.search_batched(q, **self._knobs(k))
        return np.asarray(idx, np.int64), np.asarray(dist, np.float32)

    def search_one(self, query: np.ndarray, k: int):
        """One query [D] -> (indices [k], scores [k]): ScaNN's single-query path (no batch setup)."""
        k = min(k, self.n)
        idx, dist = self._s.search(np.ascontiguousarray(query, dtype=np.float32), **self._knobs(k))
        return np.asarray(idx, np.int64), np.asarray(dist, np.float32)

    def set_num_threads(self, n: int):
        self._s.set_num_threads(n)

    def save(self, path: str):
        os.makedirs(path, exist_ok=True)
        self._s.serialize(path, relative_path=True)  # the index dir is renamed after the build

    @classmethod
    def load(cls, path: str, n: int, params: dict) -> "ScannSearcher":
        import scann

        return cls(scann.scann_ops_pybind.load_searcher(path), n, params)
