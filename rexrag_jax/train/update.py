"""The jitted pieces of a training step: log-prob passes and the mini-batch update.

Update of one mini-batch (n micro-batches of M trajectories, shapes fixed so one program serves
every step):

    (S_i, C_i) = grpo_token_loss(micro-batch i)           loss sum and loss-token count
    L          = Σ_i S_i / Σ_i C_i                         token mean over the whole mini-batch (or, with
                                                           AGG_KEYS, RAPO's mean of per-sequence means)
    ∇L         = (Σ_i ∇S_i) / Σ_i C_i                      exact: not a mean of per-micro-batch means
    θ'         = θ - lr · (adam(clip(∇L)) + wd · θ)        see optim.py

If L or any gradient entry is non-finite the update is skipped: params and optimizer state come
back unchanged (`metrics["skipped"] = 1`). params and optimizer state are donated.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.rl.loss import combine_micro_batches, grpo_token_loss

MICRO_KEYS = ("tokens", "attention_mask", "loss_mask", "behaviour_logp", "advantages", "is_probe")
AGG_KEYS = ("token_weight", "count_mask")  # optional (RAPO seq_mean aggregation, rl.rapo.seq_mean_weights)
PACKED_KEYS = ("tokens", "segment_ids", "positions", "loss_mask", "behaviour_logp", "advantages", "is_probe")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.001
    temperature: float = 1.0
    logprob_chunk: int | None = None  # None: full [M,T,V] logits; else chunked log-softmax over T


def policy_logprobs(params, tokens, attention_mask, cfg: Qwen2Config, temperature: float = 1.0,
                    chunk: int | None = None, segment_ids=None, positions=None) -> jax.Array:
    """log π(tokens[:, t] | tokens[:, :t]) [B, T] float32 (position 0 gets 0).

    Packed rows: segment_ids and positions (see packing.py); each segment's first token gets 0."""
    kw = {} if segment_ids is None else {"segment_ids": segment_ids, "positions": positions}
    if chunk:
        return qwen2.token_logprobs_chunked(params, tokens, cfg, attention_mask=attention_mask,
                                            temperature=temperature, chunk=chunk, **kw)
    return qwen2.token_logprobs(params, tokens, cfg, attention_mask=attention_mask, temperature=temperature, **kw)


def logprobs_and_entropy(params, tokens, attention_mask, cfg: Qwen2Config, temperature: float = 1.0,
                         chunk: int = 512, segment_ids=None, positions=None) -> tuple[jax.Array, jax.Array]:
    """(log π(token_t | <t), entropy H_t of the predictive distribution for position t), both [B, T].

    Forward-only (old-policy pass): logits are formed `chunk` positions at a time, so the [B, T, V]
    float32 tensor never exists. Position 0 (packed rows: each segment's first token) gets 0 for both.
    """
    B, T = tokens.shape
    kw = {} if segment_ids is None else {"segment_ids": segment_ids, "positions": positions}
    hidden, _ = qwen2.forward(params, tokens, cfg, attention_mask=attention_mask, return_hidden=True, **kw)
    n = T - 1
    c = max(1, min(int(chunk), n))
    pad = -n % c
    h = jnp.pad(hidden[:, :-1], ((0, 0), (0, pad), (0, 0))).reshape(B, -1, c, hidden.shape[-1]).swapaxes(0, 1)
    tg = jnp.pad(tokens[:, 1:], ((0, 0), (0, pad))).reshape(B, -1, c).swapaxes(0, 1)

    head = qwen2.vocab_parallel_head(params, cfg)

    def one(_, xs):
        hc, tc = xs
        logp = jax.nn.log_softmax(qwen2.head_logits(head, hc, cfg) / temperature, -1)
        return None, (qwen2.pick_vocab(logp, tc), -jnp.sum(jnp.exp(logp) * logp, axis=-1))

    _, (lp, ent) = jax.lax.scan(one, None, (h, tg))
    zeros = jnp.zeros((B, 1), jnp.float32)
    lp = jnp.concatenate([zeros, lp.swapaxes(0, 1).reshape(B, -1)[:, :n]], axis=1)
    ent = jnp.concatenate([zeros, ent.swapaxes(0, 1).reshape(B, -1)[:, :n]], axis=1)
    return qwen2.segment_starts_zeroed(lp, segment_ids), qwen2.segment_starts_zeroed(ent, segment_ids)


def micro_batch_loss(params, mb: dict, cfg: Qwen2Config, loss_cfg: LossConfig):
    """(loss_sum, (token_count, metrics)) of one micro-batch; `mb` holds MICRO_KEYS (+ "ref_logp"), or
    PACKED_KEYS (+ "ref_logp") for packed rows (advantages and is_probe per token). Optional AGG_KEYS
    ("token_weight" per row or token, "count_mask" per token) change the aggregation (grpo_token_loss):
    RAPO's per-sequence mean; the count accumulated below is then the number of sequences."""
    logp = policy_logprobs(params, mb["tokens"], mb.get("attention_mask"), cfg, loss_cfg.temperature,
                           loss_cfg.logprob_chunk, mb.get("segment_ids"), mb.get("positions"))
    ref = mb.get("ref_logp")
    loss_sum, count, metrics = grpo_token_loss(
        logp, mb["behaviour_logp"], ref, mb["advantages"], mb["loss_mask"], eps_low=loss_cfg.eps_low,
        eps_high=loss_cfg.eps_high, kl_coef=loss_cfg.kl_coef if ref is not None else 0.0,
        is_probe=mb["is_probe"], token_weight=mb.get("token_weight"), count_mask=mb.get("count_mask"))
    return loss_sum, (count, metrics)


def accumulate_gradients(params, micro_batches: dict, cfg: Qwen2Config, loss_cfg: LossConfig, poison=None):
    """Σ_i ∇S_i / Σ_i C_i over micro_batches (arrays with a leading micro-batch axis) via lax.scan.

    Returns (grads, loss, token_count, metrics). `poison` (bool scalar) multiplies every loss sum by
    NaN: a test hook that makes the loss and the gradients non-finite.
    """
    grad_fn = jax.value_and_grad(micro_batch_loss, has_aux=True)

    def body(carry, mb):
        g_acc, s_acc, c_acc = carry
        (s, (c, m)), g = grad_fn(params, mb, cfg, loss_cfg)
        if poison is not None:
            scale = jnp.where(poison, jnp.nan, 1.0)
            s, g = s * scale, jax.tree.map(lambda x: x * scale, g)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return (g_acc, s_acc + s, c_acc + c), (s, c, m)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    (g_sum, s_sum, c_sum), (s_i, c_i, m_i) = jax.lax.scan(body, init, micro_batches)
    denom = jnp.maximum(c_sum, 1).astype(jnp.float32)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
    n_micro = s_i.shape[0]
    _, metrics = combine_micro_batches([(s_i[k], c_i[k], jax.tree.map(lambda v: v[k], m_i))
                                        for k in range(n_micro)])
    return grads, s_sum / denom, c_sum, metrics


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def opt_state_shardings(optimizer: optax.GradientTransformation, opt_shapes, param_shardings, mesh):
    """Shardings of optimizer.init(params): every params-shaped leaf (Adam moments) takes its parameter's
    sharding, the rest (step counts) is replicated. `opt_shapes`: jax.eval_shape(optimizer.init, params)."""
    from jax.sharding import NamedSharding, PartitionSpec
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, param_shardings,
                                 transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()))


def make_update_fn(cfg: Qwen2Config, optimizer: optax.GradientTransformation, loss_cfg: LossConfig,
                   out_shardings=None) -> Callable:
    """jit(update)(params, opt_state, micro_batches, lr, poison) -> (params, opt_state, metrics).

    params and opt_state are donated. `out_shardings` = (param_shardings, opt_shardings) keeps them
    where they were under a mesh.
    """
    def update(params, opt_state, micro_batches, lr, poison):
        grads, loss, count, metrics = accumulate_gradients(params, micro_batches, cfg, loss_cfg, poison)
        finite = jnp.isfinite(loss) & _all_finite(grads)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: (p - lr * u.astype(jnp.float32)).astype(p.dtype), params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        metrics = dict(metrics, loss=loss, loss_tokens=count, grad_norm=grad_norm,
                       skipped=(~finite).astype(jnp.int32))
        return keep(new_params, params), keep(new_opt, opt_state), metrics

    kw = {}
    if out_shardings is not None:
        kw["out_shardings"] = (out_shardings[0], out_shardings[1], None)
    return jax.jit(update, donate_argnums=(0, 1), **kw)


def make_packed_update_fns(cfg: Qwen2Config, optimizer: optax.GradientTransformation, loss_cfg: LossConfig,
                           out_shardings=None) -> tuple[Callable, Callable]:
    """The update of one mini-batch of packed micro-batches, as two jitted programs looped on the host.

      acc = zero_acc(params)
      for mb in micro-batches:  acc, metrics_i = micro(params, acc, mb, poison)   (acc donated)
      params, opt_state, metrics = apply(params, opt_state, acc, lr)              (params, opt_state donated)

    acc = (Σ_i ∇S_i, Σ_i S_i, Σ_i C_i); apply divides by Σ_i C_i: the same exact token mean as
    `make_update_fn`, but the number of micro-batches is not a compiled shape (it follows the tokens of
    each mini-batch), so a run compiles `micro` once per packed shape [rows, P]. The per-micro-batch
    metrics merge on the host (combine_micro_batches with numpy).
    """
    grad_fn = jax.value_and_grad(micro_batch_loss, has_aux=True)

    def micro(params, acc, mb, poison):
        g_acc, s_acc, c_acc = acc
        (s, (c, m)), g = grad_fn(params, mb, cfg, loss_cfg)
        scale = jnp.where(poison, jnp.nan, 1.0)
        s, g = s * scale, jax.tree.map(lambda x: x * scale, g)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return (g_acc, s_acc + s, c_acc + c), (s, c, m)

    def apply(params, opt_state, acc, lr):
        g_sum, s_sum, c_sum = acc
        denom = jnp.maximum(c_sum, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
        loss = s_sum / denom
        finite = jnp.isfinite(loss) & _all_finite(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: (p - lr * u.astype(jnp.float32)).astype(p.dtype), params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        metrics = dict(loss=loss, loss_tokens=c_sum, grad_norm=optax.tree.norm(grads),
                       skipped=(~finite).astype(jnp.int32))
        return keep(new_params, params), keep(new_opt, opt_state), metrics

    kw = {}
    if out_shardings is not None:
        kw["out_shardings"] = (out_shardings[0], out_shardings[1], None)
    return jax.jit(micro, donate_argnums=(1,)), jax.jit(apply, donate_argnums=(0, 1), **kw)


def zero_acc(params):
    """The empty accumulator of `make_packed_update_fns` (float32 gradient sums, loss sum, count). zeros_like
    keeps each leaf's sharding: under an fsdp mesh the accumulator is sharded as the params, not replicated."""
    return (jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params), jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32))


def packed_update(micro_fn, apply_fn, params, opt_state, micro_batches, lr, poison, put=jnp.asarray):
    """Run one packed mini-batch update (see make_packed_update_fns); returns (params, opt_state, metrics)
    with the metrics of `make_update_fn` (device values; the split metrics merged on the host)."""
    import numpy as np
    acc = zero_acc(params)
    per_micro = []
    for mb in micro_batches:
        acc, out = micro_fn(params, acc, {k: put(v) for k, v in mb.items()}, poison)
        per_micro.append(out)
    params, opt_state, metrics = apply_fn(params, opt_state, acc, lr)
    per_micro = jax.device_get(per_micro)
    _, merged = combine_micro_batches([(s, c, m) for s, c, m in per_micro], xp=np)
    return params, opt_state, dict(merged, **metrics)


def make_logprob_fn(cfg: Qwen2Config, temperature: float = 1.0, chunk: int = 512, with_entropy: bool = True):
    """jit((params, tokens, attention_mask[, segment_ids, positions]) -> (logp, entropy or None)) for the
    old/ref passes (packed rows: attention_mask is None, segment_ids and positions given)."""
    def fn(params, tokens, attention_mask, segment_ids=None, positions=None):
        if with_entropy:
            return logprobs_and_entropy(params, tokens, attention_mask, cfg, temperature, chunk, segment_ids,
                                        positions)
        return policy_logprobs(params, tokens, attention_mask, cfg, temperature, chunk, segment_ids, positions), None
    return jax.jit(fn)
