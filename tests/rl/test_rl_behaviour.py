"""Behaviour density μ (SPEC §5): hand-computed tokens, the prefix-product identity, edge cases, jit."""
import math

import jax
import numpy as np
import pytest

from rexrag_jax.rl.behaviour import batch_alpha_err, behaviour_logprobs, probe_token_masks

# Row 0: original; prompt 0-1, response 2-5, padding 6-7.
# Row 1: probe; prompt 0, response 1-2, info 3, response 4, inserted prompt 5-6, continuation 7.
LOSS_MASK = np.array([[0, 0, 1, 1, 1, 1, 0, 0],
                      [0, 1, 1, 0, 1, 1, 1, 1]], bool)
IS_PROBE = np.array([False, True])
PROBE_START = np.array([-1, 5])
PROBE_LEN = np.array([0, 2])
OLD_P = np.array([[0.9, 0.9, 0.5, 0.25, 0.8, 0.1, 0.3, 0.3],
                  [0.9, 0.4, 0.6, 0.9, 0.7, 0.05, 0.02, 0.5]])
POOL_P = np.array([0.25, 0.5])  # pool probability of the two inserted tokens


def _pool_logp():
    pool = np.zeros((2, 8), np.float32)
    pool[1, 5:7] = np.log(POOL_P)
    return pool


def _call(alpha, err, old_p=OLD_P, **kw):
    return np.asarray(behaviour_logprobs(np.log(old_p).astype(np.float32), LOSS_MASK, IS_PROBE, PROBE_START,
                                         PROBE_LEN, _pool_logp(), alpha, err, **kw), np.float64)


def test_hand_computed_tokens():
    alpha, err = 1 / 3, 0.5
    out = _call(alpha, err)
    # Original: (1 - α) π_old on loss-masked tokens, 0 elsewhere.
    np.testing.assert_allclose(out[0, 2:6], np.log(2 / 3 * OLD_P[0, 2:6]), rtol=1e-5)
    assert np.all(out[0, [0, 1, 6, 7]] == 0)
    # Probe prefix: j = 3 loss-masked tokens before index 5 (info token 3 does not count).
    for t in (1, 2, 4):
        p = OLD_P[1, t]
        assert out[1, t] == pytest.approx(math.log(2 / 3 * p + 1 / 3 * p / err ** (1 / 3)), rel=1e-5)
    # Inserted tokens: μ = pool probability.
    assert out[1, 5] == pytest.approx(math.log(2 / 3 * 0.05 + 1 / 3 * 0.25), rel=1e-5)
    assert out[1, 6] == pytest.approx(math.log(2 / 3 * 0.02 + 1 / 3 * 0.5), rel=1e-5)
    # Continuation: (1 - α) π + α π = π.
    assert out[1, 7] == pytest.approx(math.log(0.5), rel=1e-5)
    assert out[1, 0] == 0 and out[1, 3] == 0


def test_prefix_product_is_pi_old_over_err():
    # With α -> 1 the behaviour is μ itself: Π_prefix μ = π_old(prefix) / err.
    err = 0.3
    out = np.asarray(behaviour_logprobs(np.log(OLD_P).astype(np.float32), LOSS_MASK, IS_PROBE, PROBE_START,
                                        PROBE_LEN, _pool_logp(), 1.0, err), np.float64)
    prefix_sum = out[1, [1, 2, 4]].sum()
    assert prefix_sum == pytest.approx(np.log(OLD_P[1, [1, 2, 4]]).sum() - math.log(err), rel=1e-5)


def test_alpha_zero_is_plain_old_logp():
    out = _call(0.0, 0.5)
    np.testing.assert_allclose(out[LOSS_MASK], np.log(OLD_P)[LOSS_MASK], rtol=1e-6)


def test_err_zero_is_clamped_and_finite():
    out = _call(0.5, 0.0)
    assert np.all(np.isfinite(out))
    p = OLD_P[1, 1]
    assert out[1, 1] == pytest.approx(math.log(0.5 * p + 0.5 * p / 1e-6 ** (1 / 3)), rel=1e-5)
    out = _call(0.5, 0.0, err_floor=0.1)
    assert out[1, 1] == pytest.approx(math.log(0.5 * p + 0.5 * p / 0.1 ** (1 / 3)), rel=1e-5)


def test_j_zero_no_prefix():
    mask = np.array([[0, 0, 1, 1, 1, 0]], bool)  # probe inserted right after the prompt
    old = np.log(np.array([[0.5, 0.5, 0.2, 0.4, 0.6, 0.5]], np.float32))
    pool = np.zeros((1, 6), np.float32)
    pool[0, 2:4] = np.log([0.5, 1.0])
    out = np.asarray(behaviour_logprobs(old, mask, np.array([True]), np.array([2]), np.array([2]), pool, 0.25, 0.4))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(np.exp(out[0, 2:5]), [0.75 * 0.2 + 0.25 * 0.5, 0.75 * 0.4 + 0.25, 0.6], rtol=1e-5)


def test_masks_and_jit():
    prefix, inserted, cont = (np.asarray(m) for m in probe_token_masks(LOSS_MASK, IS_PROBE, PROBE_START, PROBE_LEN))
    assert prefix[1].nonzero()[0].tolist() == [1, 2, 4] and inserted[1].nonzero()[0].tolist() == [5, 6]
    assert cont[1].nonzero()[0].tolist() == [7] and not prefix[0].any() and not inserted[0].any()
    jitted = jax.jit(behaviour_logprobs)(np.log(OLD_P).astype(np.float32), LOSS_MASK, IS_PROBE, PROBE_START,
                                          PROBE_LEN, _pool_logp(), 0.2, 0.6)
    np.testing.assert_allclose(np.asarray(jitted), _call(0.2, 0.6), rtol=1e-6)
    assert jitted.dtype == np.float32


def test_bad_shapes_named():
    with pytest.raises(ValueError, match="probe_len"):
        behaviour_logprobs(np.zeros((2, 8)), LOSS_MASK, IS_PROBE, PROBE_START, np.zeros(3), _pool_logp(), 0.1, 0.5)
    with pytest.raises(ValueError, match="pool_logp"):
        behaviour_logprobs(np.zeros((2, 8)), LOSS_MASK, IS_PROBE, PROBE_START, PROBE_LEN, np.zeros((2, 7)), 0.1, 0.5)


def test_batch_alpha_err():
    alpha, err = batch_alpha_err(np.array([0, 0, 0, 0, 1, 1], bool), np.array([1, 0, 0, 0, 0, 1]))
    assert float(alpha) == pytest.approx(2 / 6) and float(err) == pytest.approx(0.75)  # probes' EM ignored
    alpha, err = batch_alpha_err(np.array([True]), np.array([1.0]))
    assert float(alpha) == 1.0 and float(err) == 1.0


def test_behaviour_for_batch_wires_pool_and_alpha_err():
    import types
    from rexrag_jax.rl.behaviour import behaviour_for_batch
    from rexrag_jax.rl.prompt_pool import PromptPoolDistribution
    tokens = np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 1, 3, 4, 5]])
    batch = types.SimpleNamespace(tokens=tokens, loss_mask=LOSS_MASK, is_probe=IS_PROBE, probe_start=PROBE_START,
                                  probe_len=PROBE_LEN)
    pool = PromptPoolDistribution([[3, 4], [3, 9], [5], [6], [7], [8], [9], [10]])  # P(3) = 1/4, P(4 | 3) = 1/2
    log_b, alpha, err = behaviour_for_batch(batch, np.log(OLD_P).astype(np.float32), pool, np.array([0.0, 1.0]))
    assert float(alpha) == 0.5 and float(err) == 1.0
    expected = np.asarray(behaviour_logprobs(np.log(OLD_P).astype(np.float32), LOSS_MASK, IS_PROBE, PROBE_START,
                                             PROBE_LEN, _pool_logp(), 0.5, 1.0))
    np.testing.assert_allclose(np.asarray(log_b), expected, rtol=1e-6)
