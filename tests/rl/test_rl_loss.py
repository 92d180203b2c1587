"""PPO-clip / k3 KL / token-mean aggregation: hand values, masking, metrics, exact gradient accumulation."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.rl.loss import (combine_micro_batches, entropy_from_logits, grpo_token_loss, k3_kl, ppo_clip_loss,
                                token_mean)


def test_k3_kl_values_and_clamps():
    kl = np.asarray(k3_kl(jnp.array([0.0, 0.0, 0.0, -1.0]), jnp.array([0.5, -30.0, 30.0, -1.0])))
    np.testing.assert_allclose(kl, [math.exp(0.5) - 1.5, 10.0, 10.0, 0.0], rtol=1e-6)
    # Just inside the value clamp: d = -9 -> e^-9 + 8 (not clamped).
    assert float(k3_kl(jnp.array(0.0), jnp.array(-9.0))) == pytest.approx(math.exp(-9) + 8, rel=1e-6)


def test_ppo_clip_hand_values():
    r = jnp.array([1.5, 0.5, 0.5, 1.5, 1.0])
    adv = jnp.array([1.0, 1.0, -1.0, -1.0, 2.0])
    loss, ratio = ppo_clip_loss(jnp.log(r), jnp.zeros(5), adv)
    np.testing.assert_allclose(np.asarray(ratio), np.asarray(r), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), [-1.2, -0.5, 0.8, 1.5, -2.0], rtol=1e-6)
    loss, _ = ppo_clip_loss(jnp.log(r), jnp.zeros(5), adv, eps_low=0.1, eps_high=0.28)
    np.testing.assert_allclose(np.asarray(loss), [-1.28, -0.5, 0.9, 1.5, -2.0], rtol=1e-6)
    loss, ratio = ppo_clip_loss(jnp.log(r), jnp.zeros(5), adv, ratio_fn=lambda x: 2.0 * x)
    np.testing.assert_allclose(np.asarray(ratio), 2 * np.asarray(r), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), [-1.2, -1.0, 1.0, 3.0, -2.4], rtol=1e-6)


def _small_batch():
    # Row 0 original (3 real tokens + 1 pad), row 1 probe (2 real + 2 pad). Pads hold garbage on purpose.
    r = np.array([[1.5, 0.5, 1.0, 123.0], [0.7, 1.1, 55.0, 1e-9]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    old = np.zeros((2, 4), np.float32)
    logp = np.log(r).astype(np.float32)
    ref = logp - np.array([[0.5, 0.0, -0.5, 40.0], [0.2, 0.1, 9.0, -3.0]], np.float32)  # ref - logp = -that
    adv = np.array([1.0, -1.0], np.float32)
    return logp, old, ref, adv, mask


def test_grpo_token_loss_hand_sum_count_and_metrics():
    logp, old, ref, adv, mask = _small_batch()
    loss_sum, count, m = grpo_token_loss(logp, old, ref, adv, mask, kl_coef=0.1, is_probe=np.array([False, True]))
    pg = [-1.2, -0.5, -1.0, 0.8, 1.1]  # row 1 has A = -1: r=0.7 -> max(0.7, 0.8)=0.8 (clipped), r=1.1 -> 1.1
    d = [-0.5, 0.0, 0.5, -0.2, -0.1]
    kl = [math.exp(x) - x - 1 for x in d]
    assert int(count) == 5
    assert float(loss_sum) == pytest.approx(sum(pg) + 0.1 * sum(kl), rel=1e-5)
    assert float(token_mean(loss_sum, count)) == pytest.approx((sum(pg) + 0.1 * sum(kl)) / 5, rel=1e-5)
    assert int(m["all/tokens"]) == 5 and int(m["original/tokens"]) == 3 and int(m["probe/tokens"]) == 2
    assert float(m["original/ratio_mean"]) == pytest.approx(1.0, rel=1e-5)
    assert float(m["original/ratio_min"]) == pytest.approx(0.5) and float(m["original/ratio_max"]) == pytest.approx(1.5)
    assert float(m["probe/ratio_mean"]) == pytest.approx(0.9, rel=1e-5)
    assert float(m["original/clip_frac_high"]) == pytest.approx(1 / 3) and float(m["original/clip_frac_low"]) == 0
    assert float(m["probe/clip_frac_low"]) == pytest.approx(0.5) and float(m["probe/clip_frac_high"]) == 0
    assert float(m["all/clip_frac"]) == pytest.approx(2 / 5)
    assert float(m["all/kl_mean"]) == pytest.approx(sum(kl) / 5, rel=1e-5)
    assert float(m["all/pg_loss_mean"]) == pytest.approx(sum(pg) / 5, rel=1e-5)


def test_padding_contributes_nothing_to_loss_or_gradient():
    logp, old, ref, adv, mask = _small_batch()

    def f(lp):
        s, c, _ = grpo_token_loss(lp, old, ref, adv, mask)
        return s / c

    g = np.asarray(jax.grad(f)(jnp.asarray(logp)))
    assert np.all(g[~mask] == 0) and np.all(g[mask] != 0)
    noisy = np.where(mask, logp, np.float32(-7.0))
    assert float(f(jnp.asarray(noisy))) == pytest.approx(float(f(jnp.asarray(logp))), rel=1e-6)


def test_empty_split_and_missing_inputs():
    logp, old, ref, adv, mask = _small_batch()
    _, _, m = grpo_token_loss(logp, old, ref, adv, mask, is_probe=np.array([False, False]))
    assert int(m["probe/tokens"]) == 0 and float(m["probe/ratio_mean"]) == 0.0
    assert float(m["probe/ratio_min"]) == np.inf and float(m["probe/ratio_max"]) == -np.inf
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_token_loss(logp, old, None, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="logits"):
        grpo_token_loss(logp, old, ref, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo_token_loss(logp, old, ref, np.zeros(3), mask)
    s, c, m = grpo_token_loss(logp, old, None, adv, mask, kl_coef=0.0)
    assert "all/kl_mean" not in m and int(c) == 5


def test_entropy_metric_and_bonus():
    logp, old, ref, adv, mask = _small_batch()
    logits = np.zeros((2, 4, 8), np.float32)
    logits[0, 0] = [5, 0, 0, 0, 0, 0, 0, 0]
    ent = np.asarray(entropy_from_logits(jnp.asarray(logits)))
    p = np.exp(logits[0, 0]) / np.exp(logits[0, 0]).sum()
    assert ent[0, 0] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-5) and ent[1, 1] == pytest.approx(math.log(8))
    s0, _, m = grpo_token_loss(logp, old, ref, adv, mask, logits=logits)
    s1, _, _ = grpo_token_loss(logp, old, ref, adv, mask, logits=logits, entropy_coef=0.01)
    assert float(m["all/entropy_mean"]) == pytest.approx(ent[mask].mean(), rel=1e-5)
    assert float(s0 - s1) == pytest.approx(0.01 * ent[mask].sum(), rel=1e-4)


def test_gradient_accumulation_is_exact_token_mean():
    rng = np.random.default_rng(1)
    n, t = 6, 7
    logp = jnp.asarray(rng.normal(-1.0, 0.3, (n, t)), jnp.float32)
    old = jnp.asarray(logp + rng.normal(0, 0.3, (n, t)), jnp.float32)
    ref = jnp.asarray(logp + rng.normal(0, 0.3, (n, t)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=n), jnp.float32)
    lengths = np.array([7, 1, 3, 6, 2, 5])  # unequal token counts per micro-batch
    mask = np.arange(t)[None, :] < lengths[:, None]
    is_probe = np.array([0, 1, 0, 0, 1, 0], bool)

    def total(lp, o, r, a, mk, pr):
        s, c, m = grpo_token_loss(lp, o, r, a, mk, is_probe=pr)
        return s, (c, m)

    def args(sl):
        return old[sl], ref[sl], adv[sl], jnp.asarray(mask[sl]), jnp.asarray(is_probe[sl])

    value_and_grad = jax.jit(jax.value_and_grad(total, has_aux=True))
    full_grad = jax.jit(jax.grad(lambda lp: total(lp, *args(slice(None)))[0] / mask.sum()))(logp)
    micro = [slice(0, 2), slice(2, 3), slice(3, 6)]
    grads, outs = np.zeros((n, t), np.float32), []
    for sl in micro:
        (s, (c, m)), g = value_and_grad(logp[sl], *args(sl))
        grads[sl] = np.asarray(g)
        outs.append((s, c, m))
    accumulated = grads / sum(int(o[1]) for o in outs)
    np.testing.assert_allclose(accumulated, np.asarray(full_grad), rtol=1e-5, atol=1e-7)

    # The merged loss and metrics equal the full-batch ones...
    s_full, c_full, m_full = grpo_token_loss(logp, old, ref, adv, mask, is_probe=is_probe)
    loss, merged = combine_micro_batches(outs)
    assert float(loss) == pytest.approx(float(s_full / c_full), rel=1e-5)
    for k, v in m_full.items():
        assert float(merged[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-7), k
    # ... while averaging per-micro-batch means would not be.
    mean_of_means = np.mean([float(o[0]) / int(o[1]) for o in outs])
    assert abs(mean_of_means - float(loss)) > 1e-3
