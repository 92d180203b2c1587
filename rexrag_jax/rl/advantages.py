"""GRPO group-normalised advantages (SPEC §6), jittable.

For trajectory i in group g (question id; probes share their original's group):

    A_i = (R_i - mean_g) / (std_g + eps),   std_g = sqrt( sum_{k in g} (R_k - mean_g)^2 / (n_g - 1) )

(unbiased std, ddof = 1) and A_i = 0 when n_g = 1 (a singleton group carries no relative signal).
Group ids may be any integers (not necessarily 0..G-1); they are compacted with a sized unique so the
function stays jittable for a fixed N.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards: jax.Array, group_ids: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Per-trajectory advantages [N] (float32) from rewards [N] and integer group ids [N]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"group_advantages: expected rewards [N] and group_ids [N], got {rewards.shape} "
                         f"and {group_ids.shape}")
    n = rewards.shape[0]
    if n == 0:
        return rewards
    _, seg = jnp.unique(group_ids, return_inverse=True, size=n)
    seg = seg.reshape(-1)
    count = jax.ops.segment_sum(jnp.ones_like(rewards), seg, num_segments=n)
    mean = jax.ops.segment_sum(rewards, seg, num_segments=n) / jnp.maximum(count, 1.0)
    centred = rewards - mean[seg]
    sq = jax.ops.segment_sum(centred * centred, seg, num_segments=n)
    std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
    adv = centred / (std[seg] + eps)
    return jnp.where(count[seg] > 1, adv, 0.0)


def broadcast_to_tokens(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """[N] per-trajectory values -> [N, T] on loss-masked tokens, 0 elsewhere (padding, prompt, info)."""
    values = jnp.asarray(values, jnp.float32)
    loss_mask = jnp.asarray(loss_mask)
    if values.ndim != 1 or loss_mask.ndim != 2 or loss_mask.shape[0] != values.shape[0]:
        raise ValueError(f"broadcast_to_tokens: expected values [N] and loss_mask [N, T], got {values.shape} "
                         f"and {loss_mask.shape}")
    return values[:, None] * loss_mask.astype(jnp.float32)
