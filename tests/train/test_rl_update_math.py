"""The trainer's padded, jitted RL math equals the eager rexrag_jax.rl functions on the unpadded batch."""
import numpy as np
import pytest

from rexrag_jax.rl.advantages import group_advantages
from rexrag_jax.rl.behaviour import batch_alpha_err, behaviour_logprobs
from rexrag_jax.train.trainer import ROW_BUCKET, rl_update_math


@pytest.mark.parametrize("n", [1, 7, ROW_BUCKET, ROW_BUCKET + 3])
def test_rl_update_math_matches_unpadded(n):
    r = np.random.default_rng(n)
    T = 12
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
