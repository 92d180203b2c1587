"""Meshes, param shardings from the logical rules, and sharded forward == unsharded forward."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import forward, init_cache, init_params
from rexrag_jax.sharding import (cache_shardings, make_mesh, param_shardings, shard_params, sharded_forward,
                                 spec_for_shape, use_mesh)

# heads 4, kv_heads 2, mlp 128, vocab 512, embed 64: all divisible by tensor=2 and fsdp<=4.
CFG = Qwen2Config.from_preset("tiny", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.PRNGKey(0), std=0.2)
    params["layers"]["q_bias"] = 0.3 * jax.random.normal(jax.random.PRNGKey(1), params["layers"]["q_bias"].shape)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (8, 16)), jnp.int32)
    mask = jnp.asarray(np.arange(16)[None, :] < rng.integers(4, 17, (8, 1)), jnp.int32)
    ref = jax.jit(lambda p, t, m: forward(p, t, CFG, attention_mask=m)[0])(params, tokens, mask)
    return params, tokens, mask, np.asarray(ref)


def test_make_mesh_shapes_and_errors():
    assert len(jax.devices()) == 8
    m = make_mesh(2, 2, 2)
    assert m.axis_names == ("data", "fsdp", "tensor") and dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape)["fsdp"] == 2
    assert sorted(d.id for d in make_mesh(1, 8, 1).devices.flat) == list(range(8))
    with pytest.raises(ValueError, match=r"2\*2\*1 = 4 but there are 8 devices"):
        make_mesh(2, 2, 1)
    with pytest.raises(ValueError, match="cannot be split"):
        make_mesh(3, -1, 1)
    with pytest.raises(ValueError, match="at most one axis"):
        make_mesh(-1, -1, 2)


def test_non_divisible_dim_falls_back_to_replication(caplog):
    mesh = make_mesh(1, 2, 4)
    with caplog.at_level(logging.DEBUG, logger="rexrag_jax.sharding.rules"):
        spec = spec_for_shape(("layers", "embed", "kv_heads", "head_dim"), (36, 2048, 2, 128), mesh, name="k")
    assert spec == P(None, "fsdp", None, None)
    assert "k: dim 2 (kv_heads, size 2) not divisible" in caplog.text
    assert spec_for_shape(("layers", "embed", "heads", "head_dim"), (36, 2048, 16, 128), mesh) == \
        P(None, "fsdp", "tensor", None)
    # batch -> (data, fsdp): trimmed from the right until it divides
    mesh = make_mesh(2, 4, 1)
    assert spec_for_shape(("batch", "length"), (8, 5), mesh) == P(("data", "fsdp"), None)
    assert spec_for_shape(("batch", "length"), (6, 5), mesh) == P("data", None)
    assert spec_for_shape(("batch", "length"), (3, 5), mesh) == P(None, None)
    with pytest.raises(KeyError, match="'nonsense' has no rule"):
        spec_for_shape(("nonsense",), (4,), mesh)


def test_qwen25_3b_kv_heads_replicated_on_tensor_4():
    cfg = Qwen2Config.from_preset("qwen2.5-3b")
    sh = param_shardings(cfg, make_mesh(1, 2, 4))
    assert sh["layers"]["k_kernel"].spec == P(None, "fsdp", None, None)
    assert sh["layers"]["q_kernel"].spec == P(None, "fsdp", "tensor", None)
    assert sh["embed"].spec == P("tensor", "fsdp") and "lm_head" not in sh


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 4, 2), (2, 2, 2), (1, 2, 4)])
def test_sharded_forward_equals_unsharded(setup, shape):
    params, tokens, mask, ref = setup
    mesh = make_mesh(*shape)
    shardings = param_shardings(CFG, mesh)
    sharded = shard_params(params, shardings)
    q = sharded["layers"]["q_kernel"]  # [L, D, H, Hd] = [2, 64, 4, 16]
    fsdp, tensor = shape[1], shape[2]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64 // fsdp, 4 // tensor, 16)}
    assert {s.data.shape for s in sharded["lm_head"].addressable_shards} == {(64 // fsdp, 512 // tensor)}
    if tensor == 4:  # 2 KV heads cannot split 4 ways: that dim is replicated, the rest still sharded
        assert sharded["layers"]["k_kernel"].sharding.spec == P(None, "fsdp", None, None)
    if tensor > 1:
        assert sharded["layers"]["down_kernel"].sharding.spec == P(None, "tensor", "fsdp" if fsdp > 1 else None)
    logits = sharded_forward(CFG, mesh, shardings)(sharded, tokens, mask)
    assert logits.sharding.spec[0] in (("data", "fsdp"), "data", "fsdp")
    np.testing.assert_allclose(np.asarray(logits) * np.asarray(mask)[..., None], ref * np.asarray(mask)[..., None],
                               atol=2e-5, rtol=0)  # reduction order of sharded matmuls; max seen 1.3e-5 (std 0.2 init)


def test_sharded_cached_decode_equals_unsharded(setup):
    params, tokens, _, _ = setup
    mesh = make_mesh(2, 2, 2)
    shardings = param_shardings(CFG, mesh)
    csh = cache_shardings(CFG, mesh, batch=8, max_len=16)
    assert csh["k"].spec == P(None, ("data", "fsdp"), None, "tensor", None)

    def two_steps(p, c):
        a, c = forward(p, tokens[:, :10], CFG, cache=c)
        b, c = forward(p, tokens[:, 10:11], CFG, cache=c)
        return jnp.concatenate([a, b], axis=1), c

    ref, _ = jax.jit(two_steps)(params, init_cache(CFG, 8, 16))
    fn = jax.jit(two_steps, in_shardings=(shardings, csh), out_shardings=(None, csh))
    with use_mesh(mesh):
        got, cache = fn(shard_params(params, shardings), jax.device_put(init_cache(CFG, 8, 16), csh))
    assert cache["k"].sharding.spec == csh["k"].spec
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)


def test_shard_params_names_mismatched_leaf(setup):
    params = dict(setup[0])
    del params["lm_head"]
    with pytest.raises(ValueError, match=r"missing in params: \[\"\['lm_head'\]\"\]"):
        shard_params(params, param_shardings(CFG, make_mesh(2, 2, 2)))


@pytest.mark.parametrize("shape,vocab", [((1, 8, 1), 512), ((1, 4, 2), 512), ((2, 2, 2), 512), ((1, 8, 1), 508)])
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_chunked_logprobs_and_gradients_equal_unsharded(setup, shape, vocab, tied):
    """token_logprobs_chunked through the vocab-parallel head: values and the gradient of every leaf
    under a mesh equal the unsharded computation; a vocabulary that fsdp does not divide (508 on 8) keeps
    the parameter layout (vocab_parallel_head falls back) with the same values."""
    from rexrag_jax.models.qwen2.model import init_params, token_logprobs, token_logprobs_chunked, vocab_splits_over_fsdp
    from rexrag_jax.sharding import use_mesh

    _, tokens, mask, _ = setup
    cfg = CFG.replace(tie_word_embeddings=tied, vocab_size=vocab)
    tokens = tokens % vocab
    params = init_params(cfg, jax.random.PRNGKey(3))
    loss = lambda p: jnp.sum(token_logprobs_chunked(p, tokens, cfg, attention_mask=mask, chunk=4) * mask)  # noqa: E731
    ref_lp = token_logprobs(params, tokens, cfg, attention_mask=mask)
    ref_g = jax.grad(loss)(params)
    mesh = make_mesh(*shape)
    shardings = param_shardings(cfg, mesh)
    with use_mesh(mesh):
        assert vocab_splits_over_fsdp(cfg) == (vocab % shape[1] == 0)
        lp = jax.jit(lambda p: token_logprobs_chunked(p, tokens, cfg, attention_mask=mask, chunk=4))(
            shard_params(params, shardings))
        g = jax.jit(jax.grad(loss))(shard_params(params, shardings))
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(lp) * m, np.asarray(ref_lp) * m, atol=2e-5, rtol=0)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree_util.tree_leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4, err_msg=str(path))
