"""Probe filtering (SPEC §4), host-side numpy.

Keep ratio (EWMA over training steps):
    ρ_0 = 0.08,   ρ_t = 0.9 · ρ_{t-1} + 0.1 · (fraction of kept probes with reward >= 1).
If no probe was kept in a step there is no success fraction to average in, so ρ is left unchanged
(treating "no probes" as fraction 0 would decay ρ towards 0 and then never keep a probe again).

Selection: keep
    K = floor(num_questions · group_size · ρ), capped at the number of probes available, then rounded
        down to a multiple of the data-parallel size (so originals + kept probes still shard evenly),
probes ranked by the mean old-policy log-prob of their inserted prompt tokens, highest first (ties:
lower index first; probes with no inserted tokens score -inf and rank last).
"""
from __future__ import annotations

import math

import gin
import numpy as np

INITIAL_KEEP_RATIO = 0.08


@gin.configurable(denylist=["rho_prev", "kept_probe_rewards"])
def update_keep_ratio(rho_prev: float, kept_probe_rewards, decay: float = 0.9,
                      success_threshold: float = 1.0) -> float:
    """ρ_t = decay · ρ_{t-1} + (1 - decay) · mean(kept_probe_rewards >= success_threshold); unchanged if empty.

    gin: `update_keep_ratio.decay`, `update_keep_ratio.success_threshold`.
    """
    rewards = np.asarray(kept_probe_rewards, dtype=np.float64).reshape(-1)
    if rewards.size == 0:
        return float(rho_prev)
    frac = float(np.mean(rewards >= success_threshold))
    return float(decay * rho_prev + (1.0 - decay) * frac)


def num_probes_to_keep(num_questions: int, group_size: int, rho: float, num_available: int,
                       dp_size: int = 1) -> int:
    """K = floor(num_questions · group_size · ρ) capped at num_available, rounded down to a multiple of dp_size."""
    if dp_size < 1:
        raise ValueError(f"num_probes_to_keep: dp_size={dp_size}; expected >= 1")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"num_probes_to_keep: rho={rho}; expected a value in [0, 1]")
    # The small epsilon keeps e.g. 100 * 0.29 = 28.999999999999996 from flooring to 28.
    k = int(math.floor(num_questions * group_size * rho + 1e-9))
    k = min(k, int(num_available))
    return k - k % dp_size


def inserted_mean_logp(logp: np.ndarray, probe_start, probe_len) -> np.ndarray:
    """Mean of logp[n, probe_start[n] : probe_start[n] + probe_len[n]] per row ([P] float64; -inf if empty)."""
    logp = np.asarray(logp, dtype=np.float64)
    out = np.full(logp.shape[0], -np.inf)
    for n in range(logp.shape[0]):
        start, end = int(probe_start[n]), min(int(probe_start[n]) + int(probe_len[n]), logp.shape[1])
        if start >= 0 and end > start:
            out[n] = logp[n, start:end].mean()
    return out


def select_probes(probe_scores, num_questions: int, group_size: int, rho: float, dp_size: int = 1) -> np.ndarray:
    """Indices (into probe_scores) of the probes to keep, best first.

    probe_scores: [P] mean old-policy log-prob of each probe's inserted prompt tokens
    (see inserted_mean_logp); NaN is treated as -inf.
    """
    scores = np.asarray(probe_scores, dtype=np.float64).reshape(-1)
    scores = np.where(np.isnan(scores), -np.inf, scores)
    k = num_probes_to_keep(num_questions, group_size, rho, scores.size, dp_size)
    order = np.argsort(-scores, kind="stable")  # stable: ties keep the lower index first
    return order[:k].astype(np.int64)
