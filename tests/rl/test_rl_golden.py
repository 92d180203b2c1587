"""Golden test: the whole REX-RAG loss pipeline (advantages -> pool -> behaviour -> PPO/KL token mean) and its
gradient through a tiny linear policy, against an independent float64 NumPy implementation written with loops."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.rl import (PromptPoolDistribution, batch_alpha_err, behaviour_logprobs, grpo_token_loss,
                           group_advantages, token_mean)

P, R, I, PR, PAD = 0, 1, 3, 4, 5  # segment codes (DESIGN.md "Trajectories")
LAYOUT = [  # 8 trajectories x 10 tokens; rows 6 and 7 are probes
    [P, P, R, R, R, I, R, R, PAD, PAD],
    [P, P, R, R, R, R, R, R, R, R],
    [P, R, R, I, I, R, PAD, PAD, PAD, PAD],
    [P, P, R, R, PAD, PAD, PAD, PAD, PAD, PAD],
    [P, R, R, R, R, R, R, PAD, PAD, PAD],
    [P, P, R, R, R, R, PAD, PAD, PAD, PAD],
    [P, P, R, R, I, R, PR, PR, PR, R],
    [P, R, R, R, PR, PR, R, R, R, PAD],
]
GROUPS = np.array([10, 10, 10, 11, 11, 12, 10, 11])
IS_PROBE = np.array([0, 0, 0, 0, 0, 0, 1, 1], bool)
PROBE_START = np.array([-1, -1, -1, -1, -1, -1, 6, 4])
PROBE_LEN = np.array([0, 0, 0, 0, 0, 0, 3, 2])
REWARDS = np.array([1, 0, 1, 0, 1, 1, 1, 0], np.float32)
POOL = [[3, 4, 5], [3, 4, 6], [7, 8], [3, 4, 5]]
V, D = 11, 4
EPS_LOW, EPS_HIGH, KL_COEF = 0.2, 0.28, 0.05


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(42)
    seg = np.array(LAYOUT)
    tokens = rng.integers(0, V, seg.shape)
    tokens[6, 6:9] = [3, 4, 6]   # inserted prompt, in the pool
    tokens[7, 4:6] = [3, 9]      # inserted prompt truncated/merged: 9 unseen after [3] -> floor
    x = rng.normal(size=seg.shape + (D,))
    w = rng.normal(scale=0.5, size=(D, V))
    w_old = w + rng.normal(scale=0.15, size=(D, V))
    w_ref = w + rng.normal(scale=0.15, size=(D, V))
    return dict(seg=seg, tokens=tokens, mask=(seg == R) | (seg == PR), x=x, w=w, w_old=w_old, w_ref=w_ref)


# ---------------------------- independent float64 reference (plain loops) ----------------------------
def np_logp(x, w, tokens):
    n_rows, t_len = tokens.shape
    out = np.zeros((n_rows, t_len))
    for n in range(n_rows):
        for t in range(t_len):
            logits = x[n, t] @ w
            lse = math.log(sum(math.exp(v) for v in logits))
            out[n, t] = logits[tokens[n, t]] - lse
    return out


def np_advantages():
    adv = np.zeros(len(REWARDS))
    for i in range(len(REWARDS)):
        members = [float(REWARDS[k]) for k in range(len(REWARDS)) if GROUPS[k] == GROUPS[i]]
        if len(members) < 2:
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        adv[i] = (REWARDS[i] - mean) / (std + 1e-6)
    return adv


def np_pool_prob(inserted_prefix, token):
    """Next-token frequency of `token` after `inserted_prefix` in the pool; 1/V once nothing matches."""
    def n_with(prefix):
        return sum(1 for s in POOL if s[:len(prefix)] == prefix)
    if n_with(list(inserted_prefix) + [token]) == 0:  # no pool entry continues this way
        return 1.0 / V
    return n_with(list(inserted_prefix) + [token]) / n_with(list(inserted_prefix))


def np_behaviour(old, tokens, mask):
    n_probe = int(IS_PROBE.sum())
    alpha = n_probe / len(IS_PROBE)
    originals = [n for n in range(len(IS_PROBE)) if not IS_PROBE[n]]
    err = 1.0 - sum(REWARDS[n] for n in originals) / len(originals)
    b = np.zeros(old.shape)
    for n in range(old.shape[0]):
        j = sum(1 for t in range(old.shape[1]) if mask[n, t] and t < PROBE_START[n])
        for t in range(old.shape[1]):
            if not mask[n, t]:
                continue
            p_old = math.exp(old[n, t])
            if not IS_PROBE[n]:
                b[n, t] = math.log((1 - alpha) * p_old)
                continue
            s, ln = PROBE_START[n], PROBE_LEN[n]
            if t < s:
                mu = p_old / err ** (1.0 / j)
            elif t < s + ln:
                mu = np_pool_prob(list(tokens[n, s:t]), tokens[n, t])
            else:
                mu = p_old
            b[n, t] = math.log((1 - alpha) * p_old + alpha * mu)
    return b


def np_loss_and_dlogp(logp, b, ref, adv, mask):
    total, count = 0.0, 0
    dl = np.zeros(logp.shape)
    for n in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[n, t]:
                continue
            a = adv[n]
            r = math.exp(logp[n, t] - b[n, t])
            rc = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            pg = max(-a * r, -a * rc)
            d = ref[n, t] - logp[n, t]
            kl = math.exp(d) - d - 1
            total += pg + KL_COEF * kl
            count += 1
            clipped_active = (a > 0 and r > 1 + EPS_HIGH) or (a < 0 and r < 1 - EPS_LOW)
            dl[n, t] = (0.0 if clipped_active else -a * r) + KL_COEF * (1 - math.exp(d))
    return total / count, dl / count


def np_loss_and_grad_w(w, batch):
    x, tokens, mask = batch["x"], batch["tokens"], batch["mask"]
    logp = np_logp(x, w, tokens)
    old = np_logp(x, batch["w_old"], tokens)
    ref = np_logp(x, batch["w_ref"], tokens)
    b = np_behaviour(old, tokens, mask)
    loss, dl = np_loss_and_dlogp(logp, b, ref, np_advantages(), mask)
    grad = np.zeros_like(w)
    for n in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            if dl[n, t] == 0.0:
                continue
            logits = x[n, t] @ w
            p = np.exp(logits - logits.max())
            p /= p.sum()
            onehot = np.zeros(V)
            onehot[tokens[n, t]] = 1.0
            grad += dl[n, t] * np.outer(x[n, t], onehot - p)  # d logp / d W = x (onehot - softmax)^T
    return loss, grad, b, logp


# ---------------------------------------------- the JAX path ----------------------------------------------
def jax_logp(w, x, tokens):
    logits = jnp.einsum("ntd,dv->ntv", x, w)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]


def jax_pipeline(batch):
    x = jnp.asarray(batch["x"], jnp.float32)
    tokens = jnp.asarray(batch["tokens"])
    mask = batch["mask"]
    old = jax_logp(jnp.asarray(batch["w_old"], jnp.float32), x, tokens)
    ref = jax_logp(jnp.asarray(batch["w_ref"], jnp.float32), x, tokens)
    pool = PromptPoolDistribution(POOL, vocab_size=V)
    pool_logp = pool.logprob_matrix(batch["tokens"], IS_PROBE, PROBE_START, PROBE_LEN)
    alpha, err = batch_alpha_err(IS_PROBE, REWARDS)
    b = behaviour_logprobs(old, mask, IS_PROBE, PROBE_START, PROBE_LEN, pool_logp, alpha, err)
    adv = group_advantages(REWARDS, GROUPS)

    @jax.jit
    def loss_fn(w):
        s, c, m = grpo_token_loss(jax_logp(w, x, tokens), b, ref, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                  kl_coef=KL_COEF, is_probe=IS_PROBE)
        return token_mean(s, c), m

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(batch["w"], jnp.float32))
    return loss, grad, metrics, b, adv


def test_golden_loss_gradient_and_behaviour(batch):
    ref_loss, ref_grad, ref_b, ref_logp = np_loss_and_grad_w(batch["w"], batch)
    loss, grad, metrics, b, adv = jax_pipeline(batch)
    mask = batch["mask"]
    np.testing.assert_allclose(np.asarray(adv), np_advantages(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(b)[mask], ref_b[mask], rtol=1e-5, atol=1e-5)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)
    # The batch exercises every branch: both clip sides, the floor, prefix/inserted/continuation tokens.
    ratio = np.exp(ref_logp - ref_b)
    adv_t = np_advantages()[:, None] * np.ones_like(ratio)
    assert np.any(mask & (adv_t > 0) & (ratio > 1 + EPS_HIGH)) and np.any(mask & (adv_t < 0) & (ratio < 1 - EPS_LOW))
    assert np.any(mask & (np.abs(ratio - 1) < 0.2))
    # Ratio metrics split by original / probe.
    for split, rows in (("original", ~IS_PROBE), ("probe", IS_PROBE)):
        m = mask & rows[:, None]
        assert float(metrics[f"{split}/ratio_mean"]) == pytest.approx(ratio[m].mean(), rel=1e-4)
        assert float(metrics[f"{split}/ratio_max"]) == pytest.approx(ratio[m].max(), rel=1e-4)
        assert float(metrics[f"{split}/ratio_min"]) == pytest.approx(ratio[m].min(), rel=1e-4)


def test_numpy_reference_gradient_matches_finite_differences(batch):
    """Checks the reference's own analytic gradient, so the golden comparison can't share a derivation bug."""
    w = batch["w"]
    _, grad, _, _ = np_loss_and_grad_w(w, batch)
    h = 1e-6
    for idx in [(0, 0), (1, 3), (2, 7), (3, 10), (0, 4)]:
        wp, wm = w.copy(), w.copy()
        wp[idx] += h
        wm[idx] -= h
        fd = (np_loss_and_grad_w(wp, batch)[0] - np_loss_and_grad_w(wm, batch)[0]) / (2 * h)
        assert grad[idx] == pytest.approx(fd, rel=1e-4, abs=1e-8)
