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
    on a batch-sharded mesh no all-gather comes near the size of k (the gathered path all-gathers the
    whole k and v on every device)."""
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
    assert ref_gather >= cache_bytes  # the bug this path avoids: the whole cache gathered
    assert got_gather < cache_bytes // 4, (got_gather, cache_bytes)  # what is left: logits/weights, not k/v
