"""Token-level PPO-clip + k3 KL loss with exact token-mean aggregation (SPEC §5-§6), jittable.

Per loss-masked token t of trajectory i (A = advantage, b = behaviour log-prob, see behaviour.py):

    r_t    = exp(clamp(logp_t - b_t, -20, 20))          (clamp as in verl: keeps exp finite)
    r_t    = ratio_fn(r_t)                              (optional shaping, e.g. RAPO; identity by default)
    pg_t   = max(-A r_t, -A clip(r_t, 1 - ε_low, 1 + ε_high))
    d_t    = clamp(ref_logp_t - logp_t, -20, 20)
    kl_t   = clamp(exp(d_t) - d_t - 1, -10, 10)         (k3 / "low_var_kl")
    H_t    = -Σ_v p_v log p_v                            (only when logits are given)
    loss_t = pg_t + kl_coef · kl_t - entropy_coef · H_t

The mini-batch loss is the token mean over all loss-masked tokens: L = Σ loss_t / #tokens (GRPO, SPEC §6).
Optional `token_weight` w and `count_mask` c generalise it: L = Σ w_t loss_t / Σ c_t; RAPO's per-sequence
mean (rl.rapo.seq_mean_weights) is w = 1/|s_i| on row i and c = one mark per sequence. To stay
exact under gradient accumulation, grpo_token_loss returns the *sum* and the *count* of one micro-batch;
the trainer accumulates Σ_i ∇ loss_sum_i and divides by Σ_i count_i (or scales each micro-batch's
loss_sum by 1 / total_count known up front). Averaging per-micro-batch means is NOT the same when
micro-batches hold different token counts.

Clip fractions (tokens where the clipped branch is active, i.e. carries no gradient):
    clip_frac_high: A > 0 and r > 1 + ε_high;   clip_frac_low: A < 0 and r < 1 - ε_low.
Metrics keys are "{split}/{name}" with split in {all, original, probe} (original/probe only when
is_probe is given); "{split}/tokens" is the token count, means over an empty split are 0 and its
min / max are +inf / -inf, so combine_micro_batches merges them exactly.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0
KL_LOG_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k3 KL estimate per token: d = clip(ref - logp, ±20), clip(e^d - d - 1, ±10)."""
    d = jnp.clip(ref_logp - logp, -KL_LOG_CLAMP, KL_LOG_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def ppo_clip_loss(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array, eps_low: float = 0.2,
                  eps_high: float = 0.2, ratio_fn: Callable[[jax.Array], jax.Array] | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """(per-token clipped policy-gradient loss, ratio), both shaped like logp; advantages broadcast."""
    ratio = jnp.exp(jnp.clip(logp - behaviour_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if ratio_fn is not None:
        ratio = ratio_fn(ratio)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return jnp.maximum(-advantages * ratio, -advantages * clipped), ratio


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Per-token entropy [..., T] of softmax(logits [..., T, V]) (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _masked_stats(x: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    count = jnp.sum(m)
    mean = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(count, 1).astype(jnp.float32)
    return count, mean, jnp.min(jnp.where(m, x, jnp.inf)), jnp.max(jnp.where(m, x, -jnp.inf))


def grpo_token_loss(logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None, advantages: jax.Array,
                    loss_mask: jax.Array, eps_low: float = 0.2, eps_high: float = 0.2, kl_coef: float = 0.001,
                    ratio_fn: Callable[[jax.Array], jax.Array] | None = None, is_probe: jax.Array | None = None,
                    logits: jax.Array | None = None, entropy_coef: float = 0.0,
                    token_weight: jax.Array | None = None, count_mask: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, dict]:
    """(loss_sum, token_count, metrics) of one micro-batch; see the module docstring.

    Args:
      logp: [N, T] current-policy log-probs (the differentiated input).
      old_logp: [N, T] behaviour log-probs (log π_old for plain GRPO; behaviour_logprobs for REX-RAG).
      ref_logp: [N, T] reference log-probs, or None when kl_coef == 0.
      advantages: [N] (broadcast over tokens) or [N, T].
      loss_mask: [N, T] bool; nothing outside it contributes to the loss, the gradient or the metrics.
      is_probe: [N] or per token [N, T] (packed rows hold originals and probes side by side).
      logits: optional [N, T, V] (aligned with logp) for the entropy metric / bonus.
      token_weight: optional [N] or [N, T] weights of each token's loss in loss_sum (default 1).
      count_mask: optional [N, T] bool; token_count = its sum instead of the loss-mask count (the
        metrics stay per loss token either way).
    """
    logp = jnp.asarray(logp, jnp.float32)
    old_logp = jnp.asarray(old_logp, jnp.float32)
    mask = jnp.asarray(loss_mask, bool)
    if logp.ndim != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"grpo_token_loss: expected logp, old_logp, loss_mask all [N, T], got {logp.shape}, "
                         f"{old_logp.shape}, {mask.shape}")
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    if adv.shape not in ((logp.shape[0], 1), logp.shape):
        raise ValueError(f"grpo_token_loss: expected advantages [N] or [N, T] with N, T = {logp.shape}, "
                         f"got {jnp.shape(advantages)}")

    pg, ratio = ppo_clip_loss(logp, old_logp, adv, eps_low, eps_high, ratio_fn)
    per_token = pg
    metrics = {}
    if ref_logp is not None:
        kl = k3_kl(logp, jnp.asarray(ref_logp, jnp.float32))
        per_token = per_token + kl_coef * kl
    elif kl_coef != 0.0:
        raise ValueError(f"grpo_token_loss: kl_coef={kl_coef} needs ref_logp, got None")
    if logits is not None:
        ent = entropy_from_logits(logits)
        per_token = per_token - entropy_coef * ent
    elif entropy_coef != 0.0:
        raise ValueError(f"grpo_token_loss: entropy_coef={entropy_coef} needs logits, got None")

    if token_weight is not None:
        w = jnp.asarray(token_weight, jnp.float32)
        per_token = per_token * (w[:, None] if w.ndim == 1 else w)
    loss_sum = jnp.sum(jnp.where(mask, per_token, 0.0))
    token_count = jnp.sum(mask if count_mask is None else jnp.asarray(count_mask, bool)).astype(jnp.int32)

    # Metrics carry no gradient.
    ratio_sg, adv_b = jax.lax.stop_gradient(ratio), jnp.broadcast_to(adv, logp.shape)
    clip_high = (adv_b > 0) & (ratio_sg > 1.0 + eps_high)
    clip_low = (adv_b < 0) & (ratio_sg < 1.0 - eps_low)
    splits = {"all": mask}
    if is_probe is not None:
        probe_rows = jnp.asarray(is_probe, bool)
        probe_rows = probe_rows[:, None] if probe_rows.ndim == 1 else probe_rows  # [N] or per token [N, T]
        splits["original"] = mask & ~probe_rows
        splits["probe"] = mask & probe_rows
    for split, m in splits.items():
        count, mean, lo, hi = _masked_stats(ratio_sg, m)
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        metrics[f"{split}/tokens"] = count.astype(jnp.int32)
        metrics[f"{split}/ratio_mean"], metrics[f"{split}/ratio_min"], metrics[f"{split}/ratio_max"] = mean, lo, hi
        metrics[f"{split}/clip_frac_low"] = jnp.sum(clip_low & m) / denom
        metrics[f"{split}/clip_frac_high"] = jnp.sum(clip_high & m) / denom
        metrics[f"{split}/clip_frac"] = metrics[f"{split}/clip_frac_low"] + metrics[f"{split}/clip_frac_high"]
    metrics["all/pg_loss_mean"] = _masked_stats(jax.lax.stop_gradient(pg), mask)[1]
    if ref_logp is not None:
        metrics["all/kl_mean"] = _masked_stats(jax.lax.stop_gradient(kl), mask)[1]
    if logits is not None:
        metrics["all/entropy_mean"] = _masked_stats(jax.lax.stop_gradient(ent), mask)[1]
    return loss_sum, token_count, metrics


def token_mean(loss_sum, token_count):
    """loss_sum / token_count, 0 for an empty mini-batch."""
    return loss_sum / jnp.maximum(token_count, 1)


def combine_micro_batches(outputs: Sequence[tuple], xp=jnp) -> tuple[jax.Array, dict]:
    """Merge grpo_token_loss outputs of the micro-batches of one mini-batch exactly.

    loss = Σ loss_sum / Σ token_count; "*/tokens" add up; "*_min"/"*_max" take min/max; every other
    metric is a per-token mean and is re-weighted by its split's token count. xp=numpy merges host
    values without dispatching (and compiling) jax ops.
    """
    if not outputs:
        raise ValueError("combine_micro_batches: expected at least one micro-batch output")
    total_sum = sum(o[0] for o in outputs)
    total_count = sum(o[1] for o in outputs)
    merged = {}
    for key in outputs[0][2]:
        split, name = key.split("/", 1)
        values = [o[2][key] for o in outputs]
        if name == "tokens":
            merged[key] = sum(values)
        elif name.endswith("_min"):
            merged[key] = xp.min(xp.stack(values))
        elif name.endswith("_max"):
            merged[key] = xp.max(xp.stack(values))
        else:
            weights = [o[2][f"{split}/tokens"] for o in outputs]
            merged[key] = sum(v * w for v, w in zip(values, weights)) / xp.maximum(sum(weights), 1)
    return total_sum / xp.maximum(total_count, 1), merged
