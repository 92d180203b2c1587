"""RAPO (Retrieval-Augmented Policy Optimization, arXiv 2603.03078) formulas (SPEC §8).

Hybrid rollouts splice retrieved step-level traces ("inserted" tokens) between policy-generated
steps. The optimisation side, as implemented here:

  1. Inserted tokens are masked out of the loss (the policy did not produce them):
         loss_mask_rapo = loss_mask AND NOT inserted.
  2. Retrieval reward of one insertion, from the policy's entropy around it:
         ΔH = H_{t-1} - H_{t+1},   g = tanh(2 ΔH),   Z = g · H_{t-1}
     H_{t-1} = mean per-token entropy of the policy step before the insertion,
     H_{t+1} = mean per-token entropy of the policy step after it. Z > 0 when the retrieved step made
     the policy more certain; scaling by H_{t-1} credits insertions that helped where it was unsure.
  3. Combined advantage:  A = (1 + 0.2 · A_ret) · A_acc, with A_acc = group_advantages(reward) and
     A_ret = group_advantages(Z) (GRPO normalisation of Z within the question's group).
  4. Importance shaping:  r̂ = (1 + 0.05 · F_ret) · r, F_ret = fraction of the trajectory's response
     tokens (policy + inserted) that were inserted; the PPO clip is applied to r̂.
  5. Defaults: β (KL coefficient) = 0, ε_low = ε_high = 0.28.

Interpretations (the paper's exact definitions were not available offline; these are documented choices):
  * A "step" is a maximal contiguous run of policy tokens (or of inserted tokens); anything else
    (prompt, retrieved information, invalid-action text, padding) ends a run. The steps "before" and
    "after" an insertion are the nearest policy runs on either side.
  * An insertion without a policy step on both sides gets no retrieval reward (Z contribution 0).
  * A trajectory with several insertions gets the mean Z over its scorable insertions; a trajectory
    with none gets Z = 0 (so A_ret compares hybrid and plain rollouts of the same question).
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


def entropy_drop_reward(h_before, h_after):
    """Z = tanh(2 (H_{t-1} - H_{t+1})) · H_{t-1} (elementwise; numpy or jax arrays)."""
    xp = jnp if isinstance(h_before, jax.Array) or isinstance(h_after, jax.Array) else np
    return xp.tanh(2.0 * (h_before - h_after)) * h_before


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
                zs.append(entropy_drop_reward(h_b, h_a))
        if zs:
            out[n] = np.mean(zs)
    return out


def combined_advantages(rewards, retrieval_reward, group_ids, coef: float = RET_ADV_COEF,
                        eps: float = 1e-6) -> jax.Array:
    """A = (1 + coef · A_ret) · A_acc with A_acc, A_ret the group-normalised reward and retrieval reward."""
    a_acc = group_advantages(rewards, group_ids, eps)
    a_ret = group_advantages(retrieval_reward, group_ids, eps)
    return (1.0 + coef * a_ret) * a_acc


def retrieval_fraction(policy_mask, inserted_mask) -> jax.Array:
    """F_ret [N] = #inserted / (#policy + #inserted) tokens per trajectory (0 when both are 0)."""
    ins = jnp.sum(jnp.asarray(inserted_mask, bool), axis=1).astype(jnp.float32)
    pol = jnp.sum(jnp.asarray(policy_mask, bool), axis=1).astype(jnp.float32)
    return ins / jnp.maximum(ins + pol, 1.0)


def shaped_ratio_fn(f_ret, coef: float = RATIO_SHAPING_COEF) -> Callable[[jax.Array], jax.Array]:
    """ratio_fn for grpo_token_loss: r -> (1 + coef · F_ret[n]) · r, row-wise."""
    scale = 1.0 + coef * jnp.asarray(f_ret, jnp.float32)[:, None]
    return lambda ratio: scale * ratio


def rapo_loss_mask(loss_mask, inserted_mask) -> jax.Array:
    """Loss mask with the inserted (retrieved) tokens removed."""
    return jnp.asarray(loss_mask, bool) & ~jnp.asarray(inserted_mask, bool)


def rapo_token_loss(logp, old_logp, advantages, loss_mask, policy_mask, inserted_mask, ref_logp=None,
                    eps: float = RAPO_CLIP_EPS, kl_coef: float = RAPO_KL_COEF,
                    ratio_coef: float = RATIO_SHAPING_COEF, **kwargs):
    """grpo_token_loss with RAPO's masking, ratio shaping and defaults (β = 0, ε = 0.28).

    advantages: combined_advantages(...) [N]. Returns (loss_sum, token_count, metrics).
    """
    f_ret = retrieval_fraction(policy_mask, inserted_mask)
    return grpo_token_loss(logp, old_logp, ref_logp, advantages, rapo_loss_mask(loss_mask, inserted_mask),
                           eps_low=eps, eps_high=eps, kl_coef=kl_coef,
                           ratio_fn=shaped_ratio_fn(f_ret, ratio_coef), **kwargs)
