"""GRPO group advantages: hand values, singleton/constant groups, jit, brute force on random groups."""
import math

import jax
import numpy as np
import pytest

from rexrag_jax.rl.advantages import broadcast_to_tokens, group_advantages


def test_hand_computed_groups():
    rewards = np.array([1, 0, 1, 0, 0, 1, 1, 0], np.float32)
    groups = np.array([5, 5, 5, 9, 9, 42, 7, 7])
    adv = np.asarray(group_advantages(rewards, groups))
    s = math.sqrt(1 / 3)  # group 5: mean 2/3, unbiased var ((1/3)^2*2 + (2/3)^2) / 2 = 1/3
    np.testing.assert_allclose(adv[:3], [(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s], rtol=1e-5)
    assert adv[3] == 0 and adv[4] == 0  # constant group: 0 / (0 + eps)
    assert adv[5] == 0  # singleton group
    np.testing.assert_allclose(adv[6:], [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], rtol=1e-5)
    assert adv.dtype == np.float32


def test_eps_enters_denominator():
    adv = np.asarray(group_advantages(np.array([1.0, 0.0]), np.array([0, 0]), eps=1.0))
    np.testing.assert_allclose(adv, [0.5 / (math.sqrt(0.5) + 1), -0.5 / (math.sqrt(0.5) + 1)], rtol=1e-6)


def test_matches_loop_reference_under_jit():
    rng = np.random.default_rng(0)
    groups = rng.choice([3, 1000, 17, -4, 8], size=23)
    rewards = rng.normal(size=23).astype(np.float32)
    adv = np.asarray(jax.jit(group_advantages)(rewards, groups))
    for i in range(23):
        members = rewards[groups == groups[i]].astype(np.float64)
        exp = 0.0 if len(members) == 1 else (rewards[i] - members.mean()) / (members.std(ddof=1) + 1e-6)
        assert adv[i] == pytest.approx(exp, rel=1e-4, abs=1e-5)


def test_bad_shapes_and_empty():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(np.zeros(3), np.zeros(4, np.int32))
    assert group_advantages(np.zeros(0), np.zeros(0, np.int32)).shape == (0,)


def test_broadcast_only_on_loss_masked_tokens():
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 0]], bool)
    out = np.asarray(broadcast_to_tokens(np.array([2.0, -1.0]), mask))
    np.testing.assert_array_equal(out, [[0, 2, 2, 0], [-1, 0, 0, 0]])
    with pytest.raises(ValueError, match="loss_mask"):
        broadcast_to_tokens(np.zeros(3), mask)
