"""Synthetic hybrid rollouts for smoke runs and tests of the RAPO run type (no model, no retriever).

SyntheticRollout's batches (train.synthetic) with every policy step (maximal SEG_RESPONSE run) marked
as inserted (SEG_RETRIEVED) with probability `insert_prob`, drawn from (seed, step); the answer chunk is
never marked, so rewards stay the policy's. Exposes `.buffer` (a TraceBuffer, MiniLM keys by default)
and `.tokenizer.decode` (ids -> "t12 t7 ...") as RapoTrainer requires.

    python -m rexrag_jax.rapo.trainer --gin_file rapo.gin --gin_file tiny.gin \
        --gin_bindings 'Trainer.rollout = @SyntheticHybridRollout()' --run_dir /tmp/rapo-tiny
"""
from __future__ import annotations

import types

import gin
import numpy as np

from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, minilm_encode_fn
from rexrag_jax.rollout.types import SEG_RESPONSE
from rexrag_jax.train.synthetic import SyntheticRollout


def _runs(row: np.ndarray, code: int) -> list[tuple[int, int]]:
    idx = np.flatnonzero(row == code)
    if not idx.size:
        return []
    cuts = np.flatnonzero(np.diff(idx) > 1) + 1
    return [(int(g[0]), int(g[-1]) + 1) for g in np.split(idx, cuts)]


@gin.configurable
class SyntheticHybridRollout(SyntheticRollout):
    def __init__(self, vocab_size: int = 512, correct_prob: float = 0.4, insert_prob: float = 0.5,
                 buffer_capacity: int = 1000, encode_fn=None):
        super().__init__(vocab_size=vocab_size, probe_prob=0.0, correct_prob=correct_prob)
        self.insert_prob = insert_prob
        self.buffer = TraceBuffer(encode_fn or minilm_encode_fn(max_length=64), buffer_capacity)
        self.tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(f"t{int(i)}" for i in ids))

    def __call__(self, params, examples, group_size: int, seed: int, use_probes: bool = False):
        batch, stats = super().__call__(params, examples, group_size, seed, False)
        rng = np.random.default_rng([int(seed), 17])
        for n in range(batch.size):
            for s, e in _runs(batch.segments[n], SEG_RESPONSE)[:-1]:  # the last run carries the answer
                if rng.random() < self.insert_prob:
                    batch.segments[n, s:e] = SEG_RETRIEVED
        batch.loss_mask = batch.segments == SEG_RESPONSE
        stats["inserted_tokens"] = int((batch.segments == SEG_RETRIEVED).sum())
        return batch, stats
