"""The engine on a (data=4, fsdp=2) mesh of fake CPU devices gives the unsharded engine's outputs."""
import jax
import numpy as np
from jax.sharding import Mesh

from rexrag_jax.generation import GenerationEngine

from .test_engine import CFG, params  # noqa: F401  (fixture)

PROMPTS = [[5, 6, 7], [8, 9], [1, 2, 3, 4], [7], [3, 3], [4, 4, 4], [9, 9, 1], [100]]


def _run(p, mesh):
    eng = GenerationEngine(p, CFG, 8, 128, decode_chunk=8, stop_strings=(), mesh=mesh)
    eng.append(list(range(8)), PROMPTS)
    eng.append([2], [[11, 12]])  # subset append: sub-batch padded up to the data-parallel size
    eng.copy_prefix(0, 5, 2)
    outs = eng.generate(list(range(8)), 10, jax.random.PRNGKey(0), temperature=1.0)
    return eng, outs


def test_sharded_engine_matches_unsharded(params):  # noqa: F811
    assert len(jax.devices()) >= 8
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2, 1), ("data", "fsdp", "tensor"))
    _, ref = _run(params, None)
    eng, got = _run(params, mesh)
    assert eng._k.sharding.spec[1] == ("data", "fsdp")  # cache batch axis sharded over data x fsdp
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_full_batch_prefill_gathers_no_cache_rows_and_matches_the_gathered_path(params):  # noqa: F811
    """Appending to every row uses prefill(all_rows=True): same k/v/logits as gathering rows 0..B-1, and
    on a batch-sharded mesh no all-gather comes near the size of k (the gathered path moves the rows it
    appends to, here all of them)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from rexrag_jax.generation import kernels
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.sharding import logical_to_spec
    from rexrag_jax.sharding.audit import collectives

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1), ("data", "fsdp", "tensor"))
    B, S, T = 8, 64, 16
    cache_sh = NamedSharding(mesh, logical_to_spec(qwen2.CACHE_LOGICAL_AXES, mesh=mesh))
    shape = (CFG.num_layers, B, S, CFG.num_kv_heads, CFG.head_dim)
    rng = np.random.default_rng(0)
    k0 = rng.normal(size=shape).astype(np.float32)
    v0 = rng.normal(size=shape).astype(np.float32)
    lengths = jnp.asarray(rng.integers(0, 20, B), jnp.int32)
    logits0 = jnp.asarray(rng.normal(size=(B, CFG.vocab_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(1, 200, (B, T)), jnp.int32)
    num_new = jnp.asarray([T, 0, 3, T, 1, 0, 7, T], jnp.int32)
    idx = jnp.arange(B, dtype=jnp.int32)
    p = jax.device_put(params, NamedSharding(mesh, jax.sharding.PartitionSpec()))
    out = {}
    for all_rows in (False, True):
        k = jax.device_put(k0, cache_sh)
        v = jax.device_put(v0, cache_sh)
        args = (p, k, v, lengths, jax.device_put(logits0, NamedSharding(mesh, logical_to_spec(("batch", None), mesh=mesh))),
                idx, tokens, num_new)
        kw = dict(cfg=CFG, window=S, mesh=mesh, vocab_limit=None, all_rows=all_rows)
        hlo = kernels.prefill.lower(*args, **kw).compile().as_text()
        gathers = [c.result_bytes for c in collectives(hlo) if c.kind == "all-gather"]
        out[all_rows] = ([np.asarray(x) for x in kernels.prefill(*args, **kw)], max(gathers, default=0))
    (ref, ref_gather), (got, got_gather) = out[False], out[True]
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, atol=1e-5)
    cache_bytes = k0.nbytes
    assert ref_gather >= cache_bytes  # the gathered path moves its rows: here every row of the cache
    assert got_gather < cache_bytes // 4, (got_gather, cache_bytes)  # what is left: logits/weights, not k/v


def test_subset_prefill_moves_only_its_rows_and_matches_unsharded(params):  # noqa: F811
    """prefill on a subset of rows of a row-sharded cache (kernels.gather_rows / scatter_rows): the same
    k / v / logits as without a mesh, and no collective as large as the cache (a plain gather with
    replicated indices all-gathered the whole k and v on every device), for a subset that splits over
    the devices (8 of 32 rows: reduce-scatter) and one that does not (3 rows: all-reduce)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from rexrag_jax.generation import kernels
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.sharding import logical_to_spec
    from rexrag_jax.sharding.audit import collectives

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    B, S, T, W = 32, 64, 8, 48
    shape = (CFG.num_layers, B, S, CFG.num_kv_heads, CFG.head_dim)
    rng = np.random.default_rng(1)
    k0, v0 = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    lengths = rng.integers(0, 30, B).astype(np.int32)
    logits0 = rng.normal(size=(B, CFG.vocab_size)).astype(np.float32)
    cache_sh = NamedSharding(mesh, logical_to_spec(qwen2.CACHE_LOGICAL_AXES, mesh=mesh))
    row_sh = NamedSharding(mesh, logical_to_spec(("batch", None), mesh=mesh))
    p = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    for idx in ([3, 17, 30, 8, 9, 0, 25, 12], [31, 4, 18]):
        nb = len(idx)
        idx = jnp.asarray(idx, jnp.int32)
        tokens = jnp.asarray(rng.integers(1, 200, (nb, T)), jnp.int32)
        num_new = jnp.asarray(rng.integers(0, T + 1, nb), jnp.int32)
        kw = dict(cfg=CFG, window=W, vocab_limit=None)
        ref = kernels.prefill(params, jnp.asarray(k0), jnp.asarray(v0), jnp.asarray(lengths), jnp.asarray(logits0),
                              idx, tokens, num_new, mesh=None, **kw)
        args = (p, jax.device_put(k0, cache_sh), jax.device_put(v0, cache_sh), jnp.asarray(lengths),
                jax.device_put(logits0, row_sh), idx, tokens, num_new)
        hlo = kernels.prefill.lower(*args, mesh=mesh, **kw).compile().as_text()
        moved = max(c.result_bytes for c in collectives(hlo))
        got = kernels.prefill(*args, mesh=mesh, **kw)
        assert got[0].sharding.spec[1] == ("data", "fsdp")  # the cache stays split by rows, in place
        for a, b in zip(ref, got):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
        assert moved <= k0.nbytes // 4, (nb, moved, k0.nbytes)  # the rows appended to, not the cache


def test_owner_laid_out_prefill_moves_no_cache_rows(params):  # noqa: F811
    """The engine groups the rows of an append by the device holding them (GenerationEngine._owner_layout),
    and prefill(owned_rows=True) then gathers, computes and writes back each device's rows locally: the
    same k / v / logits as without a mesh, and no collective of a cache row at all."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from rexrag_jax.generation import kernels
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.sharding import logical_to_spec
    from rexrag_jax.sharding.audit import collectives

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    B, S, T, W = 32, 256, 8, 192  # 8 devices hold 4 rows each; a row's window (48 KiB) >> its new k/v
    eng = GenerationEngine(params, CFG, B, S, stop_strings=(), mesh=mesh)
    rows = [3, 17, 18, 30]
    idx = eng._owner_layout(rows, {r: [1] for r in rows})
    # one row per device except device 4 (rows 16-19) with two: m = 2, padded by rows of the same block
    assert idx == [3, 0, 4, 5, 8, 9, 12, 13, 17, 18, 20, 21, 24, 25, 30, 28]
    shape = (CFG.num_layers, B, S, CFG.num_kv_heads, CFG.head_dim)
    rng = np.random.default_rng(2)
    k0, v0 = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    lengths = rng.integers(0, 30, B).astype(np.int32)
    logits0 = rng.normal(size=(B, CFG.vocab_size)).astype(np.float32)
    idx = jnp.asarray(idx, jnp.int32)
    tokens = jnp.asarray(rng.integers(1, 200, (len(idx), T)), jnp.int32)
    num_new = jnp.asarray([T if int(r) in rows else 0 for r in idx], jnp.int32)
    kw = dict(cfg=CFG, window=W, vocab_limit=None)
    ref = kernels.prefill(params, jnp.asarray(k0), jnp.asarray(v0), jnp.asarray(lengths), jnp.asarray(logits0),
                          idx, tokens, num_new, mesh=None, **kw)
    cache_sh = NamedSharding(mesh, logical_to_spec(qwen2.CACHE_LOGICAL_AXES, mesh=mesh))
    args = (jax.device_put(params, NamedSharding(mesh, PartitionSpec())), jax.device_put(k0, cache_sh),
            jax.device_put(v0, cache_sh), jnp.asarray(lengths),
            jax.device_put(logits0, NamedSharding(mesh, logical_to_spec(("batch", None), mesh=mesh))),
            idx, tokens, num_new)
    hlo = kernels.prefill.lower(*args, mesh=mesh, owned_rows=True, **kw).compile().as_text()
    row_window = k0.nbytes // B * W // S
    # what still crosses devices is the chunk's new k / v per layer ([rows, T, KV, Hd]), never a cache row
    moved = [(c.kind, c.result_bytes, c.op_name[-60:]) for c in collectives(hlo) if c.result_bytes >= row_window // 2]
    assert moved == []
    got = kernels.prefill(*args, mesh=mesh, owned_rows=True, **kw)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
