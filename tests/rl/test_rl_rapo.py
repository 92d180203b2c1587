"""RAPO formulas (SPEC §8): relative entropy-drop retrieval reward, combined advantage, ratio shaping,
inserted-token masking, per-sequence-mean aggregation."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.rl import rapo
from rexrag_jax.rl.loss import grpo_token_loss
from rexrag_jax.rl.rapo import (combined_advantages, rapo_loss_mask, rapo_token_loss, retrieval_fraction,
                                retrieval_reward, retrieval_rewards, seq_mean_weights)


def test_retrieval_reward_hand():
    # H_{t-1} = 2, H_{t+1} = 1: H_delta = 0.5, g = tanh(1), Z = 2 tanh(1)
    assert float(rapo.retrieval_reward(2.0, 1.0)) == pytest.approx(2 * math.tanh(1.0), rel=1e-12)
    # H_{t-1} = 1, H_{t+1} = 0.5: H_delta = 0.5, Z = tanh(1)
    assert float(retrieval_reward(1.0, 0.5)) == pytest.approx(math.tanh(1.0), rel=1e-12)
    # entropy rose: H_delta = (0.2 - 0.7) / 0.2 = -2.5, Z = 0.2 tanh(-5)
    assert float(retrieval_reward(0.2, 0.7)) == pytest.approx(0.2 * math.tanh(-5.0), rel=1e-12)
    # fully certain after: H_delta = 1, Z = 0.4 tanh(2) (the largest Z for a given H_{t-1})
    assert float(retrieval_reward(0.4, 0.0)) == pytest.approx(0.4 * math.tanh(2.0), rel=1e-12)
    # H_{t-1} = 0 (0/0): Z = 0 by the documented choice, not NaN
    assert float(retrieval_reward(0.0, 0.3)) == 0.0 and float(retrieval_reward(0.0, 0.0)) == 0.0
    # the old un-normalised form tanh(2 (H_b - H_a)) H_b differs on the hand case
    assert float(retrieval_reward(2.0, 1.0)) != pytest.approx(math.tanh(2.0) * 2.0)


def test_retrieval_reward_arrays_and_jax():
    hb = np.array([2.0, 1.0, 0.0, 0.5])
    ha = np.array([1.0, 1.0, 0.7, 1.5])
    want = [2 * math.tanh(1.0), 0.0, 0.0, 0.5 * math.tanh(2 * (0.5 - 1.5) / 0.5)]
    out = retrieval_reward(hb, ha)
    assert isinstance(out, np.ndarray) and out.shape == (4,)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=0)
    j = jax.jit(retrieval_reward)(jnp.asarray(hb, jnp.float32), jnp.asarray(ha, jnp.float32))
    assert isinstance(j, jax.Array)
    np.testing.assert_allclose(np.asarray(j), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(retrieval_reward(jnp.float32(2.0), 1.0)), 2 * math.tanh(1.0), rtol=1e-6)
    # broadcasting, and a finite gradient at H_{t-1} = 0 (guarded division)
    np.testing.assert_allclose(retrieval_reward(np.array([[2.0], [1.0]]), np.array([1.0, 0.5])),
                               [[2 * math.tanh(1.0), 2 * math.tanh(1.5)], [math.tanh(0.0), math.tanh(1.0)]])
    g = jax.grad(lambda x: jnp.sum(retrieval_reward(x, jnp.array([0.7, 1.0]))))(jnp.array([0.0, 2.0]))
    assert np.all(np.isfinite(np.asarray(g)))


# kinds per token: p = policy, i = inserted, . = other (prompt / info / pad)
def _masks(rows):
    policy = np.array([[c == "p" for c in r] for r in rows])
    inserted = np.array([[c == "i" for c in r] for r in rows])
    return policy, inserted


def test_retrieval_rewards_hand():
    rows = ["pppii.pp..",   # one insertion between policy steps
            "pppppppp..",   # no insertion -> 0
            "..ii.ppp..",   # insertion with no policy step before -> 0
            "pp.ii.pp.i",   # two insertions; the last has no policy step after -> only the first counts
            "pp.ii.ii.p"]   # nearest policy runs on each side of each insertion
    policy, inserted = _masks(rows)
    ent = np.zeros((5, 10))
    ent[0, 0:3], ent[0, 6:8] = 1.0, [0.4, 0.6]
    ent[3, 0:2], ent[3, 6:8] = [0.3, 0.5], 0.9
    ent[4, 0:2], ent[4, 9] = 0.8, 0.1
    ent[~policy] = 55.0  # entropy at non-policy tokens must not matter
    z = retrieval_rewards(ent, policy, inserted)
    # row 0: H_b = 1.0, H_a = 0.5 -> tanh(2 * 0.5) * 1.0; row 3: H_b = 0.4, H_a = 0.9;
    # row 4: (H_b = 0.8, H_a = 0.1) and (0.8, 0.1) again -> mean of two equal Z
    z3 = math.tanh(2 * (0.4 - 0.9) / 0.4) * 0.4
    z4 = math.tanh(2 * 0.7 / 0.8) * 0.8
    np.testing.assert_allclose(z, [math.tanh(1.0), 0, 0, z3, z4], rtol=1e-6)
    assert z.dtype == np.float32
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        retrieval_rewards(ent[:1], policy[:1], policy[:1])


def test_combined_advantages_hand():
    a = np.asarray(combined_advantages(np.array([1.0, 0.0, 1.0]), np.array([0.5, 0.0, 0.3]), np.array([0, 0, 1])))
    s = 1 / math.sqrt(2)  # two-member group: normalised values are +-1/sqrt(2)
    np.testing.assert_allclose(a, [(1 + 0.2 * s) * s, (1 - 0.2 * s) * -s, 0.0], rtol=1e-5)


def test_fraction_mask_and_loss():
    policy, inserted = _masks(["ppii", "pppp", "...."])
    np.testing.assert_allclose(np.asarray(retrieval_fraction(policy, inserted)), [0.5, 0.0, 0.0])
    loss_mask = policy | inserted
    np.testing.assert_array_equal(np.asarray(rapo_loss_mask(loss_mask, inserted)), policy)

    # Row 0: F = 0.5 -> r_hat = 1.025 r; r = 1.25 -> 1.28125 > 1 + 0.28, clipped to 1.28 with A > 0.
    r = np.array([[1.25, 1.1, 9.0, 9.0], [0.5, 1.0, 1.0, 1.0], [1, 1, 1, 1]], np.float32)
    adv = np.array([1.0, -1.0, 3.0], np.float32)

    def f(lp):
        return rapo_token_loss(lp, jnp.zeros((3, 4)), adv, loss_mask, policy, inserted)

    s, c, m = f(jnp.log(r))
    expected = [-1.28, -1.025 * 1.1, 0.72, 1.0, 1.0, 1.0]  # row 1: F = 0, A < 0, r = 0.5 clipped up to 0.72
    assert int(c) == 6 and float(s) == pytest.approx(sum(expected), rel=1e-5)
    assert "all/kl_mean" not in m  # beta = 0 by default
    g = np.asarray(jax.grad(lambda lp: f(lp)[0])(jnp.log(r)))
    assert np.all(g[inserted] == 0) and g[0, 1] == pytest.approx(-1.025 * 1.1, rel=1e-5)
    assert g[0, 0] == 0.0  # clipped branch


def test_rapo_loss_jits():
    policy, inserted = _masks(["ppii", "pppp"])
    lp = jnp.log(jnp.array([[1.25, 1.1, 2.0, 2.0], [0.5, 1.0, 1.3, 1.0]]))
    args = (jnp.zeros((2, 4)), jnp.array([1.0, -1.0]), policy | inserted, policy, inserted)
    eager = rapo_token_loss(lp, *args)[0]
    jitted = jax.jit(lambda x: rapo_token_loss(x, *args)[0])(lp)
    assert float(jitted) == pytest.approx(float(eager), rel=1e-6)
    # A < 0: r = 1.3 is above 1 + eps, and max(1.3, 1.28) keeps the unclipped (pessimistic) term.
    assert float(eager) == pytest.approx(-1.28 - 1.025 * 1.1 + 0.72 + 1.0 + 1.3 + 1.0, rel=1e-5)


def test_seq_mean_aggregation_hand():
    """Per-sequence token mean, then mean over sequences, vs GRPO's token mean, by hand.

    r = 1 everywhere (logp = old = 0), so loss_t = -A (clip inactive). Row 0: 1 token, A = 1 -> -1.
    Row 1: 3 tokens, A = -2 -> 2 each. Row 2: no loss token (padding row: not a sequence).
    token mean = (-1 + 6) / 4 = 1.25;  seq mean = (-1 + (2 + 2 + 2) / 3) / 2 = 0.5.
    """
    policy = np.array([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
    inserted = np.array([[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]], bool)
    zeros = jnp.zeros((3, 4))
    adv = jnp.array([1.0, -2.0, 5.0])
    # ratio shaping off for the arithmetic (row 0 has F_ret = 2/3)
    s, c, _ = rapo_token_loss(zeros, zeros, adv, policy | inserted, policy, inserted, ratio_coef=0.0)
    assert int(c) == 4 and float(s) / int(c) == pytest.approx(1.25)
    s, c, m = rapo_token_loss(zeros, zeros, adv, policy | inserted, policy, inserted, ratio_coef=0.0,
                              aggregation="seq_mean")
    assert int(c) == 2 and float(s) / int(c) == pytest.approx(0.5)
    assert int(m["all/tokens"]) == 4  # metrics stay per loss token
    w, cm = seq_mean_weights(policy)
    np.testing.assert_allclose(np.asarray(w), [1.0, 1 / 3, 0.0])
    np.testing.assert_array_equal(np.asarray(cm), [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # |s_i| counting inserted tokens too (the seq_len_counts_inserted knob): row 0 has 3 response tokens
    w2, _ = seq_mean_weights(policy, policy | inserted)
    np.testing.assert_allclose(np.asarray(w2), [1 / 3, 1 / 3, 0.0])
    with pytest.raises(ValueError, match="aggregation='bogus'"):
        rapo_token_loss(zeros, zeros, adv, policy, policy, inserted, aggregation="bogus")


def test_seq_mean_exact_under_micro_batches():
    """Σ loss_sum / Σ count over micro-batches = the full batch's seq mean (not a mean of means)."""
    rng = np.random.default_rng(0)
    mask = np.zeros((5, 7), bool)
    for n, k in enumerate([1, 7, 3, 2, 5]):
        mask[n, :k] = True
    logp, old = rng.normal(size=(2, 5, 7)).astype(np.float32) * 0.1
    adv = rng.normal(size=5).astype(np.float32)
    w, cm = seq_mean_weights(mask)
    full_s, full_c, _ = grpo_token_loss(logp, old, None, adv, mask, kl_coef=0.0, token_weight=w, count_mask=cm)
    per_seq = [float(np.mean(np.asarray(grpo_token_loss(logp[n:n + 1], old[n:n + 1], None, adv[n:n + 1],
                                                        mask[n:n + 1], kl_coef=0.0)[0]) / mask[n].sum()))
               for n in range(5)]
    assert float(full_s) / int(full_c) == pytest.approx(np.mean(per_seq), rel=1e-5)
    parts = [(0, 2), (2, 5)]  # micro-batches of 2 and 3 sequences, very different token counts
    outs = [grpo_token_loss(logp[a:b], old[a:b], None, adv[a:b], mask[a:b], kl_coef=0.0, token_weight=w[a:b],
                            count_mask=cm[a:b]) for a, b in parts]
    acc = sum(float(o[0]) for o in outs) / sum(int(o[1]) for o in outs)
    assert acc == pytest.approx(np.mean(per_seq), rel=1e-5)
    mean_of_means = np.mean([float(o[0]) / int(o[1]) for o in outs])
    assert abs(mean_of_means - np.mean(per_seq)) > 1e-3  # the wrong way differs here
