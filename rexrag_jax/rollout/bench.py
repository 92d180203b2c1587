"""Rollout benchmark: one batch with probes, our KV splice vs two re-prefill peers, same run.

    python -m rexrag_jax.rollout.bench --preset tiny --questions 8 --group 5 --think 24 --turns 3

Modes (same workload and forced actions; only what is recomputed differs):
  splice           ours: observations/probe prompts are appended to the live cache; a probe starts
                   from its original's cache (truncate / copy_prefix), no prefix recomputation;
  reprefill_probes probes re-prefill their whole prefix in a fresh row (an engine without prefix copy);
  reprefill_turns  every turn re-prefills each row's whole context, as Search-R1 / REX-RAG's loop does
                   when it hands the rolling state to generate_sequences each turn (no KV reuse).
A random policy never emits tags, so actions are forced: each turn the model really generates
`--think` tokens, then the turn is completed with a forced action (original: search, then a wrong
answer; probe: search once, then a wrong answer). Passages come from the wiki-18 sample when present.
Prints wall time, prefill tokens and the ratios vs each peer.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
import zlib

import jax
import numpy as np

from rexrag_jax.generation.engine import GenerationEngine, GenOut
from rexrag_jax.rl.prompt_pool import DEFAULT_REVISION_PROMPTS
from rexrag_jax.rollout.loop import RolloutConfig, required_batch_size, run_rollouts

MODES = ("splice", "reprefill_probes", "reprefill_turns")


class _HashRetriever:
    """Deterministic in-memory retriever: hits chosen by a hash of the query."""

    def __init__(self, passages):
        self.passages = passages

    def search(self, queries, topk=3):
        out = []
        for q in queries:
            h = zlib.crc32(q.encode())
            out.append([{"document": self.passages[(h + 7919 * k) % len(self.passages)], "score": 1.0}
                        for k in range(topk)])
        return out


class _ForcedPolicy:
    """Engine wrapper: real generation of `think` tokens, then a forced action; counts prefill tokens and
    implements the re-prefill peers."""

    def __init__(self, engine, tok, think, mode):
        self.engine, self.tok, self.think, self.mode = engine, tok, think, mode
        self.batch_size, self.max_len = engine.batch_size, engine.max_len
        self.prefill_tokens = 0

    def lengths(self):
        return self.engine.lengths()

    def reset(self, rows=None):
        self.engine.reset(rows)

    def append(self, rows, token_lists):
        self.prefill_tokens += sum(len(t) for t in token_lists)
        self.engine.append(rows, token_lists)

    def _reprefill(self, src, dst, length):
        toks = self.engine.row_tokens(src)[:length]
        self.engine.reset([dst])
        self.append([dst], [toks])

    def truncate(self, row, length):
        if self.mode == "splice":
            return self.engine.truncate(row, length)
        self._reprefill(row, row, length)

    def copy_prefix(self, src, dst, length):
        if self.mode == "splice":
            return self.engine.copy_prefix(src, dst, length)
        self._reprefill(src, dst, length)

    def _action(self, row):
        body = self.tok.decode(self.engine.row_tokens(row)).rsplit("assistant\n", 1)[-1]
        probe = next((p for p in DEFAULT_REVISION_PROMPTS if p in body), None)
        searched = (body.split(probe, 1)[1] if probe else body).count("<information>")
        return " <search> more evidence please </search>" if searched == 0 else " <answer> wrong </answer>"

    def generate(self, rows, max_new_tokens, rng, **kw):
        if self.mode == "reprefill_turns":
            ctx = [self.engine.row_tokens(r) for r in rows]
            self.engine.reset(rows)
            self.append(rows, ctx)
        outs = self.engine.generate(rows, min(self.think, max_new_tokens), rng, **kw)
        forced = [self.tok.encode(self._action(r)) for r in rows]
        self.append(rows, forced)
        res = []
        for o, f in zip(outs, forced):
            toks = list(o.tokens) + f
            res.append(GenOut(toks, list(o.logprobs) + [0.0] * len(f), "stop", self.tok.decode(toks)))
        return res


def _passages(max_n=1000):
    path = pathlib.Path(__file__).resolve().parents[2].parent / "shared/data/corpus/wiki18_sample_1000.jsonl"
    if path.exists():
        with open(path) as f:
            return [json.loads(line) for _, line in zip(range(max_n), f)]
    return [{"id": str(i), "contents": f'"Title {i}"\n' + " ".join(f"word{j}" for j in range(100))}
            for i in range(max_n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--group", type=int, default=5)
    ap.add_argument("--think", type=int, default=24, help="real tokens generated per turn before the action")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--revision-prob", type=float, default=1.0)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    from rexrag_jax.data.prompts import PROMPT_TEMPLATE
    from rexrag_jax.data.schema import QAExample
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.models.qwen2.model import init_params
    from rexrag_jax.tokenizers import load_tokenizer, train_sentencepiece
    import tempfile

    passages = _passages()
    preset = Qwen2Config.from_preset(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        lines = [PROMPT_TEMPLATE, *DEFAULT_REVISION_PROMPTS, *(p["contents"] for p in passages[:300])]
        tok = load_tokenizer(train_sentencepiece(lines, os.path.join(tmp, "bench"),
                                                 vocab_size=min(preset.vocab_size, 2048)))
    cfg = Qwen2Config.from_preset(args.preset, vocab_size=tok.vocab_size)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    examples = [QAExample(str(i), f"which passage number {i} is the one we want", ["right"], "nq")
                for i in range(args.questions)]
    rcfg = RolloutConfig(max_turns=args.turns, max_new_tokens=max(args.think, 16) + 16,
                         max_context=args.max_context, revision_prob=args.revision_prob, probe_slot="source")
    n = args.questions * args.group
    engine = GenerationEngine(params, cfg, batch_size=required_batch_size(n, rcfg),
                              max_len=rcfg.max_context + rcfg.max_new_tokens, pad_id=tok.pad_id,
                              eos_ids=tok.eos_ids, detokenize=tok.decode, decode_chunk=8)
    retriever = _HashRetriever(passages)
    print(f"device={jax.devices()[0].platform} preset={args.preset} rows={n} think={args.think} "
          f"turns={args.turns} revision_prob={args.revision_prob}")
    policies = {mode: _ForcedPolicy(engine, tok, args.think, mode) for mode in MODES}
    runs = {mode: [] for mode in MODES}
    for rep in range(args.repeats + 1):  # round 0 compiles; modes interleaved so host load hits all alike
        for mode in MODES:
            policy = policies[mode]
            policy.prefill_tokens = 0
            t0 = time.perf_counter()
            batch, stats = run_rollouts(policy, tok, retriever, examples, args.group, jax.random.PRNGKey(rep), rcfg)
            jax.block_until_ready(engine._k)
            if rep:
                runs[mode].append((time.perf_counter() - t0, policy.prefill_tokens, batch, stats))
    results = {}
    for mode in MODES:
        t, prefill, batch, stats = runs[mode][-1]
        results[mode] = dict(time_s=float(np.median([x[0] for x in runs[mode]])), prefill_tokens=prefill,
                             probes=stats["probes_created"], trajectories=batch.size,
                             saved=stats["prefill_tokens_saved_by_splice"], tokens=int(batch.lengths.sum()),
                             generate_s=stats["generate_s"], append_s=stats["append_s"])
        r = results[mode]
        print(f"{mode:17s} time {r['time_s']:.3f}s (generate {r['generate_s']:.2f}s, append {r['append_s']:.2f}s)"
              f"  prefill tokens {r['prefill_tokens']:7d}  trajectories {r['trajectories']} (probes {r['probes']})"
              f"  trajectory tokens {r['tokens']}")
    s = results["splice"]
    print(f"prefill tokens saved by splicing (probe prefixes): {s['saved']}")
    for peer in MODES[1:]:
        p = results[peer]
        print(f"splice vs {peer}: speedup x{p['time_s'] / s['time_s']:.2f}, prefill tokens "
              f"{s['prefill_tokens']} vs {p['prefill_tokens']} (x{p['prefill_tokens'] / max(s['prefill_tokens'], 1):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
