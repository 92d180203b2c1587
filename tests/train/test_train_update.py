"""The mini-batch update: exact gradient accumulation, learning signal, non-finite skip, AdamW equivalence."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.rl.loss import grpo_token_loss
from rexrag_jax.train.optim import OptimizerConfig
from rexrag_jax.train.update import (LossConfig, accumulate_gradients, logprobs_and_entropy, make_update_fn,
                                     policy_logprobs)

CFG = Qwen2Config.from_preset("tiny")
N, T = 8, 24


@pytest.fixture(scope="module")
def setup():
    params = qwen2.init_params(CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, T + 1, N)
    attn = np.arange(T)[None] < lengths[:, None]
    # Very different loss-token counts per row, so a mean of micro-batch means would differ.
    starts = np.array([2, 9, 4, 20, 6, 3, 15, 8])
    loss_mask = attn & (np.arange(T)[None] >= np.minimum(starts, lengths - 1)[:, None])
    tokens = np.where(attn, rng.integers(1, CFG.vocab_size, (N, T)), 0).astype(np.int32)
    logp = np.asarray(policy_logprobs(params, tokens, attn, CFG))
    batch = {
        "tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask,
        "behaviour_logp": np.where(loss_mask, logp + rng.normal(0, 0.1, (N, T)), 0).astype(np.float32),
        "ref_logp": np.where(loss_mask, logp + rng.normal(0, 0.1, (N, T)), 0).astype(np.float32),
        "advantages": rng.normal(0, 1, N).astype(np.float32),
        "is_probe": np.array([0, 1, 0, 0, 1, 0, 0, 1], bool),
    }
    return params, batch


def _split(batch, micro):
    return {k: v.reshape((N // micro, micro) + v.shape[1:]) for k, v in batch.items()}


def _full_loss(params, b, loss_cfg):
    logp = policy_logprobs(params, b["tokens"], b["attention_mask"], CFG)
    s, c, _ = grpo_token_loss(logp, b["behaviour_logp"], b["ref_logp"], b["advantages"], b["loss_mask"],
                              kl_coef=loss_cfg.kl_coef, is_probe=b["is_probe"])
    return s / c


def test_accumulated_gradient_equals_full_minibatch_gradient(setup):
    params, batch = setup
    loss_cfg = LossConfig(kl_coef=0.05)
    ref_loss, ref_grads = jax.value_and_grad(_full_loss)(params, batch, loss_cfg)
    grads, loss, count, metrics = jax.jit(accumulate_gradients, static_argnums=(2, 3))(
        params, _split(batch, 2), CFG, loss_cfg)
    assert int(count) == int(batch["loss_mask"].sum())
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=1e-7)
    # The naive mean of per-micro-batch token means is a different number here: the test can fail.
    naive = np.mean([float(_full_loss(params, {k: v[i:i + 2] for k, v in batch.items()}, loss_cfg))
                     for i in range(0, N, 2)])
    assert abs(naive - float(ref_loss)) > 1e-3
    # Split metrics are merged exactly: token counts add up over micro-batches.
    assert int(metrics["probe/tokens"]) == int((batch["loss_mask"] & batch["is_probe"][:, None]).sum())


def test_entropy_pass_matches_full_logits(setup):
    params, batch = setup
    lp, ent = logprobs_and_entropy(params, batch["tokens"], batch["attention_mask"], CFG, chunk=5)
    logits, _ = qwen2.forward(params, batch["tokens"], CFG, attention_mask=batch["attention_mask"])
    full = jax.nn.log_softmax(logits[:, :-1], -1)
    ref_ent = -(jnp.exp(full) * full).sum(-1)
    np.testing.assert_allclose(np.asarray(ent[:, 1:]), np.asarray(ref_ent), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(policy_logprobs(params, batch["tokens"],
                                                                          batch["attention_mask"], CFG)),
                               rtol=1e-5, atol=1e-5)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def test_positive_advantage_increases_logprob(setup):
    params, batch = setup
    b = dict(batch, advantages=np.ones(N, np.float32))
    opt_cfg = OptimizerConfig(learning_rate=1e-3, warmup_fraction=0.0)
    opt = opt_cfg.make()
    update = make_update_fn(CFG, opt, LossConfig(kl_coef=0.0))
    p = _copy(params)
    before = np.asarray(policy_logprobs(p, b["tokens"], b["attention_mask"], CFG))
    b["behaviour_logp"] = np.where(b["loss_mask"], before, 0).astype(np.float32)
    b.pop("ref_logp")
    state = opt.init(p)
    for _ in range(3):
        p, state, m = update(p, state, _split(b, 4), jnp.float32(1e-3), jnp.bool_(False))
        assert int(m["skipped"]) == 0
    after = np.asarray(policy_logprobs(p, b["tokens"], b["attention_mask"], CFG))
    mask = b["loss_mask"]
    assert after[mask].mean() > before[mask].mean() + 0.05
    # Tokens outside the loss mask were not targeted (mean change is much smaller there).
    assert (after[mask] - before[mask]).mean() > 3 * abs((after[~mask] - before[~mask]).mean())


def test_nonfinite_step_is_skipped(setup):
    params, batch = setup
    opt = OptimizerConfig(learning_rate=1e-3, warmup_fraction=0.0).make()
    update = make_update_fn(CFG, opt, LossConfig())
    p0 = _copy(params)
    state0 = opt.init(p0)
    expect_p, expect_s = jax.tree.map(np.asarray, p0), jax.tree.map(np.asarray, state0)
    p1, s1, m = update(p0, state0, _split(batch, 4), jnp.float32(1e-3), jnp.bool_(True))
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(expect_p)):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(expect_s)):
        np.testing.assert_array_equal(np.asarray(a), b)
    # The same update without poison changes the params.
    p2, _, m2 = update(p1, s1, _split(batch, 4), jnp.float32(1e-3), jnp.bool_(False))
    assert int(m2["skipped"]) == 0
    assert not np.array_equal(np.asarray(p2["embed"]), expect_p["embed"])


def test_update_equals_optax_adamw_with_clipping(setup):
    params, batch = setup
    lr, wd = 3e-3, 0.01
    opt_cfg = OptimizerConfig(learning_rate=lr, weight_decay=wd, warmup_fraction=0.0, max_grad_norm=0.05)
    loss_cfg = LossConfig(kl_coef=0.05)
    ref_grads = jax.grad(_full_loss)(params, batch, loss_cfg)
    ref_opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(lr, weight_decay=wd))
    ref_updates, _ = ref_opt.update(ref_grads, ref_opt.init(params), params)
    expected = optax.apply_updates(params, ref_updates)
    opt = opt_cfg.make()
    update = make_update_fn(CFG, opt, loss_cfg)
    p = _copy(params)
    p, _, m = update(p, opt.init(p), _split(batch, 2), jnp.float32(lr), jnp.bool_(False))
    assert float(m["grad_norm"]) > 0.05  # clipping was active
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(expected)):
        # First Adam step is ~lr·sign(g): entries with |g| near eps may differ by float noise.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-2 * lr)


def test_lr_schedule_reference_values():
    cfg = OptimizerConfig()  # SPEC §6: 1e-6, warmup 28.5% of 1005 steps, then constant
    assert cfg.warmup_steps == 286
    assert cfg.lr_at(0) == 0.0
    assert cfg.lr_at(143) == pytest.approx(0.5e-6)
    assert cfg.lr_at(286) == cfg.lr_at(1004) == 1e-6
