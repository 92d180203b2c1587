"""Step-trace buffer of successful trajectories (RAPO, SPEC §8).

Entries are (key, value) = (history before a step, that step with its observation). A *step* is one
model turn, s_t = (thought, action, observation): the maximal run of policy-generated tokens between
two non-policy segments (a `<think>…<search>…</search>` or `<think>…<answer>…</answer>` chunk; an
invalid turn counts as a step too) followed by the retrieval result the search got (the SEG_INFO run
right after it, `\n\n<information>…</information>\n\n`). Storing the observation is what lets a
hybrid rollout insert the step without a new tool call (rapo.hybrid_rollout). Keys are embedded once at insertion (dense, unit-norm: the project's Flax
MiniLM by default) and searched by inner product (exact by default; ScaNN for very large buffers).

History text (what a key holds, `history_key`): the question plus the tail of the trajectory after
the prompt (model turns and observations), cut to `max_chars` on the left. The SPEC prompt is the same
for every question and MiniLM reads only its first 256 tokens, so keying on the raw chat context would
make every key the instruction boilerplate.

Bounded FIFO: past `capacity` entries the oldest are evicted. `save(dir)` writes entries + embeddings
to a temp directory and renames it into place (a crash leaves the old copy intact); `load` checks the
encoder name and dimension recorded there.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from typing import Callable, Sequence

import numpy as np

from rexrag_jax.io import paths
from rexrag_jax.rollout.types import SEG_INFO, SEG_RESPONSE, TrajectoryBatch

SEG_RETRIEVED = 6  # inserted RAPO step tokens (beyond rollout.types' SEG_* codes 0..5)
EncodeFn = Callable[[Sequence[str]], np.ndarray]


def history_key(question: str, response_so_far: str, max_chars: int = 1000) -> str:
    """`{question}\\n{last max_chars characters of the trajectory text after the prompt}`."""
    tail = response_so_far[-max_chars:] if max_chars > 0 else ""
    return f"{question.strip()}\n{tail}"


def trajectory_steps(batch: TrajectoryBatch, n: int, decode: Callable[[list[int]], str],
                     max_chars: int = 1000, with_observation: bool = True) -> list[tuple[str, str]]:
    """[(history_key, step_text)] for each policy step (maximal SEG_RESPONSE run) of trajectory n; with
    `with_observation` the step text includes the observation (SEG_INFO run) that directly follows it.

    Inserted steps (SEG_RETRIEVED) are not returned (they came from the buffer) but stay in the history.
    """
    segs, toks = batch.segments[n], batch.tokens[n]
    length = int(batch.attention_mask[n].sum())
    prompt_len = int(np.argmax(segs[:length] != 0)) if np.any(segs[:length] != 0) else length
    question = batch.examples[n].question
    out, t = [], prompt_len
    while t < length:
        if segs[t] != SEG_RESPONSE:
            t += 1
            continue
        s = t
        while t < length and segs[t] == SEG_RESPONSE:
            t += 1
        end = t
        if with_observation:
            while end < length and segs[end] == SEG_INFO:
                end += 1
        step = decode(toks[s:end].tolist())
        if step.strip():
            out.append((history_key(question, decode(toks[prompt_len:s].tolist()), max_chars), step))
    return out


def minilm_encode_fn(**kw) -> EncodeFn:
    """The project's Flax all-MiniLM-L6-v2 (installed package, offline) as an encode function."""
    from rexrag_jax.retrieval.encoder import minilm_encoder
    enc = minilm_encoder(**kw)
    fn = lambda texts: enc.encode(list(texts), kind="query")  # noqa: E731  (MiniLM: no prefixes)
    fn.encoder_name, fn.max_length = enc.name, enc.max_length  # what a static buffer's manifest checks
    return fn


class TraceBuffer:
    """Bounded FIFO of (history, step) pairs with dense-key nearest-neighbour lookup.

    encode_fn: texts -> float32 [n, d] unit vectors. searcher: "exact" (default), "scann", or "auto"
    (ScaNN once len >= scann_min_size). The buffer changes every training step and ScaNN must then be
    rebuilt (seconds at 20k entries, see docs/benchmarks/rapo.md) while an exact scan of 20k x 384 for a
    step's queries costs well under a second, so ScaNN only pays off for much larger buffers.
    """

    def __init__(self, encode_fn: EncodeFn, capacity: int = 20_000, searcher: str = "exact",
                 scann_min_size: int = 200_000, encoder_name: str | None = None):
        if capacity < 1:
            raise ValueError(f"TraceBuffer.capacity={capacity}: expected >= 1")
        if searcher not in ("exact", "scann", "auto"):
            raise ValueError(f"TraceBuffer.searcher={searcher!r}: expected 'exact', 'scann' or 'auto'")
        self.encode_fn, self.capacity, self.searcher_kind = encode_fn, int(capacity), searcher
        self.scann_min_size = int(scann_min_size)
        self.encoder_name = encoder_name or getattr(encode_fn, "encoder_name", "custom")
        self.keys: list[str] = []
        self.values: list[str] = []
        self.emb = np.zeros((0, 0), np.float32)
        self.total_added = 0
        self._searcher = None  # rebuilt lazily after a change

    def __len__(self) -> int:
        return len(self.keys)

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        e = np.asarray(self.encode_fn(list(texts)), np.float32)
        if e.ndim != 2 or e.shape[0] != len(texts):
            raise ValueError(f"TraceBuffer: encode_fn returned shape {e.shape} for {len(texts)} texts; expected [n, d]")
        if len(self) and e.shape[1] != self.emb.shape[1]:
            raise ValueError(f"TraceBuffer: encode_fn dimension {e.shape[1]} != buffer dimension {self.emb.shape[1]}")
        return e

    def add(self, histories: Sequence[str], steps: Sequence[str]) -> int:
        """Append entries (oldest evicted past capacity). Returns the number evicted."""
        histories, steps = list(histories), list(steps)
        if len(histories) != len(steps):
            raise ValueError(f"TraceBuffer.add: {len(histories)} histories but {len(steps)} steps")
        if not histories:
            return 0
        e = self._encode(histories)
        self.emb = e if not len(self) else np.concatenate([self.emb, e])
        self.keys += histories
        self.values += steps
        self.total_added += len(histories)
        evict = max(0, len(self.keys) - self.capacity)
        if evict:
            self.keys, self.values, self.emb = self.keys[evict:], self.values[evict:], self.emb[evict:]
        self._searcher = None
        return evict

    def add_successful(self, batch: TrajectoryBatch, rewards, decode, threshold: float = 1.0,
                       max_chars: int = 1000) -> int:
        """Add every policy step of the trajectories with reward >= threshold. Returns entries added."""
        rewards = np.asarray(rewards, np.float64)
        if rewards.shape != (batch.size,):
            raise ValueError(f"TraceBuffer.add_successful: rewards shape {rewards.shape}, expected ({batch.size},)")
        pairs = [p for n in np.flatnonzero(rewards >= threshold) for p in trajectory_steps(batch, n, decode, max_chars)]
        self.add([h for h, _ in pairs], [s for _, s in pairs])
        return len(pairs)

    def _get_searcher(self):
        if self._searcher is None:
            from rexrag_jax.retrieval.searcher import ExactSearcher, ScannSearcher
            use_scann = self.searcher_kind == "scann" or (self.searcher_kind == "auto"
                                                          and len(self) >= self.scann_min_size)
            self._searcher = ScannSearcher.build(self.emb) if use_scann and len(self) >= 16 else ExactSearcher(self.emb)
        return self._searcher

    def query(self, histories: Sequence[str], k: int = 1) -> list[list[dict]]:
        """Per history, up to k nearest entries best first: {"key", "value", "score", "index"}."""
        histories = list(histories)
        if not len(self) or not histories:
            return [[] for _ in histories]
        idx, scores = self._get_searcher().search(self._encode(histories), max(1, int(k)))
        return [[{"key": self.keys[i], "value": self.values[i], "score": float(s), "index": int(i)}
                 for i, s in zip(ri, rs) if 0 <= i < len(self)] for ri, rs in zip(idx, scores)]

    # --- persistence -----------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write `path/` (entries.json + embeddings.npy) atomically: temp dir, then rename. A gs:// URL
        (rexrag_jax.io.paths): written in a local temp dir, then uploaded with entries.json deleted first
        and uploaded last, so a reader that finds entries.json finds the whole buffer."""
        remote = paths.is_remote(path)
        path = paths.as_str(path)
        parent = None if remote else os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".trace_buffer.", dir=parent)
        try:
            meta = {"format": 1, "capacity": self.capacity, "encoder": self.encoder_name,
                    "dim": int(self.emb.shape[1]) if len(self) else 0, "total_added": self.total_added,
                    "keys": self.keys, "values": self.values}
            with open(os.path.join(tmp, "entries.json"), "w", encoding="utf-8") as f:
                json.dump(meta, f, ensure_ascii=False)
            np.save(os.path.join(tmp, "embeddings.npy"), self.emb)
            if remote:
                paths.upload_dir(tmp, path, last=("entries.json",), prune=True)
                shutil.rmtree(tmp, ignore_errors=True)
                return
            old = None
            if os.path.exists(path):
                old = path + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path: str, encode_fn: EncodeFn, **kw) -> "TraceBuffer":
        """A buffer saved by `save` (a local path or a gs:// URL); the encoder name (when known) and
        dimension must match."""
        where = paths.join(path, "entries.json")
        try:
            meta = json.loads(paths.read_text(where))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: cannot read a saved TraceBuffer ({e})") from None
        for field in ("capacity", "encoder", "dim", "keys", "values"):
            if field not in meta:
                raise ValueError(f"{where}: missing field {field!r}")
        with paths.open_file(paths.join(path, "embeddings.npy"), "rb") as f:
            emb = np.load(io.BytesIO(f.read()))
        if emb.shape[0] != len(meta["keys"]) or len(meta["keys"]) != len(meta["values"]):
            raise ValueError(f"{path}: {len(meta['keys'])} keys, {len(meta['values'])} values, "
                             f"{emb.shape[0]} embeddings; expected equal counts")
        kw.setdefault("capacity", meta["capacity"])
        buf = cls(encode_fn, **kw)
        if meta["encoder"] not in ("custom", buf.encoder_name):
            raise ValueError(f"{where}: saved with encoder {meta['encoder']!r}, loading with {buf.encoder_name!r}")
        if len(meta["keys"]):
            probe = buf._encode([meta["keys"][0]])
            if probe.shape[1] != meta["dim"]:
                raise ValueError(f"{where}: dim {meta['dim']} but encode_fn gives {probe.shape[1]}")
        buf.keys, buf.values, buf.emb = list(meta["keys"]), list(meta["values"]), emb.astype(np.float32)
        buf.total_added = int(meta.get("total_added", len(buf.keys)))
        evict = max(0, len(buf.keys) - buf.capacity)  # loaded into a smaller buffer: keep the newest
        if evict:
            buf.keys, buf.values, buf.emb = buf.keys[evict:], buf.values[evict:], buf.emb[evict:]
        return buf
