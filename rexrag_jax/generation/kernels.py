"""Jitted device kernels of the generation engine (pure functions over the KV cache).

The cache lives on device as k, v [L, B, S, KV, Hd] plus last_logits [B, V] (each row's next-token
logits). Row lengths are host-owned and passed in as int32 [B]. Every kernel donates k, v and
last_logits, so XLA updates the cache in place. `window` (static) bounds the slots a kernel attends
over: only k[:, :, :window] is read and written, so decode cost follows the live context, not S.
`mesh` is static only so that traces with and without sharding constraints never share a cache entry.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rexrag_jax.generation.sampling import sample_tokens
from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.model import logits_from_hidden
from rexrag_jax.sharding.rules import use_mesh

RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3


def _mesh_ctx(mesh):
    return use_mesh(mesh) if mesh is not None else _nullctx()


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def mask_vocab(logits, vocab_limit):
    """Ids >= vocab_limit (embedding rows the tokenizer has no token for) get -inf logits."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, jnp.finfo(logits.dtype).min)


@functools.partial(jax.jit, static_argnames=("cfg", "window", "mesh", "vocab_limit", "all_rows"),
                   donate_argnums=(1, 2, 4))
def prefill(params, k, v, lengths, last_logits, idx, tokens, num_new, *, cfg, window, mesh=None,
            vocab_limit=None, all_rows=False):
    """Append tokens [nb, T] to rows idx [nb] (row idx[i] takes its first num_new[i] tokens).

    Rows with num_new = 0 are untouched below their length (padded writes land beyond it). The
    logits after each row's last real token replace last_logits[row]; rows with num_new = 0 keep theirs.
    all_rows=True: tokens/num_new have one row per cache row, in row order, and idx is ignored; no rows are
    gathered or scattered, so on a batch-sharded mesh every device works on its own rows only (with
    gathered rows, replicated indices on a batch-sharded cache make the partitioner all-gather the WHOLE
    k and v on every device: 439 GiB of temporaries at Qwen2.5-0.5B, 2560 rows, fsdp=8).
    Returns (k, v, last_logits).
    """
    with _mesh_ctx(mesh):
        # only the nb rows' windows are gathered and scattered back (in place, k/v are donated), not the
        # window of all B rows: copying [L,B,window,...] twice cost ~6x the whole 16-token append at 1.5k slots
        w = min(window, k.shape[2])
        if all_rows:
            sub = {"k": k[:, :, :w], "v": v[:, :, :w], "lengths": lengths}
        else:
            sub = {"k": k[:, idx, :w], "v": v[:, idx, :w], "lengths": lengths[idx]}
        hidden, sub = qwen2.forward(params, tokens, cfg, cache=sub, num_new=num_new, return_hidden=True)
        last = jnp.maximum(num_new - 1, 0)
        h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [nb, 1, D]
        logits = mask_vocab(logits_from_hidden(params, h_last, cfg)[:, 0], vocab_limit)
        if all_rows:
            new_rows = jnp.where((num_new > 0)[:, None], logits, last_logits)
            if w == k.shape[2]:
                return sub["k"], sub["v"], new_rows
            return k.at[:, :, :w].set(sub["k"]), v.at[:, :, :w].set(sub["v"]), new_rows
        new_rows = jnp.where((num_new > 0)[:, None], logits, last_logits[idx])
        return (k.at[:, idx, :w].set(sub["k"]), v.at[:, idx, :w].set(sub["v"]),
                last_logits.at[idx].set(new_rows))


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "window", "stop_seqs", "eos_ids", "use_top_p",
                                             "greedy", "pad_id", "mesh", "vocab_limit"), donate_argnums=(1, 2, 4))
def decode_chunk(params, k, v, lengths, last_logits, active, remaining, recent, rng, temperature, top_p,
                 *, greedy, cfg, steps, window, stop_seqs, eos_ids, use_top_p, pad_id, mesh=None, vocab_limit=None):
    """Up to `steps` decode steps in one lax.while_loop (exits early once no row is active).

    Each step, for every active row: sample tok from last_logits, feed tok through the model (cache
    slot lengths[b]), set last_logits to the logits after tok, then deactivate the row if tok is an
    EOS id (status EOS), the last generated tokens (`recent`, right-aligned, -1 = none) end with a
    stop sequence (STOP), or its budget `remaining` reaches 0 (LENGTH). Sampled tokens are always kept
    in the cache, so last_logits stays consistent with the row length.

    Returns (k, v, last_logits, out_tok [B, steps], out_logprob, out_sampling_logprob, status [B],
    count [B]); row b produced the first count[b] columns.
    """
    B = lengths.shape[0]
    eos = jnp.asarray(eos_ids if eos_ids else (-2,), jnp.int32)
    with _mesh_ctx(mesh):
        zeros_f = jnp.zeros((B, steps), jnp.float32)
        init = (jnp.int32(0), k, v, lengths, last_logits, active, remaining,
                recent, jnp.full((B, steps), pad_id, jnp.int32), zeros_f, zeros_f,
                jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))

        def cond(c):
            return (c[0] < steps) & jnp.any(c[5])

        def body(c):
            i, kw, vw, lens, logits, act, rem, rec, o_tok, o_lp, o_slp, status, count = c
            tok, lp, slp = sample_tokens(logits, jax.random.fold_in(rng, i), temperature, top_p, greedy,
                                         use_top_p)
            tok = jnp.where(act, tok, pad_id)
            o_tok = o_tok.at[:, i].set(tok)
            o_lp = o_lp.at[:, i].set(lp)
            o_slp = o_slp.at[:, i].set(slp)
            step = act.astype(jnp.int32)
            new_logits, cache = qwen2.forward(params, tok[:, None], cfg, num_new=step, window=window,
                                              cache={"k": kw, "v": vw, "lengths": lens})
            logits = jnp.where(act[:, None], mask_vocab(new_logits[:, 0], vocab_limit), logits)
            rec = jnp.where(act[:, None], jnp.concatenate([rec[:, 1:], tok[:, None]], axis=1), rec)
            is_stop = jnp.zeros((B,), bool)
            for seq in stop_seqs:
                is_stop |= jnp.all(rec[:, rec.shape[1] - len(seq):] == jnp.asarray(seq, jnp.int32), axis=1)
            is_eos = jnp.any(tok[:, None] == eos[None, :], axis=1)
            rem = rem - step
            new_status = jnp.where(is_stop, STOP, jnp.where(is_eos, EOS, jnp.where(rem <= 0, LENGTH, RUNNING)))
            status = jnp.where(act, new_status, status)
            return (i + 1, cache["k"], cache["v"], cache["lengths"], logits, act & (new_status == RUNNING), rem,
                    rec, o_tok, o_lp, o_slp, status, count + step)

        out = jax.lax.while_loop(cond, body, init)
        _, kw, vw, _, logits, _, _, _, o_tok, o_lp, o_slp, status, count = out
        return kw, vw, logits, o_tok, o_lp, o_slp, status, count


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def copy_row(k, v, last_logits, src, dst):
    """Row dst := row src (all slots and its last logits); the host then sets dst's length."""
    return k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src]), last_logits.at[dst].set(last_logits[src])
