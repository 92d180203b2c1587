"""RAPO (Retrieval-Augmented Policy Optimization, arXiv 2603.03078) formulas (SPEC §8).

Hybrid rollouts splice retrieved step-level traces ("inserted" tokens) between policy-generated
steps. The optimisation side, as the paper defines it:

  1. Inserted tokens are masked out of the loss (the policy did not produce them):
         loss_mask_rapo = loss_mask AND NOT inserted.
  2. Retrieval reward of one insertion, from the policy's entropy around it (`retrieval_reward`):
         H_Δ = (H_{t-1} - H_{t+1}) / H_{t-1},   g = tanh(2 H_Δ),   Z = g · H_{t-1}
     H_{t-1} = mean per-token entropy of the policy step before the insertion,
     H_{t+1} = mean per-token entropy of the policy step after it. H_Δ is the *relative* entropy drop
     (≤ 1, since H_{t+1} ≥ 0); Z > 0 when the retrieved step made the policy more certain, and the
     factor H_{t-1} credits insertions that helped where it was unsure. |Z| ≤ H_{t-1}.
     H_{t-1} = 0 (the policy was already certain): H_Δ is 0/0; we take Z = 0, the limit of g·H_{t-1}
     as H_{t-1} → 0 for any bounded g (documented choice: no NaN, no credit).
  3. Combined advantage:  A = (1 + 0.2 · A_ret) · A_acc, with A_acc = group_advantages(reward) and
     A_ret = group_advantages(Z_ret) (GRPO normalisation of Z_ret within the question's group).
  4. Importance shaping:  r̂ = (1 + 0.05 · F_ret) · r, F_ret = fraction of the trajectory's response
     tokens (policy + inserted) that were inserted; the PPO clip is applied to r̂.
  5. Defaults: β (KL coefficient) = 0, ε_low = ε_high = 0.28.
  6. Aggregation (`aggregation="seq_mean"`, the paper's): per-sequence token mean, then the mean over
     sequences, L = 1/G Σ_i 1/|s_i| Σ_j loss_ij (`seq_mean_weights`); "token_mean" is GRPO's.

Choices where the paper is silent (docs/rapo.md):
  * A "step" is a maximal contiguous run of policy tokens (or of inserted tokens); anything else
    (prompt, retrieved information, invalid-action text, padding) ends a run. The steps "before" and
    "after" an insertion are the nearest policy runs on either side.
  * An insertion without a policy step on both sides gets no retrieval reward (the hybrid rollout never
    makes one: no insertion at step 0, and each insertion is followed by a policy step).
  * A trajectory with several insertions gets the mean Z over its scorable insertions; a trajectory
    with none (every pure on-policy row) gets Z_ret = 0, so A_ret compares hybrid and plain rollouts
    of the same question.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rexrag_jax.rl.advantages import group_advantages
from rexrag_jax.rl.loss import grpo_token_loss

RET_ADV_COEF = 0.2
RATIO_SHAPING_COEF = 0.05
RAPO_CLIP_EPS = 0.28
RAPO_KL_COEF = 0.0


def retrieval_reward(h_before, h_after):
    """Z = tanh(2 H_Δ) · H_{t-1}, H_Δ = (H_{t-1} - H_{t+1}) / H_{t-1}; elementwise, pure.

    h_before = H_{t-1}, h_after = H_{t+1} (scalars or broadcastable numpy / jax arrays; jax in → jax
    out, jittable). Where H_{t-1} <= 0 the relative drop is undefined and Z = 0 (the limit of g·H_{t-1};
    see the module docstring): no NaN, and no NaN gradient either (the division is guarded).
    """
    xp = jnp if isinstance(h_before, jax.Array) or isinstance(h_after, jax.Array) else np
    h_b, h_a = xp.asarray(h_before), xp.asarray(h_after)
    if xp is np:
        h_b, h_a = h_b.astype(np.float64), h_a.astype(np.float64)
    pos = h_b > 0
    h_delta = xp.where(pos, (h_b - h_a) / xp.where(pos, h_b, 1.0), 0.0)
    return xp.where(pos, xp.tanh(2.0 * h_delta) * h_b, 0.0)


def _runs(kind: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs (kind, start, end) of equal non-zero codes in a 1-D int array."""
    runs, t, n = [], 0, len(kind)
    while t < n:
        if kind[t] == 0:
            t += 1
            continue
        start = t
        while t < n and kind[t] == kind[start]:
            t += 1
        runs.append((int(kind[start]), start, t))
    return runs


def retrieval_rewards(entropy, policy_mask, inserted_mask) -> np.ndarray:
    """Per-trajectory retrieval reward Z [N] (float32, host-side) from old-policy token entropies [N, T].

    policy_mask: [N, T] tokens the policy generated; inserted_mask: [N, T] spliced retrieved tokens.
    """
    entropy = np.asarray(entropy, dtype=np.float64)
    policy = np.asarray(policy_mask, bool)
    inserted = np.asarray(inserted_mask, bool)
    if entropy.ndim != 2 or policy.shape != entropy.shape or inserted.shape != entropy.shape:
        raise ValueError(f"retrieval_rewards: expected entropy, policy_mask, inserted_mask all [N, T], got "
                         f"{entropy.shape}, {policy.shape}, {inserted.shape}")
    if np.any(policy & inserted):
        rows = np.flatnonzero(np.any(policy & inserted, axis=1))
        raise ValueError(f"retrieval_rewards: rows {rows.tolist()} have tokens both policy and inserted")
    out = np.zeros(entropy.shape[0], dtype=np.float32)
    for n in range(entropy.shape[0]):
        kind = policy[n].astype(np.int8) + 2 * inserted[n].astype(np.int8)  # 1 = policy, 2 = inserted
        runs = _runs(kind)
        pol = [(s, e) for k, s, e in runs if k == 1]
        zs = []
        for k, s, e in runs:
            if k != 2:
                continue
            before = [r for r in pol if r[1] <= s]
            after = [r for r in pol if r[0] >= e]
            if before and after:
                h_b = entropy[n, before[-1][0]:before[-1][1]].mean()
                h_a = entropy[n, after[0][0]:after[0][1]].mean()
                zs.append(float(retrieval_reward(h_b, h_a)))
        if zs:
            out[n] = np.mean(zs)
    return out


def combined_advantages(rewards, z_ret, group_ids, coef: float = RET_ADV_COEF,
                        eps: float = 1e-6) -> jax.Array:
    """A = (1 + coef · A_ret) · A_acc with A_acc, A_ret the group-normalised reward and retrieval reward Z_ret."""
    a_acc = group_advantages(rewards, group_ids, eps)
    a_ret = group_advantages(z_ret, group_ids, eps)
    return (1.0 + coef * a_ret) * a_acc


def retrieval_fraction(policy_mask, inserted_mask, length_mask=None) -> jax.Array:
    """F_ret [N] = #inserted / trajectory length per trajectory (0 for an empty row).

    Length = #policy + #inserted tokens by default (the response the model "wrote" or was given as its
    own steps), or the tokens of `length_mask` when given (e.g. every token after the prompt,
    observations included: RapoConfig.f_ret_length = "after_prompt"). The paper's denominator is
    ambiguous (SPEC §8); docs/rapo.md.
    """
    ins = jnp.sum(jnp.asarray(inserted_mask, bool), axis=1).astype(jnp.float32)
    if length_mask is None:
        length = ins + jnp.sum(jnp.asarray(policy_mask, bool), axis=1).astype(jnp.float32)
    else:
        length = jnp.sum(jnp.asarray(length_mask, bool), axis=1).astype(jnp.float32)
    return ins / jnp.maximum(length, 1.0)


def shaped_ratio_fn(f_ret, coef: float = RATIO_SHAPING_COEF) -> Callable[[jax.Array], jax.Array]:
    """ratio_fn for grpo_token_loss: r -> (1 + coef · F_ret[n]) · r, row-wise."""
    scale = 1.0 + coef * jnp.asarray(f_ret, jnp.float32)[:, None]
    return lambda ratio: scale * ratio


def rapo_loss_mask(loss_mask, inserted_mask) -> jax.Array:
    """Loss mask with the inserted (retrieved) tokens removed."""
    return jnp.asarray(loss_mask, bool) & ~jnp.asarray(inserted_mask, bool)


AGGREGATIONS = ("seq_mean", "token_mean")


def seq_mean_weights(loss_mask, length_mask=None) -> tuple[jax.Array, jax.Array]:
    """(token_weight [N] float32, count_mask [N, T] bool) for the per-sequence mean (paper's aggregation).

    With grpo_token_loss(..., token_weight, count_mask): loss_sum = Σ_i w_i Σ_{j in s_i} loss_ij and
    token_count = Σ count_mask = the number of sequences with ≥ 1 loss token, so loss_sum / count =
    1/G Σ_i 1/|s_i| Σ_j loss_ij. Both are sums over rows, so accumulating them over micro-batches (and
    packing, which moves each row's tokens together) stays exact: Σ sums / Σ counts is the mean over
    every sequence of the mini-batch, not a mean of per-micro-batch means.

    |s_i| = the row's loss tokens (policy tokens; inserted tokens are outside the loss), or the tokens
    of `length_mask` when given (e.g. policy + inserted: docs/rapo.md). count_mask marks each counted
    row's first loss token; rows with no loss token get weight 0 and no mark.
    """
    mask = jnp.asarray(loss_mask, bool)
    length = jnp.sum(mask if length_mask is None else jnp.asarray(length_mask, bool), axis=1).astype(jnp.float32)
    has = jnp.any(mask, axis=1)
    weight = jnp.where(has, 1.0 / jnp.maximum(length, 1.0), 0.0)
    first = jnp.argmax(mask, axis=1)
    count_mask = (jnp.arange(mask.shape[1])[None, :] == first[:, None]) & has[:, None]
    return weight, count_mask


def rapo_token_loss(logp, old_logp, advantages, loss_mask, policy_mask, inserted_mask, ref_logp=None,
                    eps: float = RAPO_CLIP_EPS, kl_coef: float = RAPO_KL_COEF,
                    ratio_coef: float = RATIO_SHAPING_COEF, aggregation: str = "token_mean", **kwargs):
    """grpo_token_loss with RAPO's masking, ratio shaping and defaults (β = 0, ε = 0.28).

    advantages: combined_advantages(...) [N]. Returns (loss_sum, count, metrics); loss = loss_sum / count.
    aggregation "token_mean": count = loss tokens; "seq_mean" (the paper's): count = sequences and each
    sequence's tokens weighted 1/|s_i| (seq_mean_weights).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"rapo_token_loss: aggregation={aggregation!r}, expected one of {AGGREGATIONS}")
    f_ret = retrieval_fraction(policy_mask, inserted_mask)
    mask = rapo_loss_mask(loss_mask, inserted_mask)
    if aggregation == "seq_mean":
        kwargs["token_weight"], kwargs["count_mask"] = seq_mean_weights(mask)
    return grpo_token_loss(logp, old_logp, ref_logp, advantages, mask,
                           eps_low=eps, eps_high=eps, kl_coef=kl_coef,
                           ratio_fn=shaped_ratio_fn(f_ret, ratio_coef), **kwargs)
