"""Host-side assembly of a training batch (SPEC §4-§6): rewards → probe filtering → advantages →
behaviour density → fixed-shape mini-batches. The log-prob passes are supplied as callables, so this
module is numpy + the pure functions of rexrag_jax.rl.

Order within a step (the trainer calls these in sequence):
  1. rewards R_i = compute_reward(response_i, golds_i, s); correct_i = EM_i (s = 0)
  2. old log-probs of every row (originals and all probes) under the current params (π_old)
  3. keep K probes ranked by the mean π_old log-prob of their inserted prompt tokens (filtering.py);
     batch = all originals + kept probes; ρ is updated from the kept probes' rewards
  4. A = group_advantages(R, question ids) on the kept batch (probes in their original's group)
  5. α = kept probes / batch, err = 1 - accuracy of originals; behaviour log-probs (behaviour.py)
  6. rows shuffled (deterministically) and cut into mini-batches of `mini_batch` rows, each reshaped
     to [mini_batch / micro_batch, micro_batch, T]; the last one is padded with empty rows (loss
     mask all False: they add nothing to the loss sum nor to the token count).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rexrag_jax.rewards import compute_reward
from rexrag_jax.rewards.em import exact_match, extract_last_answer
from rexrag_jax.rl.filtering import inserted_mean_logp, select_probes, update_keep_ratio
from rexrag_jax.rollout.types import TrajectoryBatch


def score(batch: TrajectoryBatch, structure_format_score: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(rewards [N] float32, correct [N] float32): the training reward and the binary EM of the last answer."""
    rewards = np.array([compute_reward(t, ex.golden_answers, structure_format_score)
                        for t, ex in zip(batch.response_text, batch.examples)], np.float32)
    correct = []
    for t, ex in zip(batch.response_text, batch.examples):
        pred = extract_last_answer(t)
        correct.append(0.0 if pred is None else float(exact_match(pred, ex.golden_answers)))
    return rewards, np.asarray(correct, np.float32)


def length_bucket(length: int, bucket: int, max_len: int) -> int:
    """Smallest multiple of `bucket` >= length, capped at max_len (fixed shapes → few compiles)."""
    return min(max_len, -(-max(length, 1) // bucket) * bucket)


def fit_length(batch: TrajectoryBatch, bucket: int, max_len: int) -> tuple[TrajectoryBatch, int]:
    """Resize T to the bucket of the longest row; rows longer than max_len are cut on the right.

    Returns (batch, number of rows that were cut).
    """
    lengths = batch.lengths
    truncated = int((lengths > max_len).sum())
    t = length_bucket(min(int(lengths.max()) if batch.size else 1, max_len), bucket, max_len)
    if batch.tokens.shape[1] <= t:
        return batch.pad_to(t), truncated
    fields = {k: getattr(batch, k)[:, :t] for k in ("tokens", "segments", "loss_mask", "sample_logprobs",
                                                     "attention_mask")}
    fields.update({k: getattr(batch, k) for k in ("group_ids", "is_probe", "probe_start", "probe_len",
                                                  "rewards", "num_searches")})
    return TrajectoryBatch(**fields, examples=batch.examples, response_text=batch.response_text,
                           pad_id=batch.pad_id), truncated


def rowwise(fn: Callable, arrays: tuple[np.ndarray, ...], rows: int) -> list[np.ndarray]:
    """Apply fn to `rows`-row slices (the last padded by repeating row 0), concatenating the outputs.

    Keeps one compiled shape for any N; fn returns a tuple of [rows, ...] arrays (None entries pass).
    """
    n = arrays[0].shape[0]
    outs: list[list] | None = None
    for lo in range(0, n, rows):
        chunk = [a[lo:lo + rows] for a in arrays]
        real = chunk[0].shape[0]
        if real < rows:
            chunk = [np.concatenate([c, np.repeat(a[:1], rows - real, axis=0)]) for c, a in zip(chunk, arrays)]
        res = fn(*chunk)
        res = [None if r is None else np.asarray(r)[:real] for r in res]
        outs = [[] for _ in res] if outs is None else outs
        for o, r in zip(outs, res):
            o.append(r)
    return [None if o[0] is None else np.concatenate(o) for o in outs]


def filter_probes(batch: TrajectoryBatch, old_logp: np.ndarray, rho: float, num_questions: int,
                  group_size: int, dp_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(row indices kept: all originals then kept probes best-first, indices of the kept probes)."""
    originals = np.flatnonzero(~batch.is_probe)
    probes = np.flatnonzero(batch.is_probe)
    if probes.size == 0:
        return originals, probes
    scores = inserted_mean_logp(old_logp[probes], batch.probe_start[probes], batch.probe_len[probes])
    kept = probes[select_probes(scores, num_questions, group_size, rho, dp_size)]
    return np.concatenate([originals, kept]), kept


def next_keep_ratio(rho: float, kept_rewards: np.ndarray, decay: float = 0.9) -> float:
    return update_keep_ratio(rho, kept_rewards, decay=decay)


def mini_batches(arrays: dict[str, np.ndarray], mini_batch: int, micro_batch: int,
                 rng: np.random.Generator | None) -> list[dict[str, np.ndarray]]:
    """Shuffle rows (if rng), cut into mini-batches [mini/micro, micro, ...], pad the last with empty rows."""
    if mini_batch % micro_batch:
        raise ValueError(f"mini_batch={mini_batch} must be a multiple of micro_batch={micro_batch}")
    n = next(iter(arrays.values())).shape[0]
    order = rng.permutation(n) if rng is not None else np.arange(n)
    out = []
    for lo in range(0, n, mini_batch):
        idx = order[lo:lo + mini_batch]
        mb = {}
        for k, a in arrays.items():
            part = a[idx]
            if part.shape[0] < mini_batch:  # empty rows: zeros everywhere, so loss_mask is False
                part = np.concatenate([part, np.zeros((mini_batch - part.shape[0],) + a.shape[1:], a.dtype)])
            mb[k] = part.reshape((mini_batch // micro_batch, micro_batch) + a.shape[1:])
        out.append(mb)
    return out


def group_diagnostics(group_ids: np.ndarray, is_probe: np.ndarray, correct: np.ndarray,
                      kept_probes: np.ndarray) -> dict:
    """Per-step probe diagnostics (REX-RAG's mechanism, logged to TensorBoard `groups/*`, `probes/*`):

      groups/all_fail          share of questions whose originals all failed (EM 0): GRPO's zero-signal groups
      groups/rescued           share of questions whose originals all failed and a *kept* probe succeeded
                               (the group gets an advantage signal only because of the probe)
      probes/success_created   EM of every probe created this step (NaN when none)
      probes/success_kept      EM of the kept probes (NaN when none)
    """
    gid, probe = np.asarray(group_ids), np.asarray(is_probe, bool)
    correct = np.asarray(correct, np.float32)
    kept = np.zeros(len(gid), bool)
    kept[np.asarray(kept_probes, int)] = True
    groups = np.unique(gid[~probe])
    all_fail = {g for g in groups if not correct[(gid == g) & ~probe].any()}
    rescued = {g for g in all_fail if correct[(gid == g) & kept].any()}
    n = max(len(groups), 1)
    return {"groups/all_fail": len(all_fail) / n, "groups/rescued": len(rescued) / n,
            "probes/success_created": float(correct[probe].mean()) if probe.any() else float("nan"),
            "probes/success_kept": float(correct[kept].mean()) if kept.any() else float("nan")}


def start_ratio_diagnostics(old_logp: np.ndarray, behaviour_logp: np.ndarray, loss_mask: np.ndarray,
                            is_probe: np.ndarray, probe_start: np.ndarray, probe_len: np.ndarray,
                            advantages: np.ndarray) -> dict:
    """The PPO ratio r = π_θ / behaviour at the step's first update (π_θ = π_old), by token kind:

      ratio0/original           mean r over originals' loss tokens (1 / (1 - α) with the correction)
      ratio0/probe_prefix       mean r over kept probes' prefix tokens (the failed original's part)
      ratio0/probe_prompt       mean r over the inserted pool-prompt tokens
      ratio0/probe_prompt_first mean r at each kept probe's first prompt token
      ratio0/probe_continuation mean r over the tokens sampled after the prompt
      ratio0/prompt_pos_weight  mean of A·min(r, 1 + 0.2) over positive-advantage probes' prompt tokens:
                                the gradient weight that teaches the policy to write the prompt itself
                                (A·1 without the correction)

    With the correction the prompt's behaviour is dominated by α·pool, so r ≈ π_old(prompt) / (α·pool)
    ≪ 1 while the policy rarely writes it: the positive advantage of a rescued probe reaches the prompt
    tokens only with that small weight. NaN where a kind has no tokens.
    """
    old, beh = np.asarray(old_logp, np.float64), np.asarray(behaviour_logp, np.float64)
    mask, probe = np.asarray(loss_mask, bool), np.asarray(is_probe, bool)
    r = np.exp(np.clip(old - beh, -20.0, 20.0))
    pos = np.arange(old.shape[1])[None, :]
    start = np.asarray(probe_start)[:, None]
    end = start + np.asarray(probe_len)[:, None]
    p = probe[:, None]
    kinds = {"original": mask & ~p, "probe_prefix": mask & p & (pos < start),
             "probe_prompt": mask & p & (pos >= start) & (pos < end),
             "probe_prompt_first": mask & p & (pos == start) & (end > start),
             "probe_continuation": mask & p & (pos >= end)}
    out = {f"ratio0/{k}": float(r[m].mean()) if m.any() else float("nan") for k, m in kinds.items()}
    adv = np.broadcast_to(np.asarray(advantages, np.float64).reshape(len(probe), -1), old.shape)
    m = kinds["probe_prompt"] & (adv > 0)
    out["ratio0/prompt_pos_weight"] = float((adv * np.minimum(r, 1.2))[m].mean()) if m.any() else float("nan")
    return out
