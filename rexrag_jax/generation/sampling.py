"""Next-token sampling as pure jittable functions: greedy, temperature, nucleus (top-p).

Two log-probabilities come back for every chosen token:
  * `logprob`          = log softmax(z)[tok] of the raw model logits z (temperature 1, no top-p):
                         log pi(tok) of the unmodified policy, the quantity RL needs;
  * `sampling_logprob` = log q(tok) under the distribution actually sampled from
                         (q = softmax(top_p_filter(z / T))); 0 for greedy (a point mass).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite "minus infinity": keeps log_softmax free of NaN on fully-masked rows


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Nucleus filter over the last axis.

    With p = softmax(logits) sorted in decreasing order, token of rank r is kept iff
    sum_{rank < r} p < top_p (the smallest prefix whose mass reaches top_p; the top token is always
    kept). Implemented with a logit threshold, so tokens tied with the last kept logit are kept too.
    Removed tokens get NEG_INF. top_p >= 1 keeps everything.
    """
    sorted_logits = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    top_p = jnp.asarray(top_p, logits.dtype)
    keep_count = jnp.maximum(jnp.sum(mass_before < top_p[..., None], axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (keep_count - 1)[..., None], axis=-1)
    keep = (logits >= threshold) | (top_p[..., None] >= 1.0)
    return jnp.where(keep, logits, NEG_INF)


def sample_tokens(logits: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  greedy: jax.Array, use_top_p: bool = True):
    """Choose one token per row of logits [B, V] (float32).

    greedy (or temperature <= 0): tok = argmax z. Otherwise tok ~ softmax(top_p_filter(z / T)).
    `use_top_p` is static: False skips the vocabulary sort entirely (top_p == 1). A Python `greedy=True`
    is static too and skips drawing random numbers.
    Returns (tok int32 [B], logprob [B], sampling_logprob [B]) as described in the module docstring.
    """
    logits = logits.astype(jnp.float32)
    if greedy is True:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=-1)[:, 0]
        return tok, logprob, jnp.zeros_like(logprob)
    greedy = jnp.asarray(greedy) | (jnp.asarray(temperature) <= 0)
    safe_t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    scaled = logits / safe_t
    if use_top_p:
        scaled = top_p_filter(scaled, jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), logits.shape[:-1]))
    sampled = jax.random.categorical(rng, scaled, axis=-1)
    tok = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=-1)[:, 0]
    q_logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tok[:, None], axis=-1)[:, 0]
    return tok, logprob, jnp.where(greedy, 0.0, q_logp)
