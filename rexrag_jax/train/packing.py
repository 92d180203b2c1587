"""Sequence packing for the log-prob and update passes (padding-free layout, as t5x / MaxText pack).

Right-padded trajectories [N, T] become packed rows [R, P]: several trajectories per row, each a
*segment* with its own id (1, 2, ... within the row; 0 = padding) and RoPE positions restarting at 0.
The model (qwen2.forward with segment_ids) restricts attention to the same segment, causally, so every
real token sees exactly the context it has in the unpacked layout and gets the same log-prob.

Placement is first-fit decreasing: trajectories sorted by length (longest first, ties by index) go into
the first row with room left. The row length P is fixed per run (`pack_len`, raised to the length
bucket of the longest trajectory when one is longer), and the number of rows is padded to a multiple
of the rows per micro-batch, so the jitted passes see a few shapes only.

Per-token arrays ([N, T]: tokens, loss_mask, behaviour_logp, ref_logp) are moved with their tokens;
per-trajectory arrays ([N]: advantages, is_probe) are broadcast to every token of their segment.
Padding gets 0 / False everywhere (loss_mask False: it adds nothing to the loss sum nor to the token
count, so the token mean over the mini-batch is the unpacked one).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each trajectory goes: row[i], offset[i] (first column), length[i] (tokens)."""
    row: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    num_rows: int
    pack_len: int

    @property
    def real_tokens(self) -> int:
        return int(self.length.sum())


def pack_length(lengths: np.ndarray, pack_len: int, bucket: int) -> int:
    """P = pack_len, or the multiple of `bucket` covering the longest trajectory when that is longer."""
    longest = int(np.max(lengths)) if len(lengths) else 1
    return max(int(pack_len), -(-max(longest, 1) // bucket) * bucket)


def plan_packing(lengths, pack_len: int, row_multiple: int = 1) -> PackPlan:
    """First-fit decreasing of `lengths` into rows of `pack_len` tokens.

    num_rows is rounded up to a multiple of `row_multiple` (extra rows are empty). Zero-length
    trajectories take no room (row 0, offset 0, length 0).
    """
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) and lengths.max() > pack_len:
        raise ValueError(f"plan_packing: a trajectory of {int(lengths.max())} tokens exceeds pack_len={pack_len}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, ties by index
    row = np.zeros(len(lengths), np.int64)
    offset = np.zeros(len(lengths), np.int64)
    free = np.zeros(0, np.int64)  # tokens used per open row
    for i in order:
        n = lengths[i]
        if n == 0:
            continue
        fits = np.flatnonzero(free + n <= pack_len)
        if fits.size:
            r = int(fits[0])
        else:
            r = len(free)
            free = np.append(free, 0)
        row[i], offset[i] = r, free[r]
        free[r] += n
    num_rows = max(len(free), 1)
    num_rows = -(-num_rows // row_multiple) * row_multiple
    return PackPlan(row, offset, lengths, num_rows, int(pack_len))


def _token_index(plan: PackPlan):
    """(trajectory index, column in the trajectory, packed row, packed column) of every real token."""
    traj = np.repeat(np.arange(len(plan.length)), plan.length)
    starts = np.cumsum(plan.length) - plan.length
    col = np.arange(plan.real_tokens) - np.repeat(starts, plan.length)
    return traj, col, plan.row[traj], plan.offset[traj] + col


def segment_ids_and_positions(plan: PackPlan) -> tuple[np.ndarray, np.ndarray]:
    """segment_ids [R, P] int32 (1.. per row in placement order, 0 = padding); positions [R, P] int32."""
    seg = np.zeros((plan.num_rows, plan.pack_len), np.int32)
    pos = np.zeros((plan.num_rows, plan.pack_len), np.int32)
    traj, col, r, c = _token_index(plan)
    # segment id = rank of the trajectory's offset within its row
    order = np.lexsort((plan.offset, plan.row))
    rank = np.zeros(len(plan.length), np.int32)
    prev_row, k = -1, 0
    for i in order:
        if plan.length[i] == 0:
            continue
        k = k + 1 if plan.row[i] == prev_row else 1
        prev_row = plan.row[i]
        rank[i] = k
    seg[r, c] = rank[traj]
    pos[r, c] = col
    return seg, pos


def pack(plan: PackPlan, x: np.ndarray) -> np.ndarray:
    """[N, T, ...] per-token or [N] per-trajectory (broadcast to its tokens) -> [R, P, ...]; 0 elsewhere."""
    x = np.asarray(x)
    traj, col, r, c = _token_index(plan)
    if x.ndim == 1:
        out = np.zeros((plan.num_rows, plan.pack_len), x.dtype)
        out[r, c] = x[traj]
    else:
        out = np.zeros((plan.num_rows, plan.pack_len) + x.shape[2:], x.dtype)
        out[r, c] = x[traj, col]
    return out


def unpack(plan: PackPlan, y: np.ndarray, t: int) -> np.ndarray:
    """Packed [R, P, ...] -> right-padded [N, t, ...] (0 beyond each trajectory's length)."""
    y = np.asarray(y)
    traj, col, r, c = _token_index(plan)
    out = np.zeros((len(plan.length), t) + y.shape[2:], y.dtype)
    out[traj, col] = y[r, c]
    return out


def pack_arrays(arrays: dict[str, np.ndarray], lengths, pack_len: int, row_multiple: int = 1
                ) -> tuple[dict[str, np.ndarray], PackPlan]:
    """Pack every array of `arrays` (an `attention_mask` is replaced by segment_ids/positions)."""
    plan = plan_packing(lengths, pack_len, row_multiple)
    out = {k: pack(plan, v) for k, v in arrays.items() if k != "attention_mask"}
    out["segment_ids"], out["positions"] = segment_ids_and_positions(plan)
    return out, plan


def packed_mini_batches(arrays: dict[str, np.ndarray], lengths, mini_batch: int, rows: int, pack_len: int,
                        rng: np.random.Generator | None) -> list[list[dict[str, np.ndarray]]]:
    """The mini-batches of prepare.mini_batches (same shuffle, same trajectories in each), packed.

    Each mini-batch is a list of micro-batches of `rows` packed rows [rows, P]; the number of
    micro-batches follows the tokens of the mini-batch (not a compiled shape: one program per
    micro-batch shape, looped on the host).
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    out = []
    for lo in range(0, n, mini_batch):
        idx = order[lo:lo + mini_batch]
        packed, plan = pack_arrays({k: v[idx] for k, v in arrays.items()}, lengths[idx], pack_len, rows)
        out.append([{k: v[i:i + rows] for k, v in packed.items()} for i in range(0, plan.num_rows, rows)])
    return out
