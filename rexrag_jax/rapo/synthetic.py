"""Synthetic hybrid rollouts for smoke runs and tests of the RAPO run type (no model, no retriever).

SyntheticRollout's batches (train.synthetic: prompt, a policy step, maybe an observation, the answer
step) made hybrid under the rule of rapo.hybrid_rollout: in the first `num_hybrid` rows of each group
(None: group_size // 2), with probability `insert_prob` drawn from (seed, step), a block of 3-8 random
tokens marked SEG_RETRIEVED is spliced in right before the last policy step. So an insertion is never
step 0, is always followed by a policy step, and never comes twice in a row; rewards stay the policy's.
Exposes `.buffer` (a TraceBuffer, MiniLM keys by default)
and `.tokenizer.decode` (ids -> "t12 t7 ...") as RapoTrainer requires.

    python -m rexrag_jax.rapo.trainer --gin_file rapo.gin --gin_file tiny.gin \
        --gin_bindings 'Trainer.rollout = @SyntheticHybridRollout()' --run_dir /tmp/rapo-tiny
"""
from __future__ import annotations

import types

import gin
import numpy as np

from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, minilm_encode_fn
from rexrag_jax.rollout.types import SEG_RESPONSE, TrajectoryBatch
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
                 buffer_capacity: int = 1000, encode_fn=None, num_hybrid: int | None = None):
        super().__init__(vocab_size=vocab_size, probe_prob=0.0, correct_prob=correct_prob)
        self.insert_prob, self.num_hybrid = insert_prob, num_hybrid
        self.buffer = TraceBuffer(encode_fn or minilm_encode_fn(max_length=64), buffer_capacity)
        self.tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(f"t{int(i)}" for i in ids))

    def __call__(self, params, examples, group_size: int, seed: int, use_probes: bool = False):
        batch, stats = super().__call__(params, examples, group_size, seed, False)
        rng = np.random.default_rng([int(seed), 17])
        k = group_size // 2 if self.num_hybrid is None else self.num_hybrid
        records = []
        for n in range(batch.size):
            length = int(batch.attention_mask[n].sum())
            toks, segs = batch.tokens[n, :length].tolist(), batch.segments[n, :length].tolist()
            lps = batch.sample_logprobs[n, :length].tolist()
            runs = _runs(batch.segments[n, :length], SEG_RESPONSE)
            # originals come group by group (no probes here)
            if n % group_size < k and len(runs) >= 2 and rng.random() < self.insert_prob:
                s, m = runs[-1][0], int(rng.integers(3, 9))
                ins = rng.integers(8, self.vocab_size, m).tolist()
                toks, segs, lps = toks[:s] + ins + toks[s:], segs[:s] + [SEG_RETRIEVED] * m + segs[s:], \
                    lps[:s] + [0.0] * m + lps[s:]
            records.append(dict(tokens=toks, segments=segs, logprobs=lps, group_id=int(batch.group_ids[n]),
                                is_probe=False, probe_start=-1, probe_len=0,
                                num_searches=int(batch.num_searches[n]), example=batch.examples[n],
                                response_text=batch.response_text[n]))
        batch = TrajectoryBatch.from_records(records, pad_id=batch.pad_id)
        batch.loss_mask = batch.segments == SEG_RESPONSE
        stats["inserted_tokens"] = int((batch.segments == SEG_RETRIEVED).sum())
        return batch, stats
