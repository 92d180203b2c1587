"""token_logprobs_chunked == token_logprobs (values and gradients), incl. chunks that don't divide T-1."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import init_params, token_logprobs, token_logprobs_chunked


@pytest.fixture(scope="module")
def setup():
    cfg = Qwen2Config.from_preset("tiny", tie_word_embeddings=False)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 11)), jnp.int32)
    mask = jnp.asarray(np.arange(11)[None, :] < np.array([[11], [8], [5]]), jnp.int32)
    return cfg, params, tokens, mask


@pytest.mark.parametrize("chunk", [1, 4, 10, 64])
def test_chunked_equals_full(setup, chunk):
    cfg, params, tokens, mask = setup
    ref = token_logprobs(params, tokens, cfg, attention_mask=mask, temperature=0.7)
    got = token_logprobs_chunked(params, tokens, cfg, attention_mask=mask, temperature=0.7, chunk=chunk)
    assert got.shape == ref.shape == tokens.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    assert float(jnp.abs(ref).min(axis=0)[1:].min()) > 0.1  # real log-probs, not zeros
    assert not np.asarray(got[:, 0]).any()


def test_chunked_gradients_equal_full(setup):
    cfg, params, tokens, mask = setup

    def loss(fn, p):
        return jnp.sum(fn(p) * mask)

    g_ref = jax.grad(lambda p: loss(lambda q: token_logprobs(q, tokens, cfg, attention_mask=mask), p))(params)
    g_got = jax.grad(lambda p: loss(lambda q: token_logprobs_chunked(q, tokens, cfg, attention_mask=mask,
                                                                     chunk=4), p))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g_got), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    assert float(jnp.abs(g_ref["lm_head"]).max()) > 1e-3


def test_chunked_tied_and_single_token(setup):
    _, _, tokens, mask = setup
    cfg = Qwen2Config.from_preset("tiny")
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    np.testing.assert_allclose(np.asarray(token_logprobs_chunked(params, tokens, cfg, mask, chunk=3)),
                               np.asarray(token_logprobs(params, tokens, cfg, mask)), atol=1e-5, rtol=0)
    assert np.asarray(token_logprobs_chunked(params, tokens[:, :1], cfg, chunk=3)).tolist() == [[0.0]] * 3
