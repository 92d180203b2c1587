"""RAPO formulas (SPEC §8): entropy-drop reward, combined advantage, ratio shaping, inserted-token masking."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.rl.rapo import (combined_advantages, entropy_drop_reward, rapo_loss_mask, rapo_token_loss,
                                retrieval_fraction, retrieval_rewards)


def test_entropy_drop_reward_hand():
    assert entropy_drop_reward(1.0, 0.5) == pytest.approx(math.tanh(1.0))
    assert entropy_drop_reward(0.2, 0.7) == pytest.approx(math.tanh(-1.0) * 0.2)
    out = entropy_drop_reward(jnp.array([2.0]), jnp.array([2.0]))
    assert isinstance(out, jax.Array) and float(out[0]) == 0.0


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
    z4 = math.tanh(2 * 0.7) * 0.8
    np.testing.assert_allclose(z, [math.tanh(1.0), 0, 0, math.tanh(2 * (0.4 - 0.9)) * 0.4, z4], rtol=1e-6)
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
