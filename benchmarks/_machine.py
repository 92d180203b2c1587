"""This machine's physical limits, measured in the calling run: JAX fp32 GEMM peak and memory read bandwidth.

Benchmarks divide by these (MFU, % of roofline) rather than by a datasheet figure: on a shared CPU the
attainable peak moves with load, so it is measured next to the thing it judges.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _best(fn, repeats: int) -> float:
    fn()  # compile + warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_peak(sizes=(1024, 2048), repeats: int = 5, dtype=jnp.float32) -> dict:
    """Best FLOP/s of an n×n @ n×n matmul over `sizes` (2·n³ FLOPs each)."""
    out = {}
    for n in sizes:
        a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
        b = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype)
        f = jax.jit(jnp.matmul)
        t = _best(lambda: f(a, b).block_until_ready(), repeats)
        out[n] = 2 * n ** 3 / t
    return {"flops_per_s": max(out.values()), "per_size": out}


def read_bandwidth(gib: float = 0.5, repeats: int = 5) -> float:
    """Bytes/s of a jitted full reduction over a `gib` GiB fp32 array (one read of every byte)."""
    n = int(gib * 2 ** 30 // 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.sum)
    t = _best(lambda: f(x).block_until_ready(), repeats)
    del x
    return n * 4 / t


def measure(gemm_repeats: int = 5, bw_gib: float = 0.5) -> dict:
    peak = gemm_peak(repeats=gemm_repeats)
    return {"gemm_flops_per_s": peak["flops_per_s"], "gemm_per_size": peak["per_size"],
            "read_bytes_per_s": read_bandwidth(bw_gib)}
