"""Trace-buffer speed: per-step costs of a RAPO buffer vs FAISS flat inner product (the peer).

    python -m rexrag_jax.rapo.bench [--size 20000] [--queries 512] [--minilm 256]

Per training step the buffer (1) adds the steps of the successful trajectories, (2) is re-indexed
(ScaNN rebuild; exact search needs none), (3) answers one batched query per turn for the rows that
drew an insertion (~half of the rollout batch). Embeddings here are random unit vectors of MiniLM's
384 dims, so the search figures exclude encoding; --minilm N also times encoding N histories with the
project's Flax MiniLM (CPU/accelerator, whatever JAX runs on).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from rexrag_jax.rapo.trace_buffer import TraceBuffer


def _timeit(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--minilm", type=int, default=0, help="also time MiniLM encoding of this many histories")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    unit = lambda n: (lambda x: x / np.linalg.norm(x, axis=1, keepdims=True))(  # noqa: E731
        rng.normal(size=(n, 384)).astype(np.float32))
    db, q = unit(args.size), unit(args.queries)
    table = {}
    lookup = {f"k{i}": db[i] for i in range(args.size)}
    lookup.update({f"q{i}": q[i] for i in range(args.queries)})
    encode = lambda texts: np.stack([lookup[t] for t in texts])  # noqa: E731

    for kind in ("exact", "scann"):
        buf = TraceBuffer(encode, capacity=args.size, searcher=kind)
        t0 = time.perf_counter()
        buf.add([f"k{i}" for i in range(args.size)], ["v"] * args.size)
        t_add = time.perf_counter() - t0
        t0 = time.perf_counter()
        buf._get_searcher()
        t_index = time.perf_counter() - t0
        t_q, hits = _timeit(lambda: buf.query([f"q{i}" for i in range(args.queries)], args.topk))
        table[kind] = (t_add, t_index, t_q, np.array([[h["index"] for h in row] for row in hits]))

    import faiss
    index = faiss.IndexFlatIP(384)
    t0 = time.perf_counter()
    index.add(db)
    t_fadd = time.perf_counter() - t0
    t_f, (_, fidx) = _timeit(lambda: index.search(q, args.topk))

    exact_idx = table["exact"][3]
    print(f"buffer {args.size} x 384, {args.queries} queries, top-{args.topk}")
    print(f"{'searcher':<12}{'add s':>9}{'index s':>9}{'query ms':>10}{'vs faiss':>10}{'recall@1':>10}")
    for kind, (t_add, t_index, t_q, idx) in table.items():
        recall = float(np.mean(idx[:, 0] == fidx[:, 0]))
        print(f"{kind:<12}{t_add:>9.3f}{t_index:>9.3f}{t_q * 1e3:>10.2f}{t_f / t_q:>9.2f}x{recall:>10.3f}")
    print(f"{'faiss-flat':<12}{t_fadd:>9.3f}{0.0:>9.3f}{t_f * 1e3:>10.2f}{1.0:>9.2f}x"
          f"{float(np.mean(exact_idx[:, 0] == fidx[:, 0])):>10.3f}")
    print("(vs faiss = faiss query time / ours: > 1 means faster than FAISS flat)")

    if args.minilm:
        from rexrag_jax.rapo.trace_buffer import minilm_encode_fn
        enc = minilm_encode_fn()
        texts = [f"question {i} about something\n<think> step {i} </think> <search> query {i} </search>" * 3
                 for i in range(args.minilm)]
        enc(texts)  # compile every batch/length bucket first
        t, _ = _timeit(lambda: enc(texts), repeat=2)
        print(f"MiniLM encode: {args.minilm} histories in {t:.2f} s ({args.minilm / t:.0f}/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
