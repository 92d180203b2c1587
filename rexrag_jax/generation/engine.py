"""GenerationEngine: a fixed set of independent KV-cache rows with chunked prefill and jitted decode.

Each of `batch_size` rows is a slot holding one sequence (slot index == RoPE position, no left
padding). The host owns per-row lengths and token histories; the device owns the KV cache and each
row's next-token logits. Shapes are bucketed (powers of two for prefill chunk and sub-batch, 2^j or
3*2^j for the attention window) so a run compiles a handful of programs, whatever the prompt lengths.

Invariant: when `_has_logits[r]`, device `last_logits[r]` are the logits after the row's last token.
`truncate` and `copy_prefix` may break it; the row is then marked stale and the next `append` /
`generate` recomputes its logits by re-feeding its last cached token (one token, no full re-prefill).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rexrag_jax.generation import kernels
from rexrag_jax.generation.stops import find_stop_cut
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import CACHE_LOGICAL_AXES, unstack_layers
from rexrag_jax.shapes import covers
from rexrag_jax.sharding.rules import logical_to_spec

_REASONS = {kernels.EOS: "eos", kernels.STOP: "stop", kernels.LENGTH: "length"}


@dataclasses.dataclass
class GenOut:
    """One row's generation.

    tokens: generated ids (an EOS token is included; cut right after the token completing a stop string).
    logprobs: log pi(token) under the raw model (temperature 1, no top-p): what RL needs.
    stop_reason: "stop" (stop string), "eos", or "length" (max_new_tokens reached).
    text: detokenize(tokens), cut right after the first complete stop string.
    sampling_logprobs: log q(token) under the distribution actually sampled (temperature, top-p);
        0.0 for greedy.
    """
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    text: str
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)


def _dev(host: np.ndarray) -> jax.Array:
    """Copy a host array that we mutate later: on CPU jnp.asarray may alias numpy memory while the
    asynchronously dispatched kernel has not read it yet."""
    return jnp.asarray(np.array(host, copy=True))


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def _window_at_least(n: int, lo: int) -> int:
    """Smallest attention window >= max(n, lo) of the form 2^j or 3 * 2^j (..., 64, 96, 128, 192, 256, ...).

    Decode attention reads every slot of the window (memory-bound on CPU), so the window should track
    the live length closely: the 1.5x steps cut the worst overshoot from 2x to 1.5x for twice the
    (still logarithmic) number of compiled programs.
    """
    n = max(int(n), int(lo), 1)
    p = 1 << (n - 1).bit_length()  # smallest power of two >= n
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


# a prefill may run an already-compiled larger program (GenerationEngine._prefill_shape) that costs at most
# REUSE_COST x the exact bucket's rows x tokens and reads at most REUSE_WINDOW x its attention window
REUSE_COST = 4
REUSE_WINDOW = 2

_unstack_jit = jax.jit(unstack_layers, static_argnames=("transpose",))
DECODE_LAYOUTS = ("stacked", "layers", "out_in")
OUT_IN_MIN_ELEMENTS = 1 << 20  # an MLP matrix this large (4 MB in f32) streams from memory at decode


class GenerationEngine:
    def __init__(self, params, cfg: Qwen2Config, batch_size: int, max_len: int, pad_id: int = 0,
                 eos_ids: Sequence[int] = (), stop_strings: Sequence[str] = ("</search>", "</answer>"),
                 detokenize: Callable[[list[int]], str] | None = None, decode_chunk: int = 16, mesh=None,
                 stop_token_seqs: Sequence[Sequence[int]] = (), prefill_chunk: int = 512,
                 min_window: int = 64, vocab_limit: int | None = None, stop_blocks: bool = True,
                 decode_layout: str | None = None):
        """stop_token_seqs: optional token spellings of the stop strings for in-jit early stop (see
        stops.stop_token_sequences); the host check on detokenized text runs regardless when
        `detokenize` is given. stop_blocks (needs `detokenize`): a closing-tag stop string `</X>` ends the
        row only where it closes a complete `<X>…</X>` block (the first complete action block; a stray
        `</answer>` does not stop it: a device-side stop there is not confirmed and the row decodes on).
        prefill_chunk: largest append chunk (power of two). vocab_limit: the
        tokenizer's vocabulary size; ids at or above it (padding rows of the embedding, e.g. Qwen2.5's
        151,936 rows vs 151,665 tokens) are never sampled and log-probs are renormalised over the rest.
        decode_layout: the weights decode reads. "stacked": the params as given (the layer loop slices
        each layer out of the stacked weights, which XLA CPU materialises as a copy of every weight matrix
        per decode step); "layers": a per-layer copy (model.unstack_layers, refreshed on every `params`
        update; one extra copy of the layer weights in memory); "out_in": per-layer and stored [out, in]
        (the faster matmul layout for decode on CPU at real model sizes). Default (None), on CPU without
        a mesh: "out_in" when hidden_size * intermediate_size >= OUT_IN_MIN_ELEMENTS (Qwen2.5-0.5B: 1.14x
        vs "layers", 1.37x vs "stacked" per decode step), else "layers" (the `small` preset: "out_in" was
        0.88x of "layers"); "stacked" otherwise. Prefill always reads the stacked params."""
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"GenerationEngine: batch_size and max_len must be positive, got "
                             f"{batch_size}, {max_len}")
        if decode_chunk <= 0 or prefill_chunk <= 0 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"GenerationEngine: decode_chunk must be > 0 and prefill_chunk a power of two, "
                             f"got {decode_chunk}, {prefill_chunk}")
        self.cfg = cfg
        if vocab_limit is not None and not 0 < int(vocab_limit) <= cfg.vocab_size:
            raise ValueError(f"GenerationEngine: vocab_limit must be in (0, {cfg.vocab_size}], got {vocab_limit}")
        self.vocab_limit = None if vocab_limit is None or int(vocab_limit) == cfg.vocab_size else int(vocab_limit)
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        self.pad_id = int(pad_id)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.stop_strings = tuple(stop_strings)
        self.stop_blocks = bool(stop_blocks)
        self.detokenize = detokenize
        self.decode_chunk, self.prefill_chunk, self.min_window = int(decode_chunk), int(prefill_chunk), int(min_window)
        self.stop_token_seqs = tuple(tuple(int(t) for t in s) for s in stop_token_seqs if len(s))
        self._recent_width = max([len(s) for s in self.stop_token_seqs] + [1])
        self.mesh = mesh
        self._dp = 1
        if mesh is not None:
            self._dp = int(np.prod([mesh.shape.get(a, 1) for a in ("data", "fsdp")]))
            if self.batch_size % self._dp:
                raise ValueError(f"GenerationEngine: batch_size {batch_size} must be a multiple of the mesh's "
                                 f"data*fsdp size {self._dp}")
        if decode_layout is None:
            decode_layout = "stacked"
            if mesh is None and jax.default_backend() == "cpu":  # [out, in] pays off once matmuls stream weights
                decode_layout = "out_in" if cfg.hidden_size * cfg.intermediate_size >= OUT_IN_MIN_ELEMENTS else "layers"
        if decode_layout not in DECODE_LAYOUTS:
            raise ValueError(f"GenerationEngine: decode_layout must be one of {DECODE_LAYOUTS}, got {decode_layout!r}")
        self.decode_layout = decode_layout
        self._params = params
        self._decode_params = self._decode_layout(params)
        self._compiled_prefill: set[tuple[int, int, int]] = set()  # (rows, tokens, window) run so far
        self._lengths = np.zeros(self.batch_size, np.int32)
        self._tokens = np.zeros((self.batch_size, self.max_len), np.int32)
        self._has_logits = np.zeros(self.batch_size, bool)
        shape = (cfg.num_layers, self.batch_size, self.max_len, cfg.num_kv_heads, cfg.head_dim)
        self._k = self._place(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_LOGICAL_AXES)
        self._v = self._place(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_LOGICAL_AXES)
        self._last_logits = self._place(jnp.zeros((self.batch_size, cfg.vocab_size), jnp.float32),
                                        ("batch", None))

    # --- state ---------------------------------------------------------------------------------
    def _place(self, x, logical_axes):
        if self.mesh is None:
            return x
        spec = logical_to_spec(logical_axes, mesh=self.mesh)
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

    def _decode_layout(self, params):
        if self.decode_layout == "stacked":
            return params
        return _unstack_jit(params, transpose=self.decode_layout == "out_in")

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, new_params):
        """New weights (same shapes/dtypes: no recompile). Cached K/V and logits were computed with the
        old weights; callers normally reset() before the next rollout."""
        old = jax.tree_util.tree_structure(self._params)
        if jax.tree_util.tree_structure(new_params) != old:
            raise ValueError("GenerationEngine.params: new params have a different tree structure")
        self._params = new_params
        self._decode_params = self._decode_layout(new_params)

    def block_until_ready(self) -> None:
        """Wait for queued device work (for timing; the engine itself never needs it)."""
        jax.block_until_ready((self._k, self._v, self._last_logits))

    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def row_tokens(self, row: int) -> list[int]:
        """The tokens currently cached in `row` (slots 0 .. length-1)."""
        self._check_row(row)
        return self._tokens[row, : self._lengths[row]].tolist()

    def reset(self, rows: Sequence[int] | None = None) -> None:
        rows = range(self.batch_size) if rows is None else [self._check_row(r) for r in rows]
        for r in rows:
            self._lengths[r] = 0
            self._has_logits[r] = False

    def truncate(self, row: int, length: int) -> None:
        """Keep the first `length` cached tokens of `row`."""
        self._check_row(row)
        if not 0 <= length <= self._lengths[row]:
            raise ValueError(f"truncate: row {row} has {self._lengths[row]} tokens; cannot truncate to {length}")
        if length < self._lengths[row]:
            self._lengths[row] = length
            self._has_logits[row] = False

    def copy_prefix(self, src_row: int, dst_row: int, length: int) -> None:
        """dst's cache := src's first `length` slots (no recompute of the prefix).

        dst's next-token logits are src's when length == src's length, otherwise they are recomputed
        lazily from the cached token at slot length-1 on the next append/generate.
        """
        self._check_row(src_row), self._check_row(dst_row)
        if not 0 <= length <= self._lengths[src_row]:
            raise ValueError(f"copy_prefix: src row {src_row} has {self._lengths[src_row]} tokens; "
                             f"cannot copy {length}")
        if src_row == dst_row:
            return self.truncate(src_row, length)
        self._k, self._v, self._last_logits = kernels.copy_row(self._k, self._v, self._last_logits,
                                                               jnp.int32(src_row), jnp.int32(dst_row))
        self._tokens[dst_row, :length] = self._tokens[src_row, :length]
        self._has_logits[dst_row] = bool(self._has_logits[src_row]) and length == self._lengths[src_row]
        self._lengths[dst_row] = length

    def _check_row(self, row) -> int:
        if not isinstance(row, (int, np.integer)) or not 0 <= row < self.batch_size:
            raise ValueError(f"row {row!r} out of range: expected an int in [0, {self.batch_size})")
        return int(row)

    def _check_rows(self, rows, what) -> list[int]:
        rows = [self._check_row(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"{what}: rows must be distinct, got {rows}")
        return rows

    # --- prefill -------------------------------------------------------------------------------
    def append(self, rows: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None:
        """Chunked prefill of token_lists[i] into rows[i]; other rows are untouched.

        Each row's logits after its last new token are kept for the next generate. Raises ValueError
        (nothing written) if a row would exceed max_len or a token id is out of the vocabulary.
        """
        rows = self._check_rows(rows, "append")
        if len(rows) != len(token_lists):
            raise ValueError(f"append: {len(rows)} rows but {len(token_lists)} token lists")
        pending: dict[int, list[int]] = {}
        for r, toks in zip(rows, token_lists):
            toks = [int(t) for t in toks]
            if toks and not all(0 <= t < self.cfg.vocab_size for t in toks):
                bad = next(t for t in toks if not 0 <= t < self.cfg.vocab_size)
                raise ValueError(f"append: row {r} has token id {bad} outside [0, {self.cfg.vocab_size})")
            if self._lengths[r] + len(toks) > self.max_len:
                raise ValueError(f"append: row {r} would hold {self._lengths[r] + len(toks)} tokens "
                                 f"({self._lengths[r]} cached + {len(toks)} new) > max_len {self.max_len}")
            if toks:
                pending[r] = toks
        self._prefill(pending)

    def _refresh(self, rows: Sequence[int]) -> None:
        """Recompute stale next-token logits of rows (cheap: re-feed each row's last cached token)."""
        self._prefill({r: [] for r in rows if not self._has_logits[r] and self._lengths[r] > 0})

    def _prefill(self, pending: dict[int, list[int]]) -> None:
        for r in list(pending):  # stale rows re-feed their last cached token in front of the new ones
            if not self._has_logits[r] and self._lengths[r] > 0:
                self._lengths[r] -= 1
                pending[r] = [int(self._tokens[r, self._lengths[r]])] + pending[r]
        pending = {r: t for r, t in pending.items() if t}
        for r, toks in pending.items():
            self._tokens[r, self._lengths[r]: self._lengths[r] + len(toks)] = toks
        offset = 0
        while pending:
            rows = sorted(pending)
            left = max(len(pending[r]) - offset for r in rows)
            T = min(_pow2_at_least(left, 16), self.prefill_chunk)
            owned = self._dp > 1  # rows grouped by the device holding them: no cache row crosses devices
            nb, T, idx, window = self._prefill_shape(rows, pending, T, owned)
            all_rows = nb == self.batch_size  # every row in row order: no gather/scatter of cache rows
            if all_rows:
                idx = list(range(self.batch_size))
            self._compiled_prefill.add((nb, T, window))
            slot = {r: i for i, r in enumerate(idx)}
            tokens = np.full((nb, T), self.pad_id, np.int32)
            num_new = np.zeros(nb, np.int32)
            for r in rows:
                chunk = pending[r][offset: offset + T]
                tokens[slot[r], : len(chunk)] = chunk
                num_new[slot[r]] = len(chunk)
            self._k, self._v, self._last_logits = kernels.prefill(
                self._params, self._k, self._v, _dev(self._lengths), self._last_logits,
                jnp.asarray(np.array(idx, np.int32)), jnp.asarray(tokens), jnp.asarray(num_new),
                cfg=self.cfg, window=window, mesh=self.mesh, vocab_limit=self.vocab_limit, all_rows=all_rows,
                owned_rows=owned and not all_rows)
            for r in rows:
                self._lengths[r] += num_new[slot[r]]
                self._has_logits[r] = True
            offset += T
            pending = {r: t for r, t in pending.items() if len(t) > offset}

    def _prefill_idx(self, rows, pending, nb: int, owned: bool) -> list[int]:
        if owned:
            return self._owner_layout(rows, pending, per_device=nb // self._dp)
        return rows + [r for r in range(self.batch_size) if r not in pending][: nb - len(rows)]

    def _prefill_window(self, idx, T: int) -> int:
        return min(_window_at_least(int(self._lengths[idx].max()) + T, self.min_window), self.max_len)

    def _prefill_shape(self, rows, pending, T: int, owned: bool):
        """(nb, T, idx, window) of the next prefill chunk. The exact shape is the smallest bucket; but
        when a program already compiled for a larger shape costs at most REUSE_COST x the exact one in
        rows x tokens (and at most REUSE_WINDOW x its window), that program runs instead, padded with idle
        rows and pad tokens: a rollout's rare (rows, tokens, window) combinations stop costing a compile
        each (2 new prefill shapes were among the 8 compilations after step 3 on a replication warm start;
        benchmarks/compile_trace.py, docs/benchmarks/train.md).
        Results are the same rows, lengths and logits: idle rows take no tokens, pad tokens land beyond
        each row's length and are overwritten later, extra window slots are masked."""
        if owned:
            idx = self._owner_layout(rows, pending)
        else:
            idx = self._prefill_idx(rows, pending, min(_pow2_at_least(len(rows), 1), self.batch_size), owned)
        nb = len(idx)
        window = self._prefill_window(idx, T)
        if (nb, T, window) in self._compiled_prefill:
            return nb, T, idx, window
        for nb2, T2, w2 in covers(self._compiled_prefill, (nb, T, window), REUSE_COST, cost=lambda k: k[0] * k[1],
                                  accept=lambda k: k[2] <= REUSE_WINDOW * window):
            idx2 = self._prefill_idx(rows, pending, nb2, owned)
            if int(self._lengths[idx2].max()) + T2 <= w2:  # the padded chunk fits the window
                return nb2, T2, idx2, w2
        return nb, T, idx, window

    def _owner_layout(self, rows: Sequence[int], pending, per_device: int | None = None) -> list[int]:
        """Rows to append to, grouped by the device holding them (the cache splits its rows in data x fsdp
        blocks of b): each device's group is padded to the same power-of-two size m with rows of its own
        block that take no tokens (num_new 0, distinct), so shard d of the index array names device d's
        rows only (kernels.prefill(owned_rows=True)). Unbalanced groups cost padding, never traffic."""
        n = self._dp
        b = self.batch_size // n
        groups = [[] for _ in range(n)]
        for r in rows:
            groups[r // b].append(r)
        m = min(_pow2_at_least(max(len(g) for g in groups), 1), b) if per_device is None else int(per_device)
        idx = []
        for d, g in enumerate(groups):
            idx += g + [r for r in range(d * b, (d + 1) * b) if r not in pending][: m - len(g)]
        return idx

    # --- decode --------------------------------------------------------------------------------
    def generate(self, rows: Sequence[int], max_new_tokens: int, rng: jax.Array, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False) -> list[GenOut]:
        """Generate up to max_new_tokens for each of rows (one GenOut per row, in order).

        A row stops at an EOS id, at the token completing the first stop string (with stop_blocks: the
        first one closing a complete `<X>…</X>` block) (confirmed on the
        host on detokenized text; the cache is rolled back to that token), or after max_new_tokens.
        temperature <= 0 means greedy. Raises ValueError if a row is empty or could exceed max_len.
        """
        rows = self._check_rows(rows, "generate")
        for r in rows:
            if self._lengths[r] == 0:
                raise ValueError(f"generate: row {r} is empty; append a prompt first")
            if self._lengths[r] + max_new_tokens > self.max_len:
                raise ValueError(f"generate: row {r} holds {self._lengths[r]} tokens; + max_new_tokens "
                                 f"{max_new_tokens} exceeds max_len {self.max_len}")
        if max_new_tokens <= 0 or not rows:
            return [GenOut([], [], "length", "") for _ in rows]
        self._refresh(rows)
        greedy = bool(greedy) or temperature <= 0
        use_top_p = (not greedy) and top_p < 1.0
        B, W = self.batch_size, self._recent_width
        active = np.zeros(B, bool)
        active[rows] = True
        remaining = np.zeros(B, np.int32)
        remaining[rows] = max_new_tokens
        gen = {r: ([], [], []) for r in rows}  # tokens, logprobs, sampling logprobs
        reason: dict[int, str] = {}
        texts: dict[int, str] = {}
        chunk_i = 0
        while active.any():
            recent = np.full((B, W), -1, np.int32)
            for r in np.flatnonzero(active):
                tail = gen[r][0][-W:]
                if tail:
                    recent[r, W - len(tail):] = tail
            live = np.flatnonzero(active)
            window = min(_window_at_least(int(self._lengths[live].max()) + self.decode_chunk, self.min_window),
                         self.max_len)
            out = kernels.decode_chunk(
                self._decode_params, self._k, self._v, _dev(self._lengths), self._last_logits,
                _dev(active), _dev(remaining), jnp.asarray(recent),
                jax.random.fold_in(rng, chunk_i), jnp.float32(temperature), jnp.float32(top_p),
                greedy=greedy, cfg=self.cfg, steps=self.decode_chunk, window=window,
                stop_seqs=self.stop_token_seqs, eos_ids=self.eos_ids, use_top_p=use_top_p,
                pad_id=self.pad_id, mesh=self.mesh, vocab_limit=self.vocab_limit)
            self._k, self._v, self._last_logits = out[:3]
            o_tok, o_lp, o_slp, status, count = (np.asarray(x) for x in out[3:])
            chunk_i += 1
            for r in live:
                n = int(count[r])
                start = int(self._lengths[r])
                self._tokens[r, start: start + n] = o_tok[r, :n]
                self._lengths[r] += n
                remaining[r] -= n
                toks, lps, slps = gen[r]
                toks.extend(o_tok[r, :n].tolist())
                lps.extend(o_lp[r, :n].tolist())
                slps.extend(o_slp[r, :n].tolist())
                if status[r] != kernels.RUNNING:
                    active[r] = False
                    reason[r] = _REASONS[int(status[r])]
                if self.detokenize is not None and self.stop_strings:
                    cut = find_stop_cut(toks, self.detokenize, self.stop_strings, self.stop_blocks)
                    if cut is not None:
                        keep, texts[r] = cut
                        if keep < len(toks):  # stop string completed before the device noticed
                            self.truncate(r, int(self._lengths[r]) - (len(toks) - keep))
                            del toks[keep:], lps[keep:], slps[keep:]
                        active[r] = False
                        reason[r] = "stop"
                    elif reason.get(r) == "stop":  # a stray closing tag (no block): not a stop, decode on
                        if remaining[r] > 0:
                            active[r] = True
                            del reason[r]
                        else:
                            reason[r] = "length"
        outs = []
        for r in rows:
            toks, lps, slps = gen[r]
            text = texts.get(r)
            if text is None:
                text = self.detokenize(toks) if self.detokenize is not None else ""
            outs.append(GenOut(toks, lps, reason[r], text, slps))
        return outs
