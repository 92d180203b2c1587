"""Synthetic rollouts: TrajectoryBatches with the real layout but random tokens, for trainer tests.

Deterministic from (seed, step): the same step always yields the same batch, so a resumed run sees
exactly the trajectories an uninterrupted run saw. Per question, `group_size` originals:

    [prompt 4-8][response 3-8][info 0-4][response 2-6 ending in "<answer> … </answer>"]

right or wrong with probability `correct_prob` (the text carries the gold answer or "wrong", so the
real reward function scores it). A wrong original spawns a probe with probability `probe_prob`:
its answer chunk is removed, one pool prompt is inserted (SEG_PROBE) and a 2-6 token continuation
follows, itself right with probability `correct_prob`. Probes share their original's group id.
"""
from __future__ import annotations

from typing import Sequence

import gin
import numpy as np

from rexrag_jax.data.schema import QAExample
from rexrag_jax.rl.prompt_pool import PromptPoolDistribution
from rexrag_jax.rollout.types import SEG_INFO, SEG_PROBE, SEG_PROMPT, SEG_RESPONSE, TrajectoryBatch


def synthetic_pool(vocab_size: int, size: int = 6, seed: int = 1234) -> list[list[int]]:
    """`size` token sequences (3-6 tokens, sharing a first token like the "<think> " prefix)."""
    rng = np.random.default_rng(seed)
    return [[7] + rng.integers(8, vocab_size, int(rng.integers(2, 6))).tolist() for _ in range(size)]


def _answer_text(example: QAExample, correct: bool) -> str:
    answer = example.golden_answers[0] if correct else "wrong"
    return f"<think> reasoning </think> <answer> {answer} </answer>"


def synthetic_batch(examples: Sequence[QAExample], group_size: int, vocab_size: int, seed: int,
                    pool: Sequence[Sequence[int]], probe_prob: float = 0.5, correct_prob: float = 0.4,
                    pad_id: int = 0, pad_to: int | None = None, length_scale: int = 1) -> TrajectoryBatch:
    """length_scale multiplies every chunk's length (the random draws are unchanged, so 1 is the
    default layout): benchmarks use it for trajectories as long as a real rollout's."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(8, vocab_size, int(n) * length_scale).tolist()  # noqa: E731  (ids < 8 reserved)
    records = []
    for q, ex in enumerate(examples):
        for _ in range(group_size):
            head = [(SEG_PROMPT, tok(rng.integers(4, 9))), (SEG_RESPONSE, tok(rng.integers(3, 9)))]
            n_info = int(rng.integers(0, 5))
            if n_info:
                head.append((SEG_INFO, tok(n_info)))
            right = bool(rng.random() < correct_prob)
            tail = (SEG_RESPONSE, tok(rng.integers(2, 7)))
            records.append(_record(head + [tail], q, ex, _answer_text(ex, right), int(n_info > 0), None))
            if not right and rng.random() < probe_prob:
                prompt = list(pool[int(rng.integers(0, len(pool)))])
                cont = (SEG_RESPONSE, tok(rng.integers(2, 7)))
                probe_right = bool(rng.random() < correct_prob)
                records.append(_record(head + [(SEG_PROBE, prompt), cont], q, ex, _answer_text(ex, probe_right),
                                       int(n_info > 0), len(prompt)))
    return TrajectoryBatch.from_records(records, pad_id=pad_id, pad_to=pad_to)


def _record(chunks, group, example, text, searches, probe_len):
    tokens, segments = [], []
    probe_start = -1
    for seg, toks in chunks:
        if seg == SEG_PROBE:
            probe_start = len(tokens)
        tokens += toks
        segments += [seg] * len(toks)
    return {"tokens": tokens, "segments": segments, "logprobs": [0.0] * len(tokens), "group_id": group,
            "is_probe": probe_len is not None, "probe_start": probe_start, "probe_len": probe_len or 0,
            "num_searches": searches, "example": example, "response_text": text}


@gin.configurable
class SyntheticRollout:
    """Rollout stand-in with the trainer's rollout interface; ignores the policy parameters."""

    def __init__(self, vocab_size: int = 512, probe_prob: float = 0.5, correct_prob: float = 0.4,
                 length_scale: int = 1):
        self.vocab_size, self.probe_prob, self.correct_prob = vocab_size, probe_prob, correct_prob
        self.length_scale = length_scale
        self.pool_tokens = synthetic_pool(vocab_size)

    def setup(self, model_cfg, params, num_trajectories: int, mesh=None) -> None:
        if model_cfg.vocab_size < self.vocab_size:
            raise ValueError(f"SyntheticRollout.vocab_size={self.vocab_size} > model vocab {model_cfg.vocab_size}")

    def pool_distribution(self, vocab_size: int) -> PromptPoolDistribution:
        return PromptPoolDistribution(self.pool_tokens, vocab_size=vocab_size)

    def __call__(self, params, examples, group_size: int, seed: int, use_probes: bool = True):
        batch = synthetic_batch(examples, group_size, self.vocab_size, seed, self.pool_tokens,
                                self.probe_prob if use_probes else 0.0, self.correct_prob,
                                length_scale=self.length_scale)
        return batch, {"probes_created": int(batch.is_probe.sum())}


    def evaluate(self, params, examples) -> list[str]:
        """Greedy-evaluation stand-in: example i is answered right iff i is even (deterministic)."""
        return [_answer_text(ex, i % 2 == 0) for i, ex in enumerate(examples)]


def synthetic_examples(n: int, prefix: str = "q") -> list[QAExample]:
    """n QAExamples with distinct ids and one-word gold answers."""
    sources = ("nq", "hotpotqa")
    return [QAExample(id=f"{prefix}{i}", question=f"question {i}?", golden_answers=[f"answer{i}"],
                      data_source=sources[i % 2]) for i in range(n)]
