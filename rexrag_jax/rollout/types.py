"""TrajectoryBatch: what a rollout emits and the trainer consumes (numpy, right-padded to T).

Layout per trajectory n (see docs/DESIGN.md "Trajectories"):
  tokens[n, :L_n]          prompt, then the turns (response / observation / invalid text / probe prompt)
  segments[n, t]           one of the SEG_* codes below, SEG_PAD beyond L_n
  loss_mask[n, t]          segments in (SEG_RESPONSE, SEG_PROBE)
  sample_logprobs[n, t]    log pi(token) reported by the engine for sampled tokens, 0 elsewhere
  attention_mask[n, t]     t < L_n
  probe_start[n]           index of the first inserted revision-prompt token (-1 for originals)
  probe_len[n]             number of inserted revision-prompt tokens (0 for originals)
  rewards[n]               NaN until the trainer fills them
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

SEG_PROMPT = 0
SEG_RESPONSE = 1
SEG_INVALID = 2
SEG_INFO = 3
SEG_PROBE = 4
SEG_PAD = 5
SEGMENT_NAMES = {SEG_PROMPT: "prompt", SEG_RESPONSE: "response", SEG_INVALID: "invalid", SEG_INFO: "info",
                 SEG_PROBE: "probe", SEG_PAD: "pad"}

_ROW_FIELDS = ("tokens", "segments", "loss_mask", "sample_logprobs", "attention_mask")
_VEC_FIELDS = ("group_ids", "is_probe", "probe_start", "probe_len", "rewards", "num_searches")
_PAD_VALUES = {"segments": SEG_PAD, "loss_mask": False, "sample_logprobs": 0.0, "attention_mask": False}


@dataclasses.dataclass
class TrajectoryBatch:
    tokens: np.ndarray           # int32 [N, T]
    segments: np.ndarray         # int8 [N, T]
    loss_mask: np.ndarray        # bool [N, T]
    sample_logprobs: np.ndarray  # float32 [N, T]
    attention_mask: np.ndarray   # bool [N, T]
    group_ids: np.ndarray        # int32 [N]
    is_probe: np.ndarray         # bool [N]
    probe_start: np.ndarray      # int32 [N]
    probe_len: np.ndarray        # int32 [N]
    rewards: np.ndarray          # float32 [N]
    num_searches: np.ndarray     # int32 [N]
    examples: list               # list[QAExample], one per trajectory
    response_text: list          # list[str]: decoded tokens after the prompt (what the reward reads)
    pad_id: int = 0

    def __post_init__(self):
        n, t = np.shape(self.tokens)
        for name in _ROW_FIELDS:
            if np.shape(getattr(self, name)) != (n, t):
                raise ValueError(f"TrajectoryBatch.{name}: shape {np.shape(getattr(self, name))}, expected {(n, t)}")
        for name in _VEC_FIELDS:
            if np.shape(getattr(self, name)) != (n,):
                raise ValueError(f"TrajectoryBatch.{name}: shape {np.shape(getattr(self, name))}, expected {(n,)}")
        for name in ("examples", "response_text"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrajectoryBatch.{name}: {len(getattr(self, name))} entries, expected {n}")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        return self.attention_mask.sum(axis=1).astype(np.int32)

    @classmethod
    def from_records(cls, records: Sequence[dict], pad_id: int, pad_to: int | None = None) -> "TrajectoryBatch":
        """Build from per-trajectory records with keys tokens, segments, logprobs (lists of equal length),
        group_id, is_probe, probe_start, probe_len, num_searches, example, response_text.

        loss_mask = segments in {RESPONSE, PROBE}; T = max length (or `pad_to`, which must be >= it).
        """
        n = len(records)
        t = max((len(r["tokens"]) for r in records), default=0)
        if pad_to is not None:
            if pad_to < t:
                raise ValueError(f"TrajectoryBatch.from_records: pad_to={pad_to} < longest trajectory {t}")
            t = pad_to
        tokens = np.full((n, t), pad_id, np.int32)
        segments = np.full((n, t), SEG_PAD, np.int8)
        logprobs = np.zeros((n, t), np.float32)
        for i, r in enumerate(records):
            length = len(r["tokens"])
            if not len(r["segments"]) == len(r["logprobs"]) == length:
                raise ValueError(f"TrajectoryBatch.from_records: record {i} has {length} tokens, "
                                 f"{len(r['segments'])} segments, {len(r['logprobs'])} logprobs; expected equal")
            tokens[i, :length] = r["tokens"]
            segments[i, :length] = r["segments"]
            logprobs[i, :length] = r["logprobs"]
        return cls(
            tokens=tokens, segments=segments,
            loss_mask=(segments == SEG_RESPONSE) | (segments == SEG_PROBE),
            sample_logprobs=logprobs, attention_mask=segments != SEG_PAD,
            group_ids=np.array([r["group_id"] for r in records], np.int32).reshape(n),
            is_probe=np.array([r["is_probe"] for r in records], bool).reshape(n),
            probe_start=np.array([r["probe_start"] for r in records], np.int32).reshape(n),
            probe_len=np.array([r["probe_len"] for r in records], np.int32).reshape(n),
            rewards=np.full((n,), np.nan, np.float32),
            num_searches=np.array([r["num_searches"] for r in records], np.int32).reshape(n),
            examples=[r["example"] for r in records], response_text=[r["response_text"] for r in records],
            pad_id=pad_id)

    def select(self, indices) -> "TrajectoryBatch":
        """Rows `indices` (ints or a bool mask), in that order; T unchanged."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            if idx.shape != (self.size,):
                raise ValueError(f"TrajectoryBatch.select: bool mask shape {idx.shape}, expected {(self.size,)}")
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64).reshape(-1)
        if idx.size and (idx.min() < -self.size or idx.max() >= self.size):
            raise IndexError(f"TrajectoryBatch.select: index out of range for {self.size} trajectories")
        fields = {name: getattr(self, name)[idx] for name in _ROW_FIELDS + _VEC_FIELDS}
        return TrajectoryBatch(**fields, examples=[self.examples[i] for i in idx],
                               response_text=[self.response_text[i] for i in idx], pad_id=self.pad_id)

    def pad_to(self, t: int) -> "TrajectoryBatch":
        """Right-pad (never truncate) to length t."""
        cur = self.tokens.shape[1]
        if t < cur:
            raise ValueError(f"TrajectoryBatch.pad_to: {t} < current length {cur}")
        if t == cur:
            return self
        fields = {}
        for name in _ROW_FIELDS:
            arr = getattr(self, name)
            fill = self.pad_id if name == "tokens" else _PAD_VALUES[name]
            fields[name] = np.concatenate([arr, np.full((arr.shape[0], t - cur), fill, arr.dtype)], axis=1)
        fields.update({name: getattr(self, name) for name in _VEC_FIELDS})
        return TrajectoryBatch(**fields, examples=list(self.examples), response_text=list(self.response_text),
                               pad_id=self.pad_id)

    def to_jsonl_rows(self) -> list[dict[str, Any]]:
        """One JSON-serialisable dict per trajectory for dumps (reward only when set, i.e. not NaN)."""
        rows = []
        for i in range(self.size):
            ex = self.examples[i]
            row = {"question": ex.question, "golden_answers": list(ex.golden_answers),
                   "data_source": ex.data_source, "id": ex.id, "response": self.response_text[i],
                   "is_probe": bool(self.is_probe[i]), "group_id": int(self.group_ids[i]),
                   "num_searches": int(self.num_searches[i])}
            if self.is_probe[i]:
                row["probe_start"] = int(self.probe_start[i])
                row["probe_len"] = int(self.probe_len[i])
            reward = float(self.rewards[i])
            if not math.isnan(reward):
                row["reward"] = reward
            rows.append(row)
        return rows


def concat(batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
    """Stack batches along N, right-padding all to the longest T. Pad ids must agree."""
    batches = list(batches)
    if not batches:
        raise ValueError("concat: expected at least one TrajectoryBatch")
    pad_ids = {b.pad_id for b in batches}
    if len(pad_ids) != 1:
        raise ValueError(f"concat: batches use different pad ids {sorted(pad_ids)}")
    t = max(b.tokens.shape[1] for b in batches)
    batches = [b.pad_to(t) for b in batches]
    fields = {name: np.concatenate([getattr(b, name) for b in batches], axis=0)
              for name in _ROW_FIELDS + _VEC_FIELDS}
    return TrajectoryBatch(**fields, examples=[e for b in batches for e in b.examples],
                           response_text=[s for b in batches for s in b.response_text], pad_id=batches[0].pad_id)
