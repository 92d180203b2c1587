"""REX-RAG behaviour density μ for the policy correction (SPEC §5), jittable.

The training batch mixes originals (drawn from π_old) with kept probes (drawn from a different
process: a failed original's prefix, a pool prompt, then π_old again). With
    α   = kept probes / batch size,
    err = 1 - accuracy (EM) of the originals in the batch,
the per-token behaviour probability used as the "old" probability in the PPO ratio is

    original rows:  b_t = (1 - α) · π_old(t)                         (the reference adds α·0)
    probe rows:     b_t = (1 - α) · π_old(t) + α · μ(t), where
        prefix tokens (loss-masked, index < probe_start):  μ = π_old / err^(1/j)
        inserted prompt tokens [probe_start, probe_start + probe_len):  μ = pool probability
        continuation tokens (index >= probe_start + probe_len):  μ = π_old

j is the number of loss-masked (policy-sampled) tokens before probe_start. Spreading 1/err evenly
as err^(-1/j) per token makes the product over the prefix exactly π_old(prefix) / err: the prefix
was drawn from π_old *conditioned on the original failing*, an event of probability ≈ err. Only
tokens the policy produced count towards j (retrieved information and invalid-action text carry no
policy probability). When j = 0 there are no prefix tokens, so the factor is never applied.

Everything is computed in log space: log b = logaddexp(log(1-α) + log π_old, log α + log μ), which
is exact for α = 0 (log α = -inf) and never forms a tiny probability explicitly.

Edge cases:
  * err is clamped to [err_floor, 1] (err_floor = 1e-6 by default). err = 0 means no original failed,
    so no probe can be present in a consistent batch; the clamp only keeps the result finite.
  * Positions outside loss_mask get 0 (they never enter the loss).
  * old_logp must hold log π_old at every loss-masked token, inserted prompt tokens included (they
    were not sampled, so the trainer's old-policy forward pass provides them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_ERR_FLOOR = 1e-6


def probe_token_masks(loss_mask: jax.Array, is_probe: jax.Array, probe_start: jax.Array,
                      probe_len: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(prefix, inserted, continuation) bool masks [N, T] for probe rows (all False on originals).

    prefix = loss-masked tokens before probe_start; inserted = [probe_start, probe_start + probe_len);
    continuation = loss-masked tokens after the inserted prompt.
    """
    loss_mask = jnp.asarray(loss_mask, bool)
    pos = jnp.arange(loss_mask.shape[1])[None, :]
    probe = jnp.asarray(is_probe, bool)[:, None]
    start = jnp.asarray(probe_start)[:, None]
    end = start + jnp.asarray(probe_len)[:, None]
    prefix = probe & loss_mask & (pos < start)
    inserted = probe & (pos >= start) & (pos < end)
    continuation = probe & loss_mask & (pos >= end)
    return prefix, inserted, continuation


def behaviour_logprobs(old_logp: jax.Array, loss_mask: jax.Array, is_probe: jax.Array, probe_start: jax.Array,
                       probe_len: jax.Array, pool_logp: jax.Array, alpha, err,
                       err_floor: float = DEFAULT_ERR_FLOOR) -> jax.Array:
    """log behaviour probability [N, T] (float32) for the PPO ratio; see the module docstring.

    Args:
      old_logp: [N, T] log π_old of each token.   loss_mask: [N, T] bool.
      is_probe: [N] bool.  probe_start: [N] int (index of the first inserted token; ignored on originals).
      probe_len: [N] int.  pool_logp: [N, T] log pool probability at inserted tokens (0 elsewhere).
      alpha: scalar in [0, 1).  err: scalar in [0, 1].
    """
    old_logp = jnp.asarray(old_logp, jnp.float32)
    pool_logp = jnp.asarray(pool_logp, jnp.float32)
    loss_mask = jnp.asarray(loss_mask, bool)
    if old_logp.ndim != 2 or old_logp.shape != loss_mask.shape or pool_logp.shape != old_logp.shape:
        raise ValueError(f"behaviour_logprobs: expected old_logp, loss_mask, pool_logp all [N, T], got "
                         f"{old_logp.shape}, {loss_mask.shape}, {pool_logp.shape}")
    n = old_logp.shape[0]
    for name, arr in (("is_probe", is_probe), ("probe_start", probe_start), ("probe_len", probe_len)):
        if jnp.shape(arr) != (n,):
            raise ValueError(f"behaviour_logprobs: expected {name} of shape ({n},), got {jnp.shape(arr)}")
    alpha = jnp.asarray(alpha, jnp.float32)
    err = jnp.clip(jnp.asarray(err, jnp.float32), err_floor, 1.0)

    prefix, inserted, _ = probe_token_masks(loss_mask, is_probe, probe_start, probe_len)
    j = jnp.sum(prefix, axis=1, keepdims=True).astype(jnp.float32)
    prefix_logmu = old_logp - jnp.log(err) / jnp.maximum(j, 1.0)
    log_mu = jnp.where(prefix, prefix_logmu, jnp.where(inserted, pool_logp, old_logp))

    on_policy = jnp.log1p(-alpha) + old_logp
    mixed = jnp.logaddexp(on_policy, jnp.log(alpha) + log_mu)
    out = jnp.where(jnp.asarray(is_probe, bool)[:, None], mixed, on_policy)
    return jnp.where(loss_mask, out, 0.0)


def batch_alpha_err(is_probe: jax.Array, correct: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(α, err) of a training batch (originals + kept probes).

    α = #probes / N;  err = 1 - mean(correct over originals), correct = EM in {0, 1} per row (not the
    shaped reward). With no originals err = 1 (nothing succeeded; such a batch cannot occur in REX-RAG).
    """
    is_probe = jnp.asarray(is_probe, bool)
    correct = jnp.asarray(correct, jnp.float32)
    if is_probe.ndim != 1 or correct.shape != is_probe.shape:
        raise ValueError(f"batch_alpha_err: expected is_probe [N] and correct [N], got {is_probe.shape} "
                         f"and {correct.shape}")
    n = is_probe.shape[0]
    orig = (~is_probe).astype(jnp.float32)
    alpha = jnp.sum(is_probe).astype(jnp.float32) / max(n, 1)
    n_orig = jnp.sum(orig)
    acc = jnp.sum(correct * orig) / jnp.maximum(n_orig, 1.0)
    err = jnp.where(n_orig > 0, 1.0 - acc, 1.0)
    return alpha, err


def behaviour_for_batch(batch, old_logp, pool, correct, err_floor: float = DEFAULT_ERR_FLOOR):
    """Convenience wiring for a TrajectoryBatch-like object (tokens, loss_mask, is_probe, probe_start, probe_len).

    pool: a PromptPoolDistribution (host-side trie, so this helper is not jittable as a whole);
    correct: [N] EM per row. Returns (log behaviour [N, T], α, err).
    """
    pool_logp = pool.logprob_matrix(batch.tokens, batch.is_probe, batch.probe_start, batch.probe_len)
    alpha, err = batch_alpha_err(batch.is_probe, correct)
    log_b = behaviour_logprobs(old_logp, batch.loss_mask, batch.is_probe, batch.probe_start, batch.probe_len,
                               pool_logp, alpha, err, err_floor)
    return log_b, alpha, err
