"""Probe filtering (SPEC §4): keep-ratio EWMA and ranked selection, by hand."""
import gin
import numpy as np
import pytest

from rexrag_jax.rl.filtering import (INITIAL_KEEP_RATIO, inserted_mean_logp, num_probes_to_keep, select_probes,
                                     update_keep_ratio)


def test_keep_ratio_ewma_by_hand():
    assert INITIAL_KEEP_RATIO == 0.08
    rho = update_keep_ratio(0.08, [1.0, 0.0, 1.5, 0.9])  # 2 of 4 reach reward >= 1
    assert rho == pytest.approx(0.9 * 0.08 + 0.1 * 0.5)
    rho2 = update_keep_ratio(rho, [0.0, 0.0, 0.0])
    assert rho2 == pytest.approx(0.9 * 0.122)
    assert update_keep_ratio(rho2, []) == rho2  # no kept probes: unchanged
    assert update_keep_ratio(0.5, [1.0], decay=0.5) == pytest.approx(0.75)


def test_num_to_keep_rounding():
    assert num_probes_to_keep(512, 5, 0.08, 10_000) == 204  # floor(204.8)
    assert num_probes_to_keep(512, 5, 0.08, 10_000, dp_size=8) == 200
    assert num_probes_to_keep(20, 5, 0.29, 10_000) == 29  # 100 * 0.29 is 28.999999999999996 in floating point
    assert num_probes_to_keep(512, 5, 0.08, 150, dp_size=8) == 144  # capped at what is available
    assert num_probes_to_keep(4, 5, 0.08, 10) == 1
    assert num_probes_to_keep(4, 5, 0.04, 10) == 0
    with pytest.raises(ValueError, match="dp_size"):
        num_probes_to_keep(4, 5, 0.1, 10, dp_size=0)
    with pytest.raises(ValueError, match="rho"):
        num_probes_to_keep(4, 5, 1.5, 10)


def test_select_probes_ranking():
    scores = [-1.0, -0.5, float("nan"), -0.5, -2.0, -0.1]
    kept = select_probes(scores, num_questions=2, group_size=5, rho=0.4)  # K = 4
    assert kept.tolist() == [5, 1, 3, 0]  # highest first, tie -> lower index first
    assert select_probes(scores, 2, 5, 0.4, dp_size=3).tolist() == [5, 1, 3]
    assert select_probes(scores, 2, 5, 1.0).tolist() == [5, 1, 3, 0, 4, 2]  # NaN ranks last
    assert select_probes([], 2, 5, 0.5).tolist() == []
    assert kept.dtype == np.int64


def test_inserted_mean_logp():
    logp = np.array([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.5, -1.5, -9.0], [0, 0, 0, 0]])
    out = inserted_mean_logp(logp, probe_start=[1, 0, 2], probe_len=[2, 3, 0])
    assert out[0] == pytest.approx(-2.5) and out[1] == pytest.approx(-2.5 / 3) and out[2] == -np.inf
    # Truncated at T: only the tokens that exist count.
    assert inserted_mean_logp(logp[:1], [3], [5])[0] == pytest.approx(-4.0)


def test_keep_ratio_gin_binding():
    gin.clear_config()
    try:
        gin.parse_config("update_keep_ratio.decay = 0.5")
        assert update_keep_ratio(0.2, [1.0, 0.0]) == pytest.approx(0.5 * 0.2 + 0.5 * 0.5)
    finally:
        gin.clear_config()
    assert update_keep_ratio(0.2, [1.0, 0.0]) == pytest.approx(0.9 * 0.2 + 0.1 * 0.5)
