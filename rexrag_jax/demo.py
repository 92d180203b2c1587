"""`rexrag demo`: the embedded end-to-end run (CPU, no downloads, minutes).

    rexrag demo --run_dir runs/demo [--seed 0] [--quick] [--gin_file F] [--gin_param 'DemoConfig.rl_steps=40']

Phases (each timed, with progress bars):
  1. world      synthetic fictional world (rexrag_jax.data.synthetic_world): corpus + 1/2/3-hop questions
  2. index      MiniLM (packaged weights) + exact/ScaNN index over the world's corpus (build_default_retriever)
  3. warm-start trajectories in the rollout format; a fraction answer too early with a wrong guess (dead ends)
  4. tokenizer  SentencePiece trained on the world's text, agent tags and ChatML markers as user symbols
  5. SFT        a tiny Qwen2-architecture policy learns the trajectories (rexrag_jax.train.sft)
  6. eval       greedy, probe-free EM on the held-out split (warm start)
  7. RL         REX-RAG (probes + policy correction) with rexrag_jax.train.Trainer
  8. eval       the same held-out questions after RL; table of EM by hop count and the margin

Run directory:
    world/{corpus,train,test,warmstart}.jsonl   index/           tokenizer/demo.model
    warmstart_model/   HF Qwen2 export + tokenizer (the RL init; loadable by transformers and hf_io)
    rl/                Trainer run: checkpoints/<step>/ (orbax), tensorboard/, metrics.jsonl
    tensorboard/       SFT + evaluation scalars     final_model/  HF export + tokenizer after RL
    eval_{warmstart,rl}.jsonl  scored trajectories   summary.json  the table's numbers and phase times

Evaluate the exported policy on other data (e.g. the real benchmark files with the wiki-18 sample):
    rexrag demo eval --model RUN/final_model --corpus CORPUS.jsonl --data FILES_OR_DIRS [--limit N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Sequence

import gin
import numpy as np
from rexrag_jax.config.cli_style import conventional

HOP_SOURCES = ("synth_1hop", "synth_2hop", "synth_3hop")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything the demo decides; gin-configurable (`DemoConfig.<field> = ...`, see gin/demo.gin)."""
    # world and warm-start data
    num_person: int = 120
    num_city: int = 40
    num_country: int = 10
    num_company: int = 30
    dead_end_fraction: float = 0.0      # random dead ends: records that answer too early after j ~ U{0..k-1} searches
    dead_end_stop: str = "any_hop"      # where random dead ends stop ("no_search": guess before any search)
    revision_fraction: float = 0.0      # random revision records: dead end + pool prompt + correct continuation
    # trap dead ends (rexrag_jax.data.warmstart): num_trap_relations relations drawn by the seed; at a hop
    # j >= 1 on one of them a record answers with the entity found so far (trap_dead_end_prob), and a share
    # trap_revision_share of those fired traps are revision records instead (the prior probes rely on;
    # only the continuation after the prompt is learnt)
    num_trap_relations: int = 3
    trap_dead_end_prob: float = 0.85
    trap_revision_share: float = 0.3
    # trap_reflect_share of those revision records keep the prompt in the SFT loss: the warm start then
    # reflects on its own after a trap, rarely (the base LLM's rare self-reflection), which is what the
    # probes' prompt tokens reinforce under the policy correction (a prompt the policy never emits has
    # importance weight ~0 there).
    trap_reflect_share: float = 0.0    # benchmarks/replication.py: 0.1
    # what a revision record does after the prompt (rexrag_jax.data.warmstart.make_trajectory): "restate" the
    # last fact and search the next hop, or "research" the last query and walk on from its observation
    revision_continuation: str = "restate"  # benchmarks/replication.py: "research"
    # reading worlds: the warm start also learns from the train questions of this many worlds with the
    # same names but re-drawn facts (observations from their own corpus). Trained on one world only, the
    # policy memorises its facts and ignores what it retrieves (issue 12: held-out EM 0-8% on questions
    # whose facts no train trajectory shows, vs 11-69% on the rest), so its errors are recall errors that
    # neither searching on nor a probe can fix. With facts that differ between worlds, reading is the
    # only way to lower the loss.
    reading_worlds: int = 0            # benchmarks/replication.py: 4 (with 1,600 SFT steps)
    probe_prior_questions: int = 96     # greedy-wrong held-out questions for the probe vs fresh-sample measure
    sft_examples: int = 0               # warm-start trajectories used (0: the whole train split)
    test_per_hop: int = 100             # held-out questions per hop count
    vocab_size: int = 1024              # SentencePiece upper bound (the model uses the trained vocab size)
    # policy: Qwen2 architecture, 2 layers so that CPU training fits minutes; heads of 64 dims (at 32 the
    # copy-a-name-from-the-observation behaviour did not form within the SFT budget, see docs/benchmarks/demo.md)
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    # supervised warm start (lr 3e-3 diverged to EM ~1 %, 1e-3 learns too slowly for the budget)
    sft_steps: int = 800
    sft_batch_size: int = 8
    sft_lr: float = 2e-3
    sft_time_budget_s: float | None = 540.0
    # prior gate (issue 12): after SFT, measure probe vs fresh success on a dev world (this world's names,
    # facts of its own, never in the SFT data or the held-out set) and, while the ratio is below
    # prior_gate, continue SFT for prior_gate_steps more steps (a new cosine at prior_gate_lr_scale x sft_lr),
    # at most prior_gate_rounds times; the warm start is the first round that passes, else the best ratio.
    # 0 = off (the demo); benchmarks/replication.py: 2.0, the target
    prior_gate: float = 0.0
    prior_gate_rounds: int = 2
    prior_gate_steps: int = 800
    prior_gate_lr_scale: float = 0.5
    prior_gate_per_hop: int = 150       # dev-world questions per hop count (greedy-evaluated; its wrong ones probed)
    # REX-RAG
    rl_steps: int = 30
    num_questions: int = 8
    group_size: int = 4
    rl_lr: float = 3e-5
    micro_batch: int = 8
    kl_coef: float = 0.001
    use_probes: bool = True
    policy_correction: bool = True      # False: the "w/o policy correction" ablation (behaviour = π_old)
    revision_prob: float = 0.5          # higher than the paper's 0.2: few wrong answers per small step
    # RAPO arm (benchmarks/replication.py --arms rapo; rexrag_jax/rapo, SPEC §8): hybrid rollouts whose
    # inserted steps come from a static trace buffer that the world's solver with noise builds before RL
    # (rapo_buffer_n samples per train question, top rapo_buffer_k kept; the "stronger agent" of the paper).
    # Half the rows of a group are hybrid (paper: 8 of 16), clip 0.28, beta 0, per-sequence mean.
    rapo: bool = False
    rapo_buffer_noise: float = 0.3      # the solver's early-answer probability per hop
    rapo_buffer_n: int = 16
    rapo_buffer_k: int = 5
    # the paper's prompt sentence about <retrieve> is for an instruction-following LLM; the miniature's
    # warm start follows no instructions and never saw it, so by default the prompt stays the warm start's
    rapo_prompt_note: bool = False
    initial_keep_ratio: float = 0.125
    rl_time_budget_s: float | None = 240.0
    temperature: float = 0.7            # rollout sampling temperature; the trainer's log-probs use the same
    curve_every: int = 0                # >0: greedy EM on `curve_examples` test questions every k RL steps
    curve_examples: int = 60
    # rollout (shorter than the paper's 500 tokens/turn, 4096 context: the demo's turns are ~30 tokens)
    max_new_tokens: int = 64
    max_context: int = 1024
    topk: int = 1                      # one passage per search (SPEC: 3): shorter sequences, no distractors
    max_turns: int = 5
    length_bucket: int = 128           # sequences padded to multiples of this (each length compiles once)


# per-step numbers kept in summary.json's rl_log (all of them also go to TensorBoard, rl/)
RL_LOG_KEYS = ("em/train", "reward/mean", "reward/original", "probes/created", "probes/kept", "probes/success_created",
               "probes/success_kept", "groups/all_fail", "groups/rescued", "keep_ratio", "alpha", "err",
               "original/ratio_mean", "probe/ratio_mean", "original/clip_frac", "probe/clip_frac", "kl", "time/step",
               "searches/mean", "rapo/insertions_per_traj", "rapo/z_ret_mean", "rapo/z_ret_std", "rapo/a_ret_mean",
               "rapo/f_ret_mean", "rapo/shaped_ratio_clip_frac", "rapo/buffer_hit_similarity",
               "ratio0/original", "ratio0/probe_prefix", "ratio0/probe_prompt", "ratio0/probe_prompt_first",
               "ratio0/probe_continuation", "ratio0/prompt_pos_weight")

QUICK_OVERRIDES = dict(hidden_size=128, intermediate_size=384, head_dim=32, num_person=40, num_city=14, num_country=4, num_company=10, sft_examples=400, reading_worlds=1,
                       test_per_hop=10, sft_steps=25, rl_steps=2, num_questions=4, group_size=4,
                       micro_batch=8, curve_every=0, vocab_size=700, probe_prior_questions=8, prior_gate_rounds=1, prior_gate_steps=5, prior_gate_per_hop=4, sft_time_budget_s=None, rl_time_budget_s=None,
                       rapo_buffer_n=4, rapo_buffer_k=1)


def _log(msg: str) -> None:
    print(msg, flush=True)


class CachedRetriever:
    """Answers repeated queries from a cache; `prefetch` searches many queries in batched calls."""

    def __init__(self, retriever, batch: int = 256):
        self.retriever, self.batch, self.cache = retriever, batch, {}

    def prefetch(self, queries: Sequence[str], topk: int) -> None:
        todo = sorted({q for q in queries if (q, topk) not in self.cache})
        for lo in range(0, len(todo), self.batch):
            part = todo[lo:lo + self.batch]
            for q, hits in zip(part, self.retriever.search(part, topk)):
                self.cache[(q, topk)] = hits

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[dict]]:
        self.prefetch(queries, topk)
        return [self.cache[(q, topk)] for q in queries]


def model_config(cfg: DemoConfig, vocab_size: int):
    from rexrag_jax.models.qwen2.config import Qwen2Config

    # vocab = the tokenizer's exactly: padded ids would be sampled (untrained) and could not be decoded
    return Qwen2Config(vocab_size=vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       rope_theta=10000.0, tie_word_embeddings=True,
                       max_position_embeddings=max(2048, cfg.max_context + cfg.max_new_tokens))


def export_policy(params, model_cfg, tokenizer_model: str, out_dir: str) -> str:
    """HF Qwen2 directory (safetensors + config.json) with the SentencePiece model beside it, written
    to a temporary sibling and renamed (an existing export is replaced only once the new one is whole)."""
    from rexrag_jax.models.qwen2.hf_io import export_checkpoint
    from rexrag_jax.tokenizers.hf_export import save_tokenizer_for_hf

    tmp = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        inner = export_checkpoint(params, model_cfg, os.path.join(tmp, "m"), progress=False)
        save_tokenizer_for_hf(tokenizer_model, inner)  # tokenizer.model + HF tokenizer.json/config/template
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(inner, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def evaluate_split(rollout, params, examples, out_path: str, progress: bool):
    """Greedy, probe-free evaluation through rexrag_jax.evaluation (records, Summary)."""
    from rexrag_jax.evaluation import evaluate

    return evaluate(examples, lambda batch: rollout.evaluate(params, batch), batch_size=rollout.engine.batch_size,
                    out_path=out_path, progress=progress)


def hop_table(before, after) -> tuple[str, dict]:
    """The summary table (hop count x EM warm start / after RL / delta, in EM points) and its numbers."""
    rows, data = [], {}
    lines = [f"{'questions':<12}{'n':>5}{'EM warm-start':>15}{'EM after RL':>13}{'delta':>8}"]
    for src in HOP_SOURCES + ("all",):
        if src == "all":
            b, a = 100 * before.average, 100 * after.average
            n = before.num_examples
            name = "all (mean)"
        else:
            if src not in before.per_source:
                continue
            b, a = 100 * before.per_source[src]["em"], 100 * after.per_source[src]["em"]
            n = before.per_source[src]["n"]
            name = src.replace("synth_", "")
        data[src] = {"n": n, "em_warmstart": b, "em_rl": a, "delta": a - b}
        rows.append(f"{name:<12}{n:>5}{b:>15.1f}{a:>13.1f}{a - b:>+8.1f}")
    return "\n".join(lines + ["-" * 53] + rows), data


def world_config(cfg: DemoConfig, seed: int):
    """The synthetic world's WorldConfig for this demo config and seed."""
    from rexrag_jax.data.synthetic_world import WorldConfig

    return WorldConfig(seed=seed, num_person=cfg.num_person, num_city=cfg.num_city, num_country=cfg.num_country,
                       num_company=cfg.num_company, test_per_hop=(cfg.test_per_hop,) * 3)


def make_evaluator(cfg: DemoConfig, tok_path: str, retriever, model_cfg, params):
    """One greedy, probe-free evaluation engine, used for the held-out EM before and after RL."""
    from rexrag_jax.rollout import RolloutConfig
    from rexrag_jax.train.rollout_source import SearchRollout

    eval_cfg = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, max_context=cfg.max_context,
                             topk=cfg.topk, greedy=True, probes=False)
    evaluator = SearchRollout(tokenizer_path=tok_path, retriever=retriever, config=eval_cfg)
    evaluator.setup(model_cfg, params, cfg.num_questions * cfg.group_size)
    return evaluator


def prepare_warm_start(run_dir: str, seed: int, cfg: DemoConfig, progress: bool, times: dict) -> dict:
    """Phases 1-6: world, index, warm-start data, tokenizer, SFT, warm-start evaluation. The returned dict is
    everything the RL phase needs; benchmarks/replication.py reuses it for a second RL arm."""
    import jax

    from rexrag_jax.data.synthetic_world import generate_world, write_world
    from rexrag_jax.data.warmstart import pick_trap_relations, training_text
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.retrieval import build_default_retriever
    from rexrag_jax.tokenizers import load_tokenizer, train_sentencepiece
    from rexrag_jax.train.metrics_log import MetricsLogger
    from rexrag_jax.train.sft import SFTConfig, build_sft_data, train_sft

    def phase(name):
        times[name] = time.perf_counter()
        _log(f"== {name}")

    def done(name, extra=""):
        times[name] = time.perf_counter() - times[name]
        _log(f"   {name}: {times[name]:.1f}s {extra}")

    phase("world")
    world = generate_world(world_config(cfg, seed))
    paths = write_world(world, os.path.join(run_dir, "world"))
    done("world", f"({len(world.names)} entities, {len(world.train)} train / {len(world.test)} test questions)")

    phase("index")
    retriever = CachedRetriever(build_default_retriever(paths["corpus"], os.path.join(run_dir, "index"),
                                                        progress=progress))
    done("index")

    phase("warmstart_data")
    sft_examples = sft_questions(world, cfg)
    retriever.prefetch([f"{s} {r}" for ex in sft_examples for s, r, _ in world.hops(ex.id)], cfg.topk)
    traps = pick_trap_relations(seed, cfg.num_trap_relations)
    trajectories = warmstart_records(world, cfg, seed, traps, retriever)
    write_world(world, os.path.join(run_dir, "world"), trajectories)
    trajectories = trajectories + reading_world_trajectories(world, cfg, seed, traps)
    done("warmstart_data", f"({len(trajectories)} trajectories ({cfg.reading_worlds} reading worlds), "
                           f"{sum(t['dead_end'] for t in trajectories)} dead ends, "
                           f"{sum(t.get('revision', False) for t in trajectories)} revisions; trap relations "
                           f"{', '.join(traps) or 'none'})")

    phase("tokenizer")
    tok_path = train_sentencepiece(training_text(world, trajectories), os.path.join(run_dir, "tokenizer", "demo"),
                                   cfg.vocab_size)
    tokenizer = load_tokenizer(tok_path)
    done("tokenizer", f"(vocab {tokenizer.vocab_size})")

    phase("sft")
    model_cfg = model_config(cfg, tokenizer.vocab_size)
    data = build_sft_data(tokenizer, trajectories, cfg.max_context + cfg.max_new_tokens, cfg.length_bucket)
    params = qwen2.init_params(model_cfg, jax.random.PRNGKey(seed))
    logger = MetricsLogger(run_dir, use_tensorboard=True, stream=open(os.devnull, "w"))
    sft_cfg = SFTConfig(steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, learning_rate=cfg.sft_lr,
                        length_bucket=cfg.length_bucket, time_budget_s=cfg.sft_time_budget_s)
    params, sft_hist = train_sft(params, model_cfg, data, sft_cfg, seed=seed, log_fn=logger.log, progress=progress)
    done("sft", f"({sft_hist[-1]['step'] + 1} steps, final loss {sft_hist[-1]['loss']:.3f})")
    gate = None
    if cfg.prior_gate > 0:
        phase("prior_gate")
        params, gate = gate_prior(cfg, seed, world, tok_path, model_cfg, params, data, sft_hist[-1]["step"] + 1,
                                  logger.log, progress)
        _write_json(os.path.join(run_dir, "prior_gate.json"), gate)
        done("prior_gate", f"(dev ratio {gate['chosen']['ratio']:.2f} after {gate['chosen']['sft_steps']} SFT steps, "
                           f"{'passed' if gate['passed'] else 'NOT passed'})")
    warm_dir = export_policy(params, model_cfg, tok_path, os.path.join(run_dir, "warmstart_model"))

    phase("eval_warmstart")
    evaluator = make_evaluator(cfg, tok_path, retriever, model_cfg, params)
    records, before = evaluate_split(evaluator, params, world.test, os.path.join(run_dir, "eval_warmstart.jsonl"),
                                     progress)
    logger.log(0, {f"eval/em_{k}": v["em"] for k, v in before.per_source.items()} | {"eval/em_mean": before.average})
    done("eval_warmstart", f"(EM {100 * before.average:.1f})")
    phase("probe_prior")
    prior = measure_probe_prior(cfg, evaluator, params, world.test, records, seed, run_dir,
                                errors=greedy_error_kinds(world, records, traps))
    logger.log(0, {f"warmstart/{k}": v for k, v in prior.items() if isinstance(v, float)})
    logger.close()
    done("probe_prior", f"(probe success {100 * prior['probe_success']:.1f}% vs fresh sample "
                        f"{100 * prior['fresh_success']:.1f}% on {prior['n_questions']} greedy-wrong held-out questions)")
    return dict(world=world, retriever=retriever, tok_path=tok_path, model_cfg=model_cfg, warm_dir=warm_dir,
                sft_hist=sft_hist, evaluator=evaluator, before=before, records=records, probe_prior=prior,
                prior_gate=gate, run_dir=run_dir, times=dict(times))


DEV_FACT_SEED_OFFSET = 997  # reading worlds use fact seeds seed*1000 + 1..reading_worlds


def dev_world(world, cfg: DemoConfig, seed: int):
    """The prior gate's dev world: `world`'s names and types with facts of its own (fact seed
    seed*1000 + 997, no reading world's), cfg.prior_gate_per_hop test questions per hop count. Neither its
    facts nor its questions are in the SFT data or the held-out evaluation."""
    from rexrag_jax.data.synthetic_world import generate_world

    n = cfg.prior_gate_per_hop
    return generate_world(dataclasses.replace(world.config, fact_seed=seed * 1000 + DEV_FACT_SEED_OFFSET,
                                              test_per_hop=(n, n, n)))


def gate_prior(cfg: DemoConfig, seed: int, world, tok_path, model_cfg, params, data, sft_steps: int, log_fn,
               progress: bool) -> tuple:
    """Continue SFT until the warm start has the prior REX-RAG relies on, checked on a dev world.

    Round r: greedy EM on the dev world's questions (exact lexical retriever over its corpus, the run's top-k),
    then probe vs fresh success on up to cfg.probe_prior_questions of its greedy-wrong questions
    (measure_probe_prior). While ratio = probe / fresh < cfg.prior_gate and r < cfg.prior_gate_rounds, SFT
    continues for cfg.prior_gate_steps steps (a new warmup-cosine at cfg.prior_gate_lr_scale x cfg.sft_lr).
    Returns (params, {"rounds": [...], "chosen": round, "passed": bool}): the first passing round's params,
    else the round with the highest dev ratio."""
    import jax
    import jax.numpy as jnp

    from rexrag_jax.data.synthetic_world import WorldRetriever
    from rexrag_jax.train.sft import SFTConfig, train_sft

    dev = dev_world(world, cfg, seed)
    evaluator = make_evaluator(cfg, tok_path, WorldRetriever(dev.corpus_rows()), model_cfg, params)
    rounds, kept = [], []
    for r in range(cfg.prior_gate_rounds + 1):
        if r > 0:
            more = SFTConfig(steps=cfg.prior_gate_steps, batch_size=cfg.sft_batch_size,
                             learning_rate=cfg.sft_lr * cfg.prior_gate_lr_scale, length_bucket=cfg.length_bucket)
            offset = sft_steps
            # train_sft donates its params: train a copy, so each round's params (and the caller's) stay valid
            params = jax.tree.map(jnp.array, params)
            params, _ = train_sft(params, model_cfg, data, more, seed=seed * 7919 + r,
                                  log_fn=lambda step, row: log_fn(offset + step, row), progress=progress)
            sft_steps += cfg.prior_gate_steps
        records, summary = evaluate_split(evaluator, params, dev.test, None, progress)
        prior = measure_probe_prior(cfg, evaluator, params, dev.test, records, seed + r, None)
        row = {"round": r, "sft_steps": sft_steps, "dev_em": 100 * summary.average, "n_dev": summary.num_examples,
               **{k: prior[k] for k in ("probe_success", "fresh_success", "ratio", "n_questions", "reflect_rate")}}
        rounds.append(row)
        kept.append(params)
        log_fn(sft_steps, {"prior_gate/dev_ratio": row["ratio"], "prior_gate/dev_em": summary.average,
                           "prior_gate/probe_success": row["probe_success"], "prior_gate/fresh_success": row["fresh_success"]})
        _log(f"   prior gate round {r}: {sft_steps} SFT steps, dev EM {row['dev_em']:.1f}, probe "
             f"{100 * row['probe_success']:.1f}% vs fresh {100 * row['fresh_success']:.1f}% (ratio {row['ratio']:.2f})")
        if _finite(row["ratio"]) >= cfg.prior_gate:
            break
    passed = _finite(rounds[-1]["ratio"]) >= cfg.prior_gate
    best = len(rounds) - 1 if passed else int(np.nanargmax([_finite(x["ratio"]) for x in rounds]))
    return kept[best], {"gate": cfg.prior_gate, "rounds": rounds, "chosen": rounds[best], "passed": passed}


def _finite(x: float) -> float:
    """A ratio for comparisons: probe success with no fresh success (inf) counts as 1e9, 0 / 0 (nan) as -1."""
    return x if np.isfinite(x) else (1e9 if x > 0 else -1.0)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def sft_questions(world, cfg: DemoConfig) -> list:
    """The train questions the warm start learns from: the first cfg.sft_examples (all when 0)."""
    return world.train[:cfg.sft_examples] if cfg.sft_examples else world.train


def warmstart_records(world, cfg: DemoConfig, seed: int, traps, retriever) -> list[dict]:
    """make_warmstart on `world`'s train split (its first cfg.sft_examples when set) with cfg's dead-end,
    revision and trap settings."""
    from rexrag_jax.data.warmstart import make_warmstart

    return make_warmstart(world, dead_end_fraction=cfg.dead_end_fraction, seed=seed, retriever=retriever,
                          topk=cfg.topk, examples=sft_questions(world, cfg),
                          dead_end_stop=cfg.dead_end_stop, revision_fraction=cfg.revision_fraction,
                          trap_relations=traps, trap_dead_end_prob=cfg.trap_dead_end_prob,
                          trap_revision_share=cfg.trap_revision_share, trap_reflect_share=cfg.trap_reflect_share,
                          revision_continuation=cfg.revision_continuation)


def reading_world_trajectories(world, cfg: DemoConfig, seed: int, traps) -> list[dict]:
    """Warm-start records from cfg.reading_worlds worlds with `world`'s names and types but their own facts
    (WorldConfig.fact_seed), same trap relations and shares; observations from each world's own corpus
    (exact lexical retriever, the run's top-k)."""
    from rexrag_jax.data.synthetic_world import WorldRetriever, generate_world

    out = []
    for i in range(cfg.reading_worlds):
        other = generate_world(dataclasses.replace(world.config, fact_seed=seed * 1000 + i + 1))
        out += warmstart_records(other, cfg, seed * 1000 + i + 1, traps, WorldRetriever(other.corpus_rows()))
    return out


def greedy_error_kinds(world, records, trap_relations) -> dict:
    """What the greedy warm start gets wrong: the share of its wrong answers given after fewer searches than
    the question has hops (early answers, what a probe can fix) and EM on questions with / without a trap
    relation after the first hop."""
    from rexrag_jax.data.warmstart import has_trap

    by_id = {e.id: e for e in world.test}
    wrong = [r for r in records if r["em"] < 1.0]
    early = [r["response"].count("<search>") < len(world.hops(r["id"])) for r in wrong]
    trap = [has_trap(world, by_id[r["id"]], trap_relations) for r in records]
    em = np.array([r["em"] for r in records], float)
    trap = np.array(trap, bool)
    return {"early_answer_share_of_wrong": float(np.mean(early)) if early else float("nan"),
            "trap_question_share": float(trap.mean()) if len(trap) else float("nan"),
            "em_trap_questions": float(em[trap].mean()) if trap.any() else float("nan"),
            "em_other_questions": float(em[~trap].mean()) if (~trap).any() else float("nan"),
            "trap_relations": list(trap_relations)}


def measure_probe_prior(cfg: DemoConfig, evaluator, params, test, records, seed: int, run_dir: str | None,
                        errors: dict | None = None) -> dict:
    """Probe vs fresh-sample success at the warm start (rexrag_jax.evaluation.probe_prior) on up to
    cfg.probe_prior_questions held-out questions whose greedy answer is wrong; written to
    run_dir/probe_prior.json."""
    from rexrag_jax.evaluation.probe_prior import greedy_wrong, probe_vs_fresh

    wrong = greedy_wrong(test, records)
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(wrong), size=min(cfg.probe_prior_questions, len(wrong)), replace=False))
    prior = probe_vs_fresh(evaluator, params, [wrong[i] for i in pick], group_size=cfg.group_size, seed=seed,
                           batch_questions=cfg.num_questions, temperature=cfg.temperature)
    prior["greedy_wrong"] = len(wrong)
    prior.update(errors or {})
    if run_dir is not None:
        tmp = os.path.join(run_dir, ".probe_prior.json.tmp")
        with open(tmp, "w") as f:
            json.dump(prior, f, indent=2)
        os.replace(tmp, os.path.join(run_dir, "probe_prior.json"))
    return prior


def load_warm_start(run_dir: str, seed: int, cfg: DemoConfig, progress: bool = False, evaluate: bool = True) -> dict:
    """The `prepare_warm_start` result of a finished demo run (same seed and config), rebuilt from its files:
    world (regenerated, checked against world/corpus.jsonl), index, tokenizer and warmstart_model; the
    warm-start evaluation is re-run (greedy, so it reproduces eval_warmstart.jsonl's EM).
    evaluate=False skips that evaluation and the probe prior (their keys are None): enough to train."""
    from rexrag_jax.data.synthetic_world import generate_world
    from rexrag_jax.models.qwen2.hf_io import load_checkpoint
    from rexrag_jax.retrieval import build_default_retriever

    run_dir = os.path.abspath(run_dir)
    need = ["world/corpus.jsonl", "index", "tokenizer/demo.model", "warmstart_model/config.json"]
    missing = [n for n in need if not os.path.exists(os.path.join(run_dir, n))]
    if missing:
        raise FileNotFoundError(f"{run_dir}: not a finished demo warm start (missing {', '.join(missing)})")
    world = generate_world(world_config(cfg, seed))
    with open(os.path.join(run_dir, "world", "corpus.jsonl")) as f:
        if [json.loads(line) for line in f] != world.corpus_rows():
            raise ValueError(f"{run_dir}/world/corpus.jsonl is not the world of seed {seed} with this DemoConfig")
    retriever = CachedRetriever(build_default_retriever(os.path.join(run_dir, "world", "corpus.jsonl"),
                                                        os.path.join(run_dir, "index"), progress=progress))
    warm_dir = os.path.join(run_dir, "warmstart_model")
    loaded_cfg, params = load_checkpoint(warm_dir, progress=False)
    model_cfg = model_config(cfg, loaded_cfg.vocab_size)
    tok_path = os.path.join(run_dir, "tokenizer", "demo.model")
    if not evaluate:
        return dict(world=world, retriever=retriever, tok_path=tok_path, model_cfg=model_cfg, warm_dir=warm_dir,
                    sft_hist=[], evaluator=None, before=None, records=None, probe_prior=None, run_dir=run_dir,
                    times={})
    evaluator = make_evaluator(cfg, tok_path, retriever, model_cfg, params)
    records, before = evaluate_split(evaluator, params, world.test, None, progress)
    prior_path = os.path.join(run_dir, "probe_prior.json")
    if os.path.exists(prior_path):
        with open(prior_path) as f:
            prior = json.load(f)
    else:
        from rexrag_jax.data.warmstart import pick_trap_relations

        prior = measure_probe_prior(cfg, evaluator, params, world.test, records, seed, run_dir,
                                    errors=greedy_error_kinds(world, records, pick_trap_relations(seed, cfg.num_trap_relations)))
    gate_path = os.path.join(run_dir, "prior_gate.json")
    gate = None
    if os.path.exists(gate_path):
        with open(gate_path) as f:
            gate = json.load(f)
    return dict(world=world, retriever=retriever, tok_path=tok_path, model_cfg=model_cfg, warm_dir=warm_dir,
                sft_hist=[], evaluator=evaluator, before=before, records=records, probe_prior=prior,
                prior_gate=gate, run_dir=run_dir, times={})


def build_rapo_buffer(cfg: DemoConfig, warm: dict, seed: int, progress: bool = False) -> str:
    """The RAPO arm's static trace buffer for the warm start's world: <warm run_dir>/trace_buffer, built once
    (resumable, rexrag_jax.rapo.static_buffer) from cfg.rapo_buffer_n solver samples per train question
    (early-answer noise cfg.rapo_buffer_noise; the first cfg.sft_examples questions when set), top
    cfg.rapo_buffer_k kept; observations from the run's own
    retriever and top-k, keys embedded with the trainer's MiniLM encoder. Returns the directory."""
    from rexrag_jax.rapo.hybrid_rollout import HybridConfig
    from rexrag_jax.rapo.solver import NoisySolver
    from rexrag_jax.rapo.static_buffer import build_trace_buffer
    from rexrag_jax.rapo.trace_buffer import minilm_encode_fn

    out = os.path.join(warm["run_dir"], "trace_buffer")
    if os.path.exists(os.path.join(out, "manifest.json")):
        return out
    chars = HybridConfig().history_chars
    solver = NoisySolver(warm["retriever"], cfg.rapo_buffer_noise, cfg.topk, chars)
    build_trace_buffer(out, warm["world"].train, solver, minilm_encode_fn(max_length=256), n=cfg.rapo_buffer_n,
                       k=cfg.rapo_buffer_k, seed=seed, history_chars=chars,
                       policy=dict(solver.info, retriever="demo"), num_questions=cfg.sft_examples or None,
                       progress=progress, log=_log)
    return out


def make_rl_trainer(cfg: DemoConfig, warm: dict, rl_dir: str, seed: int):
    """The demo's RL Trainer (search rollouts on the world's retriever, from the warm-start policy) in
    rl_dir; `warm` is a `prepare_warm_start` / `load_warm_start` result. cfg.rapo: a RapoTrainer on hybrid
    rollouts from the world's static trace buffer (build_rapo_buffer), RAPO's clip / beta / aggregation."""
    from rexrag_jax.rollout import RolloutConfig
    from rexrag_jax.train.optim import OptimizerConfig
    from rexrag_jax.train.rollout_source import SearchRollout
    from rexrag_jax.train.trainer import TrainConfig, Trainer

    if cfg.rapo and cfg.use_probes:
        raise ValueError("DemoConfig.rapo needs use_probes = False (RAPO has no probes)")
    rollout_cfg = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, max_obs_tokens=500,
                                max_context=cfg.max_context, topk=cfg.topk, temperature=cfg.temperature,
                                probes=cfg.use_probes, revision_prob=cfg.revision_prob)
    n_rows = cfg.num_questions * cfg.group_size
    rapo_kw = {}
    if cfg.rapo:
        from rexrag_jax.rapo.hook import RapoConfig
        from rexrag_jax.rapo.hybrid_rollout import DEFAULT_PROMPT_NOTE, HybridConfig
        from rexrag_jax.rapo.trainer import HybridSearchRollout

        rapo_cfg = RapoConfig()
        rollout = HybridSearchRollout(tokenizer_path=warm["tok_path"], retriever=warm["retriever"], config=rollout_cfg,
                                      hybrid=HybridConfig(prompt_note=DEFAULT_PROMPT_NOTE if cfg.rapo_prompt_note else ""))
        rapo_kw = dict(eps_low=rapo_cfg.clip_eps, eps_high=rapo_cfg.clip_eps, kl_coef=rapo_cfg.kl_coef)
    else:
        rollout = SearchRollout(tokenizer_path=warm["tok_path"], retriever=warm["retriever"], config=rollout_cfg)
    train_cfg = TrainConfig(seed=seed, total_steps=cfg.rl_steps, num_questions=cfg.num_questions,
                            group_size=cfg.group_size, mini_batch=(-(-n_rows // cfg.micro_batch) + 1) * cfg.micro_batch,
                            micro_batch=cfg.micro_batch, max_seq_len=cfg.max_context + cfg.max_new_tokens,
                            length_bucket=cfg.length_bucket, use_probes=cfg.use_probes,
                            policy_correction=cfg.policy_correction,
                            initial_keep_ratio=cfg.initial_keep_ratio, checkpoint_every=max(1, cfg.rl_steps),
                            eval_every=0, logprob_chunk=0, temperature=cfg.temperature,
                            **({"kl_coef": cfg.kl_coef} | rapo_kw))
    opt_cfg = OptimizerConfig(learning_rate=cfg.rl_lr, warmup_fraction=0.0, total_steps=cfg.rl_steps)
    kw = dict(model_cfg=warm["model_cfg"], rollout=rollout, config=train_cfg, optimizer=opt_cfg,
              train_examples=warm["world"].train, init_checkpoint=warm["warm_dir"])
    if cfg.rapo:
        from rexrag_jax.rapo.trainer import RapoTrainer

        return RapoTrainer(rl_dir, rapo=rapo_cfg, trace_buffer_dir=build_rapo_buffer(cfg, warm, seed), **kw)
    return Trainer(rl_dir, **kw)


def run_demo(run_dir: str, seed: int = 0, cfg: DemoConfig | None = None, progress: bool = True,
             warm: dict | None = None) -> dict:
    """All phases (see the module docstring); returns the summary dict also written to summary.json.

    warm: the result of a previous run's `summary["warm_state"]` (same seed and config) to skip phases 1-6
    and start RL from the same warm-start policy (GRPO vs REX-RAG comparisons).
    """
    from tqdm.auto import tqdm

    from rexrag_jax.train.metrics_log import MetricsLogger

    cfg = cfg or DemoConfig()
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    t_all = time.perf_counter()
    times: dict[str, float] = {}
    if warm is None:
        warm = prepare_warm_start(run_dir, seed, cfg, progress, times)
    else:
        times.update({k: 0.0 for k in warm["times"]})  # reused, not recomputed
    world, model_cfg, evaluator, before = warm["world"], warm["model_cfg"], warm["evaluator"], warm["before"]

    _log("== rl")
    t_rl = time.perf_counter()
    trainer = make_rl_trainer(cfg, warm, os.path.join(run_dir, "rl"), seed)
    curve_set = _curve_examples(world.test, cfg.curve_examples)
    curve = []
    if cfg.curve_every:
        _, s0 = evaluate_split(evaluator, trainer.params, curve_set, None, False)
        curve.append({"step": 0, "em": s0.average})
    bar = tqdm(total=cfg.rl_steps, desc="RAPO" if cfg.rapo else "REX-RAG" if cfg.use_probes else "GRPO",
               disable=not progress)
    rl_log = []
    try:
        while trainer.step < cfg.rl_steps:
            m = trainer.train_step()
            trainer.logger.log(trainer.step, m)
            rl_log.append({k: m[k] for k in RL_LOG_KEYS if k in m})
            bar.update(1)
            bar.set_postfix(em_train=f"{m.get('em/train', float('nan')):.2f}", probes=m.get("probes/kept", 0))
            if cfg.curve_every and trainer.step % cfg.curve_every == 0:
                _, s = evaluate_split(evaluator, trainer.params, curve_set, None, False)
                curve.append({"step": trainer.step, "em": s.average})
                trainer.logger.log(trainer.step, {"val/em_curve": s.average})
            if cfg.rl_time_budget_s is not None and time.perf_counter() - t_rl > cfg.rl_time_budget_s:
                _log(f"   RL stopped by its time budget after {trainer.step} steps")
                break
        bar.close()
        trainer.save()
    finally:
        trainer.ckpt.close()
        trainer.logger.close()
    times["rl"] = time.perf_counter() - t_rl
    _log(f"   rl: {times['rl']:.1f}s ({trainer.step} steps)")

    _log("== eval_rl")
    t_ev = time.perf_counter()
    _, after = evaluate_split(evaluator, trainer.params, world.test, os.path.join(run_dir, "eval_rl.jsonl"), progress)
    logger = MetricsLogger(run_dir, use_tensorboard=True, stream=open(os.devnull, "w"))
    logger.log(trainer.step, {f"eval/em_{k}": v["em"] for k, v in after.per_source.items()}
               | {"eval/em_mean": after.average})
    logger.close()
    final_dir = export_policy(trainer.params, model_cfg, warm["tok_path"], os.path.join(run_dir, "final_model"))
    times["eval_rl"] = time.perf_counter() - t_ev
    _log(f"   eval_rl: {times['eval_rl']:.1f}s (EM {100 * after.average:.1f})")

    table, numbers = hop_table(before, after)
    total = time.perf_counter() - t_all
    summary = {"seed": seed, "config": dataclasses.asdict(cfg), "table": numbers,
               "margin_em_points": numbers["all"]["delta"], "rl_steps": trainer.step,
               "phase_seconds": {k: round(v, 1) for k, v in times.items()}, "total_seconds": round(total, 1),
               "sft_history": warm["sft_hist"], "rl_log": rl_log, "curve": curve,
               "probe_prior": warm.get("probe_prior"), "rl_diagnostics": rl_diagnostics(rl_log, cfg.initial_keep_ratio),
               "checkpoint_dir": os.path.join(run_dir, "rl", "checkpoints"), "final_model": final_dir,
               "warmstart_model": warm["warm_dir"], "warm_start_from": warm["run_dir"],
               "tensorboard": [os.path.join(run_dir, "tensorboard"), os.path.join(run_dir, "rl", "tensorboard")]}
    tmp = os.path.join(run_dir, ".summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(run_dir, "summary.json"))
    summary["table_text"] = table
    summary["warm_state"] = warm
    return summary


def rl_diagnostics(rl_log: list[dict], initial_keep_ratio: float | None = None) -> dict:
    """Run-level REX-RAG diagnostics from the per-step log: means over steps (NaN-free steps only) of the
    all-fail / rescued group shares, probe success (created, kept), α, err; and ρ at the start and end."""
    out = {}
    for k in ("groups/all_fail", "groups/rescued", "probes/success_created", "probes/success_kept", "alpha", "err",
              "probes/created", "probes/kept", "original/ratio_mean", "probe/ratio_mean",
              "ratio0/probe_prompt", "ratio0/probe_prompt_first", "ratio0/prompt_pos_weight"):
        vals = [r[k] for r in rl_log if k in r and r[k] == r[k]]
        out[k] = float(np.mean(vals)) if vals else None
    rho = [r["keep_ratio"] for r in rl_log if "keep_ratio" in r]
    out["keep_ratio_start"] = initial_keep_ratio
    out["keep_ratio_first"], out["keep_ratio_last"] = (rho[0], rho[-1]) if rho else (None, None)
    out["keep_ratio_min"] = min(rho) if rho else None
    return out


def _curve_examples(test, n):
    """n held-out questions spread evenly over the hop counts (a cheap learning-curve probe)."""
    by = {s: [e for e in test if e.data_source == s] for s in HOP_SOURCES}
    k = max(1, n // len(HOP_SOURCES))
    return [e for s in HOP_SOURCES for e in by[s][:k]]


def print_summary(summary: dict) -> None:
    _log("\n" + summary["table_text"])
    m = summary["margin_em_points"]
    verdict = "RL improved held-out EM" if m > 0 else "RL did NOT improve held-out EM"
    _log(f"\nmargin: EM after RL - EM after warm start = {m:+.1f} points on "
         f"{summary['table']['all']['n']} held-out questions ({verdict})")
    prior = summary.get("probe_prior")
    if prior:
        _log(f"probes at the warm start: probe success {100 * prior['probe_success']:.1f}% vs fresh-sample success "
             f"{100 * prior['fresh_success']:.1f}% ({prior['n_probes']} probes, {prior['n_fresh']} samples, "
             f"{prior['n_questions']} greedy-wrong held-out questions; unprompted reflection "
             f"{100 * prior['reflect_rate']:.1f}%)")
    d = summary.get("rl_diagnostics") or {}
    if d.get("groups/all_fail") is not None:
        _log(f"RL diagnostics (mean over steps): all-fail groups {100 * d['groups/all_fail']:.0f}%, rescued by a kept "
             f"probe {100 * (d['groups/rescued'] or 0):.0f}%, probe success created/kept "
             f"{_pct(d['probes/success_created'])}/{_pct(d['probes/success_kept'])}, keep ratio "
             f"{d['keep_ratio_start']:.3f} -> {d['keep_ratio_last']:.3f} (min {d['keep_ratio_min']:.3f})")
    _log(f"time: {summary['total_seconds']:.0f}s total; " + ", ".join(f"{k} {v:.0f}s"
                                                                    for k, v in summary["phase_seconds"].items()))
    _log(f"checkpoint: {summary['checkpoint_dir']}  exported policy: {summary['final_model']}")
    _log(f"tensorboard --logdir {os.path.dirname(os.path.dirname(summary['checkpoint_dir']))}")


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


# --- evaluation of an exported policy on any QA files -------------------------------------------------------
def eval_main(argv) -> int:
    """`rexrag demo eval`: `rexrag eval --data ... --checkpoint MODEL` with the demo's search settings
    (top-k and turns as in training, DemoConfig) as defaults; prints the 7-source EM table."""
    from rexrag_jax.evaluation import main as eval_cli

    p = argparse.ArgumentParser(prog="rexrag demo eval", description=eval_main.__doc__,
                                epilog="every other `rexrag eval` flag (--out, --limit, --corpus, --index_dir, "
                                       "--retriever_url, --max_new_tokens, ...) is passed through")
    p.add_argument("--model", required=True, help="HF-format policy dir (RUN/final_model or RUN/warmstart_model)")
    p.add_argument("--data", nargs="+", required=True, help="benchmark files or directories")
    p.add_argument("--topk", type=int, default=DemoConfig().topk,
                   help="passages per search (default: the demo's training value, DemoConfig.topk)")
    p.add_argument("--max_turns", type=int, default=DemoConfig().max_turns, help="search/answer turns per question")
    p.add_argument("--batch_size", type=int, default=32, help="questions per rollout batch")
    args, rest = conventional(p).parse_known_args(argv)  # `rexrag eval` checks the rest (a retriever is required there)
    return eval_cli.main(["--data", *args.data, "--checkpoint", args.model, "--topk", str(args.topk),
                          "--max-turns", str(args.max_turns), "--batch-size", str(args.batch_size), *rest])


# --- CLI ------------------------------------------------------------------------------------------------------
GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin")


def parse_config(gin_files: Sequence[str], gin_params: Sequence[str], quick: bool,
                 defaults: dict | None = None) -> DemoConfig:
    """gin/demo.gin (when present) + user files/bindings -> DemoConfig.

    Precedence, lowest first: DemoConfig's defaults and gin/demo.gin < `defaults` (a caller's own
    settings, e.g. the replication's) < the --quick sizes < the user's explicit bindings (their gin files
    and --gin_param), which always win. Which fields the user bound is read from gin itself (a parse of
    their files and bindings alone), not from the binding strings."""
    gin.clear_config()
    files = [f if os.path.exists(f) else os.path.join(GIN_DIR, f) for f in gin_files]
    default = os.path.join(GIN_DIR, "demo.gin")
    if os.path.exists(default) and not gin_files:
        files = [default]
    overrides = {**(defaults or {}), **(QUICK_OVERRIDES if quick else {})}
    explicit = set()
    if overrides:  # gin/demo.gin's bindings are not the user's: they do not block the overrides
        gin.parse_config_files_and_bindings(files if gin_files else [], list(gin_params), finalize_config=False)
        explicit = {k for k in overrides if _gin_bound("DemoConfig", k)}
        gin.clear_config()
    gin.parse_config_files_and_bindings(files, list(gin_params), finalize_config=False)
    return dataclasses.replace(DemoConfig(), **{k: v for k, v in overrides.items() if k not in explicit})


def _gin_bound(configurable: str, field: str) -> bool:
    try:
        gin.query_parameter(f"{configurable}.{field}")
        return True
    except ValueError:
        return False


def enable_compile_cache() -> None:
    """Persistent XLA compile cache (a second demo run skips most compilation), unless one is set."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        path = os.environ.get("REXRAG_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rexrag_jax_xla"))
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        return eval_main(argv[1:])
    p = argparse.ArgumentParser(prog="rexrag demo", description=__doc__.split("\n")[0],
                                epilog="`rexrag demo eval --help`: evaluate an exported policy on QA files")
    p.add_argument("--run_dir", default="runs/demo", help="where the world, index, models, logs and exports go")
    p.add_argument("--seed", type=int, default=0, help="world + model seed (a new seed is a new synthetic world)")
    p.add_argument("--quick", action="store_true", help="~2-minute smoke version (tiny world, few steps)")
    p.add_argument("--gin_file", action="append", default=[], help="gin file(s) binding DemoConfig (default: gin/demo.gin)")
    p.add_argument("--gin_param", action="append", default=[], help="e.g. 'DemoConfig.rl_steps = 40'")
    p.add_argument("--no_progress", action="store_true", help="no progress bars")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished run dir, or one made with another configuration, whole")
    args = conventional(p).parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    enable_compile_cache()
    import logging
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        cfg = parse_config(args.gin_file, args.gin_param, args.quick)
    except (ValueError, TypeError, OSError) as e:
        print(f"rexrag demo: bad configuration: {e}", file=sys.stderr)
        return 2
    from rexrag_jax.io import run_dir as run_dirs
    from rexrag_jax.models.bert.hf_io import default_minilm_dir

    try:  # the embedded retriever's encoder: checked before anything is written or trained
        default_minilm_dir()
    except FileNotFoundError as e:
        print(f"rexrag demo: {e}", file=sys.stderr)
        return 2
    try:  # the demo has no mid-run resume: an unfinished run with the same configuration restarts whole
        run = run_dirs.prepare(args.run_dir, "demo", {"seed": args.seed, **dataclasses.asdict(cfg)},
                               overwrite=args.overwrite, prog="rexrag demo", on_unfinished="restart",
                               legacy_files=("summary.json", "world", "rl", "warmstart_model"))
    except run_dirs.RunDirError as e:
        print(f"rexrag demo: {e}", file=sys.stderr)
        return 2
    run.save_gin(resolved=(cfg,))
    summary = run_demo(args.run_dir, args.seed, cfg, progress=not args.no_progress)
    run.mark_finished(rl_steps=summary["rl_steps"])
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
