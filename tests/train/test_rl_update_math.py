"""The trainer's padded, jitted RL math equals the eager rexrag_jax.rl functions on the unpadded batch."""
import numpy as np
import pytest

from rexrag_jax.rl.advantages import group_advantages
from rexrag_jax.rl.behaviour import batch_alpha_err, behaviour_logprobs
from rexrag_jax.train import trainer as trainer_mod
from rexrag_jax.train.trainer import ROW_BUCKET, rl_update_math


@pytest.mark.parametrize("n, T", [(1, 12), (7, 12), (ROW_BUCKET, 12), (ROW_BUCKET + 3, 12),
                                  (2 * ROW_BUCKET + 1, 40), (3, 9)])
def test_rl_update_math_matches_unpadded(n, T):
    """Also after a larger shape ran: (3, 9) is padded in rows and tokens to a shape already compiled."""
    r = np.random.default_rng(n)
    group_ids = r.integers(100, 104, n)  # arbitrary ids; padded rows must not join these groups
    rewards = r.integers(0, 2, n).astype(np.float32) + r.normal(0, 0.1, n).astype(np.float32)
    correct = (rewards > 0.5).astype(np.float32)
    is_probe = r.random(n) < 0.4
    is_probe[0] = False
    probe_start = np.where(is_probe, r.integers(2, 6, n), 0)
    probe_len = np.where(is_probe, r.integers(1, 3, n), 0)
    loss_mask = r.random((n, T)) < 0.8
    old_logp = -r.random((n, T)).astype(np.float32) * 3
    pool_logp = np.where(is_probe[:, None], -r.random((n, T)), 0.0).astype(np.float32)

    adv, beh, alpha, err = rl_update_math(rewards, correct, group_ids, old_logp, loss_mask, is_probe,
                                          probe_start, probe_len, pool_logp)
    want_adv = np.asarray(group_advantages(rewards, group_ids))
    want_alpha, want_err = batch_alpha_err(is_probe, correct)
    want_beh = np.asarray(behaviour_logprobs(old_logp, loss_mask, is_probe, probe_start, probe_len, pool_logp,
                                             want_alpha, want_err))
    assert adv.shape == (n,) and beh.shape == (n, T)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(beh, want_beh, rtol=1e-5, atol=1e-6)
    assert alpha == pytest.approx(float(want_alpha)) and err == pytest.approx(float(want_err))
    assert alpha == pytest.approx(is_probe.mean())  # the padding did not count as rows
    if (n, T) == (3, 9):  # ran a compiled larger shape instead of compiling (16, 9)
        assert (ROW_BUCKET, 9) not in trainer_mod._RL_MATH_SHAPES


def test_without_correction_behaviour_is_old_logp():
    """The "w/o policy correction" ablation: behaviour = π_old on every loss-masked token (probes too),
    same advantages, α and err as with the correction."""
    rng = np.random.default_rng(0)
    n, t = 6, 12
    old = rng.normal(-2, 0.5, (n, t)).astype(np.float32)
    mask = rng.random((n, t)) < 0.8
    is_probe = np.array([0, 0, 0, 0, 1, 1], bool)
    args = (np.array([1, 0, 0, 1, 1, 0], np.float32), np.array([1, 0, 0, 1, 1, 0], np.float32),
            np.array([0, 0, 1, 1, 0, 1]), old, mask, is_probe, np.array([-1, -1, -1, -1, 4, 5]),
            np.array([0, 0, 0, 0, 3, 2]), np.where(mask, -1.0, 0.0).astype(np.float32))
    a1, b1, al1, e1 = rl_update_math(*args)
    a0, b0, al0, e0 = rl_update_math(*args, correction=False)
    np.testing.assert_array_equal(a0, a1)
    assert (al0, e0) == (al1, e1) == (pytest.approx(2 / 6), pytest.approx(0.5))
    np.testing.assert_array_equal(b0, np.where(mask, old, 0.0))
    assert not np.allclose(b1[mask], old[mask])  # the correction does change the behaviour


def test_group_diagnostics_hand_computed():
    from rexrag_jax.train.prepare import group_diagnostics

    # 3 questions x 2 originals, then 3 probes: q0 mixed, q1 all-fail rescued by kept probe 7,
    # q2 all-fail with a successful probe that was *not* kept (8) and a kept failed one (6)
    gid = np.array([0, 0, 1, 1, 2, 2, 2, 1, 2])
    probe = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1], bool)
    correct = np.array([1, 0, 0, 0, 0, 0, 0, 1, 1], np.float32)
    d = group_diagnostics(gid, probe, correct, kept_probes=np.array([6, 7]))
    assert d["groups/all_fail"] == pytest.approx(2 / 3)
    assert d["groups/rescued"] == pytest.approx(1 / 3)
    assert d["probes/success_created"] == pytest.approx(2 / 3)
    assert d["probes/success_kept"] == pytest.approx(1 / 2)
    none = group_diagnostics(gid[:6], probe[:6], correct[:6], kept_probes=np.array([], int))
    assert none["groups/rescued"] == 0 and np.isnan(none["probes/success_created"]) and np.isnan(none["probes/success_kept"])
