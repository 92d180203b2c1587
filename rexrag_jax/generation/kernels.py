"""Jitted device kernels of the generation engine (pure functions over the KV cache).

The cache lives on device as k, v [L, B, S, KV, Hd] plus last_logits [B, V] (each row's next-token
logits). Row lengths are host-owned and passed in as int32 [B]. Every kernel donates k, v and
last_logits, so XLA updates the cache in place. `window` (static) bounds the slots a kernel attends
over: only k[:, :, :window] is read and written, so decode cost follows the live context, not S.
`mesh` is static only so that traces with and without sharding constraints never share a cache entry.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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


def _row_axes(x, mesh, logical_axes=qwen2.CACHE_LOGICAL_AXES, row_dim=1):
    """(PartitionSpec of x on mesh, the mesh axes its row dim is split over); a KV cache by default."""
    from rexrag_jax.sharding.rules import spec_for_shape
    spec = spec_for_shape(logical_axes, x.shape, mesh, name="rows")
    rows = spec[row_dim]
    return spec, (() if rows is None else (rows,) if isinstance(rows, str) else tuple(rows))


def gather_rows(x, idx, mesh, w=None):
    """x[:, idx, :w] for a cache x [L, B, S, ...] whose rows are split over the mesh.

    A plain gather with replicated indices on a row-sharded operand makes the SPMD partitioner
    all-gather the whole cache on every device first. Here every device takes the requested rows it
    holds (the others masked to 0) and a reduce-scatter sums the [L, nb, ...] partial results, so
    only the subset crosses devices, and it comes back split by rows (replicated when nb does not
    divide). Without a mesh, or with unsplit rows, it is x[:, idx, :w]."""
    w = x.shape[2] if w is None else w
    if mesh is None:
        return x[:, idx, :w]
    spec, axes = _row_axes(x, mesh)
    if not axes:
        return x[:, idx, :w]
    n = math.prod(mesh.shape[a] for a in axes)
    scatter = idx.shape[0] % n == 0
    out_spec = P(spec[0], axes if scatter else None, *spec[2:])

    def local(xl, idx):
        b = xl.shape[1]
        pos = idx - jax.lax.axis_index(axes) * b
        mine = (pos >= 0) & (pos < b)
        rows = jnp.take(xl, jnp.where(mine, pos, 0), axis=1)[:, :, :w]
        rows = jnp.where(mine.reshape((1, -1) + (1,) * (xl.ndim - 2)), rows, jnp.zeros((), xl.dtype))
        if scatter:
            return jax.lax.psum_scatter(rows, axes, scatter_dimension=1, tiled=True)
        return jax.lax.psum(rows, axes)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=out_spec, check_vma=False)(x, idx)


def scatter_rows(x, idx, rows, mesh):
    """x.at[:, idx, :w].set(rows), w = rows.shape[2], for a row-split cache x (see gather_rows): the rows are
    gathered to every device (the subset, not the cache) and each device writes the ones it holds, in
    place. idx must be distinct (the engine's row lists are)."""
    w = rows.shape[2]
    if mesh is None:
        return x.at[:, idx, :w].set(rows)
    spec, axes = _row_axes(x, mesh)
    if not axes:
        return x.at[:, idx, :w].set(rows)
    n = math.prod(mesh.shape[a] for a in axes)
    scattered = idx.shape[0] % n == 0
    rows_spec = P(spec[0], axes if scattered else None, *spec[2:])

    def local(xl, idx, rl):
        b = xl.shape[1]
        full = jax.lax.all_gather(rl, axes, axis=1, tiled=True) if scattered else rl
        pos = idx - jax.lax.axis_index(axes) * b
        mine = (pos >= 0) & (pos < b)
        return xl.at[:, jnp.where(mine, pos, b), :w].set(full, mode="drop")

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), rows_spec), out_specs=spec,
                         check_vma=False)(x, idx, rows)


def _local_rows(x, idx, mesh, spec, axes, row_dim, w, rows=None):
    """Owner-laid-out rows (idx split like x's rows: shard d of idx names rows that device d holds, see
    GenerationEngine._owner_layout): gather (rows None) or write back, each device on its own rows,
    no collective. w slices the slot dim (dim 2 of a cache) when given."""
    idx_spec = P(axes)
    part = P(*[axes if i == row_dim else spec[i] for i in range(len(spec))])

    def pos_of(xl, il):
        return il - jax.lax.axis_index(axes) * xl.shape[row_dim]

    if rows is None:
        def take(xl, il):
            got = jnp.take(xl, pos_of(xl, il), axis=row_dim)
            return got if w is None else got[:, :, :w]
        return jax.shard_map(take, mesh=mesh, in_specs=(spec, idx_spec), out_specs=part, check_vma=False)(x, idx)

    def put(xl, il, rl):
        pos = pos_of(xl, il)
        return xl.at[pos].set(rl) if row_dim == 0 else xl.at[:, pos, :w].set(rl)
    return jax.shard_map(put, mesh=mesh, in_specs=(spec, idx_spec, part), out_specs=spec, check_vma=False)(x, idx, rows)


def gather_owned_rows(x, idx, mesh, logical_axes, row_dim=1, w=None):
    """x[:, idx, :w] (row_dim 1, a cache) or x[idx] (row_dim 0) for owner-laid-out idx (see _local_rows)."""
    spec, axes = _row_axes(x, mesh, logical_axes, row_dim)
    return _local_rows(x, idx, mesh, spec, axes, row_dim, w)


def scatter_owned_rows(x, idx, rows, mesh, logical_axes, row_dim=1):
    """The inverse of gather_owned_rows, in place (x donated): each device writes the rows it holds."""
    spec, axes = _row_axes(x, mesh, logical_axes, row_dim)
    return _local_rows(x, idx, mesh, spec, axes, row_dim, rows.shape[2] if row_dim == 1 else None, rows)


def mask_vocab(logits, vocab_limit):
    """Ids >= vocab_limit (embedding rows the tokenizer has no token for) get -inf logits."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, jnp.finfo(logits.dtype).min)


@functools.partial(jax.jit, static_argnames=("cfg", "window", "mesh", "vocab_limit", "all_rows", "owned_rows"),
                   donate_argnums=(1, 2, 4))
def prefill(params, k, v, lengths, last_logits, idx, tokens, num_new, *, cfg, window, mesh=None,
            vocab_limit=None, all_rows=False, owned_rows=False):
    """Append tokens [nb, T] to rows idx [nb] (row idx[i] takes its first num_new[i] tokens).

    Rows with num_new = 0 are untouched below their length (padded writes land beyond it). The
    logits after each row's last real token replace last_logits[row]; rows with num_new = 0 keep theirs.
    all_rows=True: tokens/num_new have one row per cache row, in row order, and idx is ignored; no rows are
    gathered or scattered, so on a batch-sharded mesh every device works on its own rows only (with
    gathered rows, replicated indices on a batch-sharded cache make the partitioner all-gather the WHOLE
    k and v on every device: 439 GiB of temporaries at Qwen2.5-0.5B, 2560 rows, fsdp=8).
    owned_rows=True (a mesh whose data x fsdp split the rows): idx is laid out by owner, shard d of idx
    naming only rows that device d holds (GenerationEngine._owner_layout), so every device gathers,
    computes and writes back its own rows and no cache row crosses devices. Otherwise a subset goes
    through gather_rows / scatter_rows (only the subset crosses devices).
    Returns (k, v, last_logits).
    """
    with _mesh_ctx(mesh):
        # only the nb rows' windows are gathered and scattered back (in place, k/v are donated), not the
        # window of all B rows: copying [L,B,window,...] twice cost ~6x the whole 16-token append at 1.5k slots
        w = min(window, k.shape[2])
        if all_rows:
            sub = {"k": k[:, :, :w], "v": v[:, :, :w], "lengths": lengths}
        elif owned_rows:
            cax = qwen2.CACHE_LOGICAL_AXES
            sub = {"k": gather_owned_rows(k, idx, mesh, cax, 1, w), "v": gather_owned_rows(v, idx, mesh, cax, 1, w),
                   "lengths": lengths[idx]}
        else:  # the subset only, not the whole cache, crosses devices (gather_rows / scatter_rows)
            sub = {"k": gather_rows(k, idx, mesh, w), "v": gather_rows(v, idx, mesh, w), "lengths": lengths[idx]}
        hidden, sub = qwen2.forward(params, tokens, cfg, cache=sub, num_new=num_new, return_hidden=True)
        last = jnp.maximum(num_new - 1, 0)
        h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [nb, 1, D]
        logits = mask_vocab(logits_from_hidden(params, h_last, cfg)[:, 0], vocab_limit)
        if all_rows:
            new_rows = jnp.where((num_new > 0)[:, None], logits, last_logits)
            if w == k.shape[2]:
                return sub["k"], sub["v"], new_rows
            return k.at[:, :, :w].set(sub["k"]), v.at[:, :, :w].set(sub["v"]), new_rows
        if owned_rows:
            lax_ = ("batch", None)
            old_rows = gather_owned_rows(last_logits, idx, mesh, lax_, 0)
            new_rows = jnp.where((num_new > 0)[:, None], logits, old_rows)
            cax = qwen2.CACHE_LOGICAL_AXES
            return (scatter_owned_rows(k, idx, sub["k"], mesh, cax), scatter_owned_rows(v, idx, sub["v"], mesh, cax),
                    scatter_owned_rows(last_logits, idx, new_rows, mesh, lax_, 0))
        new_rows = jnp.where((num_new > 0)[:, None], logits, last_logits[idx])
        return (scatter_rows(k, idx, sub["k"], mesh), scatter_rows(v, idx, sub["v"], mesh),
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
