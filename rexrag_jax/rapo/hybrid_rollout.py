"""RAPO hybrid rollouts (SPEC §8) on the REX-RAG rollout loop.

At every turn, each active row independently (probability `insert_prob`, default 0.5, from a seeded
host RNG) asks the trace buffer for the step nearest to its current history (`history_key`); if one is
found, that step's text is tokenized (cut to max_new_tokens) and *appended* to the row's KV cache with
engine.append instead of being generated. The loop then treats it exactly like a generated turn: a
`<search>` in it is executed, an `<answer>` ends the trajectory, neither gets the invalid-action note.
Inserted tokens get segment code SEG_RETRIEVED (6), sample log-prob 0, and are outside the loss mask
(TrajectoryBatch.loss_mask = RESPONSE | PROBE; rapo.hook also applies rl.rapo.rapo_loss_mask).

Reuse, not duplication: the per-turn logic is rollout.loop's. `_InsertingEngine` wraps the engine so
that generate() returns the retrieved steps for the chosen rows (appending them to the cache) and
generates the others; `_HybridRollout` (a subclass of the loop's `_Rollout`) chooses the rows before
each turn and re-labels the inserted tokens afterwards.

Answer steps: with `insert_answers=False` (default) a retrieved step containing `<answer>` is skipped
(the next nearest non-answer step is used, else the row generates): copying a stored answer would
earn accuracy reward for a token the policy never chose, and an insertion with no policy step after
it gets no retrieval reward (rl.rapo) anyway. In the final, search-disabled turn only an answer step
could help, so there the row generates unless insert_answers (then only answer steps are inserted).
Probes (REX-RAG mixed sampling) are a different exploration strategy and are off in hybrid rollouts.

Entropies: the engine reports log-probs of the sampled tokens only, not entropies. The retrieval
reward needs the policy entropy of the steps around each insertion, so it is computed after the
rollout by the old-policy forward pass over the finished trajectories (train.update.
logprobs_and_entropy, which the trainer runs anyway for π_old); see rapo.hook.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import gin
import jax
import numpy as np

from rexrag_jax.generation.engine import GenOut
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, history_key
from rexrag_jax.rollout import loop as rollout_loop
from rexrag_jax.rollout.types import SEG_RESPONSE


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HybridConfig:
    insert_prob: float = 0.5       # per row, per turn
    topk: int = 4                  # candidates fetched per query (answer steps may be skipped)
    insert_answers: bool = False   # allow retrieved `<answer>` steps (see module docstring)
    history_chars: int = 1000      # history_key tail length
    seed_offset: int = 7919        # the insertion RNG = (rollout seed, offset): independent of sampling

    def __post_init__(self):
        if not 0.0 <= self.insert_prob <= 1.0:
            raise ValueError(f"HybridConfig.insert_prob={self.insert_prob}: expected a probability in [0, 1]")
        if self.topk < 1:
            raise ValueError(f"HybridConfig.topk={self.topk}: expected >= 1")


class _InsertingEngine:
    """Engine wrapper: generate() answers rows in `self.inserts` with their given tokens (appended to
    the cache, as a generation would leave them) and forwards the other rows to the real engine."""

    def __init__(self, engine, detokenize):
        self.inner, self.detokenize = engine, detokenize
        self.inserts: dict[int, list[int]] = {}

    def __getattr__(self, name):  # batch_size, max_len, append, truncate, copy_prefix, lengths, reset
        return getattr(self.inner, name)

    def generate(self, rows, max_new_tokens, rng, **kw):
        ins = {r: self.inserts[r][:max_new_tokens] for r in rows if r in self.inserts}
        self.inserts = {}
        gen_rows = [r for r in rows if r not in ins]
        outs = dict(zip(gen_rows, self.inner.generate(gen_rows, max_new_tokens, rng, **kw))) if gen_rows else {}
        if ins:
            self.inner.append(list(ins), list(ins.values()))
            for r, toks in ins.items():
                zeros = [0.0] * len(toks)
                outs[r] = GenOut(list(toks), zeros, "stop", self.detokenize(list(toks)), list(zeros))
        return [outs[r] for r in rows]


class _HybridRollout(rollout_loop._Rollout):
    def __init__(self, *args, buffer: TraceBuffer, hybrid: HybridConfig, insert_rng: np.random.Generator, **kw):
        super().__init__(*args, **kw)
        self.buffer, self.hybrid, self.insert_rng = buffer, hybrid, insert_rng
        self.inserted_rows_log: list[tuple[int, int, int]] = []  # (turn, trajectory index, tokens)
        self.stats.update(insert_draws=0, insertions=0, inserted_tokens=0, insert_misses=0)

    def _history(self, traj) -> str:
        return history_key(traj.example.question, self.tok.decode(traj.tokens[traj.prompt_len:]),
                           self.hybrid.history_chars)

    def _pick(self, hits: list[dict], final: bool) -> str | None:
        """First usable hit. In the final (search-disabled) turn only an answer step can help the row."""
        for h in hits:
            is_answer = "<answer>" in h["value"]
            if (is_answer and self.hybrid.insert_answers) or (not is_answer and not final):
                return h["value"]
        return None

    def turn(self, turn: int, rng):
        rows = [r for r in range(self.B) if self.row_traj[r] is not None]
        chosen = [r for r in rows if self.insert_rng.random() < self.hybrid.insert_prob]  # one draw per row
        final = turn == self.cfg.max_turns
        if final and not self.hybrid.insert_answers:
            chosen = []  # a non-answer step there would end the row without an answer
        self.stats["insert_draws"] += len(chosen)
        inserts = {}
        if chosen and len(self.buffer):
            hits = self.buffer.query([self._history(self.trajs[self.row_traj[r]]) for r in chosen], self.hybrid.topk)
            for r, h in zip(chosen, hits):
                step = self._pick(h, final)
                toks = self.tok.encode(step)[: self.cfg.max_new_tokens] if step else []
                if toks:
                    inserts[r] = toks
        self.stats["insert_misses"] += len(chosen) - len(inserts)
        idx_of = {r: self.row_traj[r] for r in inserts}
        self.engine.inserts = inserts
        active = super().turn(turn, rng)
        for r, toks in inserts.items():
            traj = self.trajs[idx_of[r]]
            s = traj.turn_start
            if traj.tokens[s:s + len(toks)] != list(toks) or traj.segments[s] != SEG_RESPONSE:
                raise RuntimeError(f"hybrid rollout: trajectory {idx_of[r]} does not hold its inserted step at {s}")
            traj.segments[s:s + len(toks)] = [SEG_RETRIEVED] * len(toks)
            self.inserted_rows_log.append((turn, idx_of[r], len(toks)))
            self.stats["insertions"] += 1
            self.stats["inserted_tokens"] += len(toks)
        return active


def run_hybrid_rollouts(engine, tokenizer, retriever, examples: Sequence, group_size: int, rng,
                        buffer: TraceBuffer, config: rollout_loop.RolloutConfig | None = None,
                        hybrid: HybridConfig | None = None):
    """run_rollouts with RAPO step insertions; same arguments and outputs (probes are not used).

    Returns (TrajectoryBatch with SEG_RETRIEVED tokens, stats incl. insertions / inserted_tokens and
    "insert_log": [(turn, trajectory, n_tokens)]).
    """
    config = config or rollout_loop.RolloutConfig(probes=False)
    hybrid = hybrid or HybridConfig()
    if config.probes:
        raise ValueError("run_hybrid_rollouts: RolloutConfig.probes must be False (RAPO replaces REX-RAG probes)")
    examples = list(examples)
    if group_size < 1 or not examples:
        raise ValueError(f"run_hybrid_rollouts: need >= 1 example and group_size >= 1, got {len(examples)}, "
                         f"{group_size}")
    n = len(examples) * group_size
    if engine.batch_size < n:
        raise ValueError(f"run_hybrid_rollouts: engine.batch_size={engine.batch_size} < {n} trajectories")
    max_len = getattr(engine, "max_len", None)
    if max_len is not None and max_len < config.max_context + config.max_new_tokens:
        raise ValueError(f"run_hybrid_rollouts: engine.max_len={max_len} < max_context + max_new_tokens = "
                         f"{config.max_context + config.max_new_tokens}")
    rng, np_rng = rollout_loop._host_rng(rng)
    insert_rng = np.random.default_rng([int(np_rng.integers(1 << 31)), hybrid.seed_offset])
    wrapped = _InsertingEngine(engine, tokenizer.decode)
    wrapped.reset()
    ro = _HybridRollout(wrapped, tokenizer, retriever, config, [], np_rng, n, buffer=buffer, hybrid=hybrid,
                        insert_rng=insert_rng)
    ro.start(examples, group_size)
    for turn in range(config.max_turns + 1):
        if not ro.turn(turn, jax.random.fold_in(rng, turn)):
            break
    batch = ro.finish()
    stats = dict(ro.stats, num_originals=n, num_probes=0, insert_log=list(ro.inserted_rows_log),
                 inserted_fraction=float((batch.segments == SEG_RETRIEVED).sum() /
                                         max(1, ((batch.segments == SEG_RETRIEVED) | batch.loss_mask).sum())))
    return batch, stats
