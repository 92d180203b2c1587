"""REX-RAG vs its ablations on the demo's synthetic worlds: GRPO, REX-RAG without the policy correction,
REX-RAG, from the same warm start per world, over several worlds, with a 95% confidence interval.

    python benchmarks/replication.py [--seeds 0 1 2] [--arms grpo rexrag_nocorr rexrag]
        [--run_root runs/replication] [--json_out docs/benchmarks/replication.json]
        [--gin_param 'DemoConfig.rl_steps = 30'] [--quick] [--overwrite]

Per world (seed = a new synthetic world + its own tokenizer, SFT warm start and probe-prior measurement):
  warm start   rexrag_jax.demo.prepare_warm_start (greedy held-out EM "before", probe vs fresh success)
  arms         the same warm start, the same questions per step, group size and number of RL steps:
                 grpo            no probes                                 (TrainConfig.use_probes = False)
                 rexrag_nocorr   probes, behaviour = π_old on every token  (TrainConfig.policy_correction = False)
                 rexrag          probes + the policy correction (SPEC §5)
                 rapo            RAPO (SPEC §8): hybrid rollouts from a static trace buffer that the world's
                                 solver with noise 0.3 builds before RL (16 samples per train question, top 5),
                                 half the rows of a group hybrid, clip 0.28, beta 0, per-sequence mean
                                 (demo.build_rapo_buffer, DemoConfig.rapo*)
  after        greedy held-out EM on the same questions (per hop count), and the per-step diagnostics
               (all-fail / rescued groups, probe success created / kept, ρ, α, err, ratio statistics)

The held-out set is DemoConfig.test_per_hop per hop count (default here 300: ~640 questions a world, the
1-hop pool holds ~105). Nothing is tuned on it: the world and settings are the demo's (gin/demo.gin).

Resume: results go to RUN_ROOT/results.json after every arm (and to --json_out); a killed run started
again with the same command skips finished worlds/arms and restarts the arm it was on. RUN_ROOT remembers
the code commit and the settings; another commit or other settings are refused unless --overwrite
(which starts RUN_ROOT afresh).

--warm_from OTHER_RUN_ROOT: a world whose warm start is not in RUN_ROOT yet takes a copy of OTHER_RUN_ROOT's
(finished, same warm-start settings) instead of training it again; the source and its commit are recorded.

--breakdown: read an existing RUN_ROOT and print, per world, warm start and arm, EM on trap / other
questions, how often the greedy policy writes a revision prompt itself, and searches per question (also
printed at the end of every run and stored per arm as "behaviour").

Statistics: paired differences (arm B - arm A on the same world and questions) with two 95% intervals,
  t over worlds          mean ± t_{n-1, 0.975} · sd / sqrt(n) of the per-world differences;
  bootstrap              worlds resampled with replacement, then questions within each world (2,000
                         draws, percentile interval): uses the question-level noise, not only n worlds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rexrag_jax import demo  # noqa: E402

ARMS = {"grpo": dict(use_probes=False), "rexrag_nocorr": dict(use_probes=True, policy_correction=False),
        "rexrag": dict(use_probes=True, policy_correction=True), "rapo": dict(use_probes=False, rapo=True)}
COMPARISONS = (("rexrag", "grpo"), ("rexrag", "rexrag_nocorr"), ("rexrag_nocorr", "grpo"), ("rapo", "grpo"))
# No time budgets: SFT runs all its steps and RL all its steps whatever the machine's load (the demo's 540 s
# SFT budget stops it early on a busy box, which made one world's warm start fail in an earlier run).
# 4 reading worlds and 15% self-reflection records (rexrag_jax/demo.py DemoConfig, docs/benchmarks/demo.md);
# 1600 SFT steps: with 4 reading worlds (12k records) the copying (reading the observation) forms late: world 0
# at 1200 steps read neither seen nor unseen facts (EM 20), world 1 at 1600 read both (EM 53).
REPLICATION_DEFAULTS = dict(test_per_hop=300, curve_every=0, rl_time_budget_s=None, sft_time_budget_s=None,
                            probe_prior_questions=200, sft_steps=1600,
                            reading_worlds=4,
                            # fifth pass: every trap revision record keeps its prompt in the loss (was 0.1),
                            # so the warm start's own reflection at a trap dead end is sampled at all (0.13 %
                            # at 0.1; dev world 7, not a reported one: self-reflection then appears after RL)
                            trap_reflect_share=1.0,
                            # third pass (issue 12): traps always fire in the warm-start records, so sampling
                            # escapes a trap only by the rare own reflection, and half the fired traps are
                            # revision records, twice the copy-across-the-prompt data of the second pass
                            trap_dead_end_prob=1.0, trap_revision_share=0.5,
                            # fourth pass: after the prompt a revision record re-issues the last query and
                            # walks on from its observation (no copy of a name across the prompt)
                            revision_continuation="research",
                            # eighth pass: the prior held in 2 of 5 worlds (probe/fresh 2.2, 4.1, 0.35, 0.41, 0.93):
                            # SFT goes on (up to 2 x 800 steps) until probe >= 2 x fresh on a dev world
                            prior_gate=2.0)
# two-sided 95% t quantiles, df 1..10 (beyond: 1.96 + 2.5/df, within 0.01)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BadInput(ValueError):
    pass


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.5 / df


def code_commit() -> str:
    """The last commit that touched the code a replication runs (package, gin files, this script);
    '+dirty' when those files have uncommitted changes."""
    paths = ["rexrag_jax", "gin", "benchmarks/replication.py", "setup.py"]
    try:
        sha = subprocess.run(["git", "log", "-1", "--format=%H", "--", *paths], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def parse_seeds(values) -> list[int]:
    seeds = []
    for v in values:
        try:
            s = int(v)
        except ValueError:
            raise BadInput(f"--seeds: {v!r} is not an integer (expected non-negative integers, e.g. --seeds 0 1 2)")
        if s < 0:
            raise BadInput(f"--seeds: {s} is negative (expected non-negative integers)")
        seeds.append(s)
    if len(set(seeds)) != len(seeds):
        raise BadInput(f"--seeds: {values} repeats a seed (each seed is one world)")
    return seeds


def parse_arms(values) -> list[str]:
    for a in values:
        if a not in ARMS:
            raise BadInput(f"--arms: unknown arm {a!r} (expected some of {', '.join(ARMS)})")
    if len(set(values)) != len(values):
        raise BadInput(f"--arms: {values} repeats an arm")
    return list(values)


def open_run_root(run_root: str, manifest: dict, overwrite: bool) -> dict:
    """RUN_ROOT's results so far (empty when new); refuses another commit or other settings unless overwrite."""
    path = os.path.join(run_root, "manifest.json")
    if os.path.exists(path) and not overwrite:
        with open(path) as f:
            old = json.load(f)
        for key in ("commit", "config"):
            if old.get(key) != manifest[key]:
                what = "code commit" if key == "commit" else "settings (DemoConfig)"
                raise BadInput(f"{run_root}: a replication run dir from another {what} ({key} differs: "
                               f"{str(old.get(key))[:60]} vs {str(manifest[key])[:60]}); use --overwrite to start "
                               f"it afresh or another --run_root")
    elif os.path.exists(run_root) and overwrite:
        shutil.rmtree(run_root)
    os.makedirs(run_root, exist_ok=True)
    _write_json(path, manifest)
    results_path = os.path.join(run_root, "results.json")
    if os.path.exists(results_path):
        with open(results_path) as f:
            return json.load(f)
    return {"worlds": []}


def step_costs(rl_log: list[dict]) -> dict:
    """Mean RL step time (s) and tool calls (executed searches) per trajectory over an arm's steps."""
    out = {}
    for name, key in (("step_seconds_mean", "time/step"), ("tool_calls_per_traj", "searches/mean")):
        vals = [r[key] for r in rl_log if key in r]
        out[name] = float(np.mean(vals)) if vals else None
    return out


# DemoConfig fields that only the RL arms read: a warm start made under other values is the same warm start
RL_ONLY_FIELDS = {"rl_steps", "num_questions", "group_size", "rl_lr", "micro_batch", "kl_coef", "use_probes",
                  "policy_correction", "revision_prob", "initial_keep_ratio", "rl_time_budget_s", "curve_every",
                  "curve_examples", "rapo", "rapo_buffer_noise", "rapo_buffer_n", "rapo_buffer_k", "rapo_prompt_note"}


def copy_warm_start(src_root: str, seed: int, warm_dir: str, cfg, results: dict):
    """--warm_from: copy SRC_ROOT/seed<seed>/warm into warm_dir when SRC_ROOT finished that warm start under
    the same warm-start settings; returns the loaded warm start, or None (then it is trained here)."""
    src = os.path.join(src_root, f"seed{seed}", "warm")
    try:
        with open(os.path.join(src_root, "manifest.json")) as f:
            other = json.load(f)
        with open(os.path.join(src_root, "results.json")) as f:
            done = any(w["seed"] == seed and "warm_start" in w for w in json.load(f)["worlds"])
    except (OSError, ValueError, KeyError):
        raise BadInput(f"--warm_from {src_root}: not a replication run root (manifest.json / results.json unreadable)")
    mine = dataclasses.asdict(cfg)
    differ = sorted(k for k in set(mine) | set(other["config"]) if k not in RL_ONLY_FIELDS
                    and other["config"].get(k, mine.get(k)) != mine.get(k))
    if differ:
        raise BadInput(f"--warm_from {src_root}: its warm starts were made with other settings ({', '.join(differ)})")
    if not done or not os.path.exists(os.path.join(src, "probe_prior.json")):
        return None
    tmp = warm_dir + ".copy"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(warm_dir, ignore_errors=True)
    os.replace(tmp, warm_dir)
    results.setdefault("warm_from", {})[str(seed)] = {"run_root": os.path.abspath(src_root), "commit": other["commit"]}
    return demo.load_warm_start(warm_dir, seed, cfg)


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def per_hop(table: dict, key: str) -> dict:
    return {k.replace("synth_", ""): v[key] for k, v in table.items() if k != "all"}


def question_em(path: str) -> dict[str, float]:
    with open(path) as f:
        return {r["id"]: float(r["em"]) for r in map(json.loads, f)}


def arm_question_em(world: dict, arm: str, run_root: str | None) -> dict[str, float]:
    """Per-question held-out EM of one arm: from its dump under run_root, else (or with run_root None)
    from the JSON's `question_em` ({"ids": [...], "em": [...]}, stored so that a results file alone (run
    dirs deleted, another machine) still gives the bootstrap)."""
    path = None if run_root is None else os.path.join(run_root, f"seed{world['seed']}", arm, "eval_rl.jsonl")
    if path is not None and os.path.exists(path):
        return question_em(path)
    q = world["arms"][arm].get("question_em")
    if q is None:
        raise BadInput(f"{path or 'results'}: no dump, and no question_em for world {world['seed']} arm {arm}")
    return dict(zip(q["ids"], map(float, q["em"])))


def packed_question_em(path: str) -> dict:
    em = question_em(path)
    ids = sorted(em)
    return {"ids": ids, "em": [em[i] for i in ids]}


def world_stats(worlds: list[dict], a: str, b: str) -> dict:
    """b - a over worlds (each has both arms): per-world differences, mean, 95% t interval over worlds."""
    diffs = [w["arms"][b]["em_after"] - w["arms"][a]["em_after"] for w in worlds]
    n = len(diffs)
    mean = float(np.mean(diffs))
    out = {"arms": f"{b} - {a}", "n_worlds": n, "per_world": diffs, "mean": mean}
    if n > 1:
        half = t975(n - 1) * float(np.std(diffs, ddof=1)) / math.sqrt(n)
        out["t_interval"] = [mean - half, mean + half]
    return out


def paired_stats(results: dict, a: str, b: str, run_root: str | None, draws: int = 2000,
                 seed: int = 0) -> dict | None:
    """b - a over the worlds that finished both arms: world_stats plus the bootstrap interval (worlds then
    questions; per-question EM from the dumps under run_root or the JSON, see arm_question_em)."""
    worlds = [w for w in results["worlds"] if a in w["arms"] and b in w["arms"]]
    if not worlds:
        return None
    out = world_stats(worlds, a, b)
    n = out["n_worlds"]
    per_q = []
    for w in worlds:
        ea, eb = arm_question_em(w, a, run_root), arm_question_em(w, b, run_root)
        ids = sorted(ea)
        per_q.append(100.0 * (np.array([eb[i] for i in ids]) - np.array([ea[i] for i in ids])))
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(draws):
        pick = rng.integers(n, size=n)
        boots.append(np.mean([per_q[i][rng.integers(len(per_q[i]), size=len(per_q[i]))].mean() for i in pick]))
    out["bootstrap_interval"] = [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]
    return out


def combine(paths: list[str], prior_min: float = 2.0) -> tuple[dict, list[str]]:
    """Worlds of several results files (e.g. two runs with different seeds) as one study: for each
    comparison, over all worlds and over the worlds whose warm start has the prior (probe / fresh success
    >= prior_min, measured before RL: a stated inclusion criterion, not a post-hoc one), the per-world
    differences, mean and 95% t interval; the bootstrap where every world has per-question EM."""
    worlds, sources = [], []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        for w in res["worlds"]:
            if any(w["seed"] == v["seed"] for v in worlds):
                raise BadInput(f"{path}: world {w['seed']} is also in an earlier file")
            worlds.append(w)
        sources.append({"path": path, "commit": res.get("commit"), "command": res.get("command"),
                        "seeds": [w["seed"] for w in res["worlds"]]})
    worlds.sort(key=lambda w: w["seed"])
    prior = [w for w in worlds if w.get("warm_start", {}).get("ratio", 0.0) >= prior_min]
    out = {"sources": sources, "prior_min": prior_min, "prior_worlds": [w["seed"] for w in prior], "comparisons": []}
    lines = [f"worlds {[w['seed'] for w in worlds]}; with the prior (probe/fresh >= {prior_min:g} at the warm "
             f"start): {out['prior_worlds']}"]
    for subset, ws in (("all", worlds), ("prior", prior)):
        for a, b in COMPARISONS:
            both = [w for w in ws if a in w["arms"] and b in w["arms"]]
            if not both:
                continue
            try:
                st = paired_stats({"worlds": both}, b, a, run_root=None)
            except BadInput:  # some world lacks per-question EM (an older results file): t interval only
                st = world_stats(both, b, a)
            st["subset"], st["seeds"] = subset, [w["seed"] for w in both]
            out["comparisons"].append(st)
            t, bs = st.get("t_interval"), st.get("bootstrap_interval")
            lines.append(f"{subset:>6} {st['arms']:>24}: {st['mean']:+5.1f} EM over {st['n_worlds']} world(s)"
                         + (f", 95% t [{t[0]:+.1f}, {t[1]:+.1f}]" if t else "")
                         + (f", bootstrap [{bs[0]:+.1f}, {bs[1]:+.1f}]" if bs else "")
                         + f"   per world {', '.join(f'{d:+.1f}' for d in st['per_world'])}")
    return out, lines


def behaviour_breakdown(world, trap_relations, eval_path: str, base_path: str | None = None) -> dict:
    """What the greedy held-out rollouts of `eval_path` do (in points / per question):
    em_trap / em_other   EM on questions whose chain has a trap relation after the first hop (the warm
                         start's dead ends) and on the others;
    self_reflect         share of responses in which the policy itself wrote a revision prompt of the pool
                         (REX-RAG pays off at test time only through this: no prompt is inserted there);
    searches_per_q       <search> calls per question;
    changed / fixed / broken  (with base_path, the warm start's dump) share of questions whose greedy response
                         differs from the warm start's, and of those turned right (EM 0 -> 1) / wrong (1 -> 0):
                         how far RL moved the greedy policy at all."""
    from rexrag_jax.data.warmstart import has_trap
    from rexrag_jax.rl.prompt_pool import DEFAULT_REVISION_PROMPTS

    phrases = [p.replace("<think>", "").strip()[:30] for p in DEFAULT_REVISION_PROMPTS]
    phrases.append("Perhaps I've overlooked")  # the revision prompt of rexrag_jax.data.warmstart's docstring
    by_id = {e.id: e for e in world.test}
    recs = [json.loads(line) for line in open(eval_path)]
    trap = np.array([has_trap(world, by_id[r["id"]], trap_relations) for r in recs], bool)
    em = np.array([r["em"] for r in recs], float)
    refl = np.array([any(p in r["response"] for p in phrases) for r in recs], bool)
    mean = lambda x: float(100 * x.mean()) if x.size else float("nan")  # noqa: E731
    out = {"em_trap": mean(em[trap]), "em_other": mean(em[~trap]), "n_trap": int(trap.sum()),
           "self_reflect": mean(refl), "em_when_self_reflecting": mean(em[refl]),
           "searches_per_q": float(np.mean([r["response"].count("<search>") for r in recs])) if recs else float("nan")}
    if base_path is not None and os.path.exists(base_path):
        base = {b["id"]: b for b in (json.loads(line) for line in open(base_path))}
        pairs = [(base[r["id"]], r) for r in recs if r["id"] in base]
        out["changed"] = mean(np.array([b["response"] != r["response"] for b, r in pairs], bool))
        out["fixed"] = mean(np.array([b["em"] < r["em"] for b, r in pairs], bool))
        out["broken"] = mean(np.array([b["em"] > r["em"] for b, r in pairs], bool))
    return out


def breakdown_lines(results: dict, run_root: str, cfg) -> list[str]:
    """Per world, warm start and arm: behaviour_breakdown of their held-out dumps (stored in results)."""
    from rexrag_jax.data.synthetic_world import generate_world
    from rexrag_jax.data.warmstart import pick_trap_relations

    lines = [f"{'world':>6} {'policy':>14} {'EM trap':>8} {'EM other':>9} {'self-reflect':>13} {'searches/q':>11} "
             f"{'changed (fixed/broken) vs warm start':>37}"]
    for w in results["worlds"]:
        world = generate_world(demo.world_config(cfg, w["seed"]))
        traps = pick_trap_relations(w["seed"], cfg.num_trap_relations)
        base = os.path.join(run_root, f"seed{w['seed']}")
        dumps = [("warm start", os.path.join(base, "warm", "eval_warmstart.jsonl"), w.setdefault("warm_start", {}))]
        dumps += [(a, os.path.join(base, a, "eval_rl.jsonl"), w["arms"][a]) for a in w["arms"]]
        for name, path, into in dumps:
            if not os.path.exists(path):
                continue
            b = into["behaviour"] = behaviour_breakdown(world, traps, path, None if name == "warm start" else dumps[0][1])
            moved = f"{b['changed']:9.1f}% ({b['fixed']:.1f}% / {b['broken']:.1f}%)" if "changed" in b else ""
            lines.append(f"{w['seed']:>6} {name:>14} {b['em_trap']:8.1f} {b['em_other']:9.1f} {b['self_reflect']:12.1f}% "
                         f"{b['searches_per_q']:11.2f} {moved:>37}")
    return lines


def summarize(results: dict, run_root: str, arms: list[str]) -> list[str]:
    lines = [f"{'world':>6} {'before':>7} " + " ".join(f"{a:>14}" for a in arms)
             + f" {'probe/fresh at warm start':>27}"]
    for w in results["worlds"]:
        ws = w.get("warm_start", {})
        row = f"{w['seed']:>6} {ws.get('em_before', float('nan')):7.1f} "
        row += " ".join(f"{w['arms'][a]['em_after']:14.1f}" if a in w["arms"] else f"{'-':>14}" for a in arms)
        if "probe_success" in ws:
            row += f" {100 * ws['probe_success']:11.1f}% / {100 * ws['fresh_success']:.1f}%"
        lines.append(row)
    lines.append("")
    results["comparisons"] = []
    for a, b in COMPARISONS:
        if a not in arms or b not in arms:
            continue
        st = paired_stats(results, b, a, run_root)
        if st is None:
            continue
        results["comparisons"].append(st)
        t = st.get("t_interval")
        lines.append(f"{st['arms']:>24}: {st['mean']:+5.1f} EM over {st['n_worlds']} world(s)"
                     + (f", 95% t over worlds [{t[0]:+.1f}, {t[1]:+.1f}]" if t else "")
                     + f", 95% bootstrap (worlds x questions) [{st['bootstrap_interval'][0]:+.1f}, "
                       f"{st['bootstrap_interval'][1]:+.1f}]   per world {', '.join(f'{d:+.1f}' for d in st['per_world'])}")
    for a in arms:
        cs = [w["arms"][a] for w in results["worlds"] if a in w["arms"]]
        f = lambda k: np.mean([c[k] for c in cs if c.get(k) is not None] or [np.nan])  # noqa: E731
        if cs:
            lines.append(f"{a:>24}: RL step {f('step_seconds_mean'):.2f} s, tool calls per trajectory "
                         f"{f('tool_calls_per_traj'):.2f} (mean over worlds)")
    for a in arms:
        ds = [w["arms"][a]["diagnostics"] for w in results["worlds"] if a in w["arms"]]
        if not ds or a in ("grpo", "rapo"):
            continue
        f = lambda k: np.nanmean([d[k] if d.get(k) is not None else np.nan for d in ds])  # noqa: E731
        lines.append(f"{a:>24}: all-fail groups {100 * f('groups/all_fail'):.0f}%, rescued {100 * f('groups/rescued'):.0f}%, "
                     f"probe success created {100 * f('probes/success_created'):.0f}% kept "
                     f"{100 * f('probes/success_kept'):.0f}%, keep ratio {f('keep_ratio_start'):.3f} -> "
                     f"{f('keep_ratio_last'):.3f} (min {f('keep_ratio_min'):.3f}), alpha {f('alpha'):.3f}, err {f('err'):.3f}, "
                     f"prompt-token ratio at the first update {f('ratio0/probe_prompt'):.3g} (first token "
                     f"{f('ratio0/probe_prompt_first'):.3g}), its gradient weight A*min(r, 1.2) {f('ratio0/prompt_pos_weight'):.3g}")
    return lines


def replication_config(args):
    """REPLICATION_DEFAULTS < --quick sizes (plumbing only) < the user's --gin_file/--gin_param bindings."""
    return demo.parse_config(args.gin_file, args.gin_param or [], args.quick, defaults=REPLICATION_DEFAULTS)


def run(args) -> int:
    seeds, arms = parse_seeds(args.seeds), parse_arms(args.arms)
    demo.enable_compile_cache()
    cfg = replication_config(args)
    command = " ".join(["python", "benchmarks/replication.py", *sys.argv[1:]]) if args.command is None else args.command
    manifest = {"commit": code_commit(), "config": dataclasses.asdict(cfg)}
    results = open_run_root(args.run_root, manifest, args.overwrite)
    results.update({"commit": manifest["commit"], "command": command, "config": manifest["config"],
                    "statistics": "paired differences; 95% t over worlds and 95% bootstrap over worlds then questions"})
    t_start = time.perf_counter()
    wall0 = results.get("wall_seconds", 0.0)

    def save():
        results["wall_seconds"] = wall0 + time.perf_counter() - t_start
        _write_json(os.path.join(args.run_root, "results.json"), results)
        if args.json_out:
            _write_json(args.json_out, results)

    for seed in seeds:
        world = next((w for w in results["worlds"] if w["seed"] == seed), None)
        if world is None:
            world = {"seed": seed, "arms": {}}
            results["worlds"].append(world)
        if all(a in world["arms"] for a in arms):
            continue
        base = os.path.join(args.run_root, f"seed{seed}")
        warm_dir = os.path.join(base, "warm")
        warm = None
        if os.path.exists(os.path.join(warm_dir, "warmstart_model", "config.json")):
            try:
                warm = demo.load_warm_start(warm_dir, seed, cfg)
            except (FileNotFoundError, ValueError):
                warm = None
        if warm is None and args.warm_from:
            warm = copy_warm_start(args.warm_from, seed, warm_dir, cfg, results)
        if warm is None:
            shutil.rmtree(warm_dir, ignore_errors=True)
            warm = demo.prepare_warm_start(warm_dir, seed, cfg, progress=False, times={})
        before = warm["before"]
        prior = warm["probe_prior"]
        world["warm_start"] = {"em_before": 100 * before.average, "n_heldout": before.num_examples,
                               "em_before_per_hop": {k.replace("synth_", ""): 100 * v["em"]
                                                     for k, v in before.per_source.items()},
                               **prior, "prior_gate": warm.get("prior_gate")}
        save()
        print(f"world {seed}: warm start EM {100 * before.average:.1f} on {before.num_examples} held-out; probe "
              f"success {100 * prior['probe_success']:.1f}% vs fresh {100 * prior['fresh_success']:.1f}%", flush=True)
        for arm in arms:
            if arm in world["arms"]:
                continue
            arm_dir = os.path.join(base, arm)
            shutil.rmtree(arm_dir, ignore_errors=True)  # an arm killed midway restarts from the warm start
            t0 = time.perf_counter()
            s = demo.run_demo(arm_dir, seed, dataclasses.replace(cfg, **ARMS[arm]), progress=False, warm=warm)
            world["arms"][arm] = {"em_before": s["table"]["all"]["em_warmstart"], "em_after": s["table"]["all"]["em_rl"],
                                  "n_heldout": s["table"]["all"]["n"],
                                  "em_before_per_hop": per_hop(s["table"], "em_warmstart"),
                                  "em_after_per_hop": per_hop(s["table"], "em_rl"), "rl_steps": s["rl_steps"],
                                  "seconds": round(time.perf_counter() - t0, 1), "diagnostics": s["rl_diagnostics"],
                                  **step_costs(s["rl_log"]), "rl_log": s["rl_log"],
                                  "question_em": packed_question_em(os.path.join(arm_dir, "eval_rl.jsonl"))}
            save()
            print(f"world {seed} {arm:>13}: EM {world['arms'][arm]['em_before']:.1f} -> {world['arms'][arm]['em_after']:.1f} "
                  f"({world['arms'][arm]['seconds']:.0f}s)", flush=True)
    lines = summarize(results, args.run_root, arms) + [""] + breakdown_lines(results, args.run_root, cfg)
    save()
    print("\n" + "\n".join(lines))
    print(f"\ntotal wall {results['wall_seconds']:.0f}s; results: {os.path.join(args.run_root, 'results.json')}"
          + (f", {args.json_out}" if args.json_out else ""))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="+", default=["0", "1", "2"])
    p.add_argument("--arms", nargs="+", default=list(ARMS))
    p.add_argument("--run_root", default="runs/replication")
    p.add_argument("--json_out", default=None, help="also write the results here (e.g. docs/benchmarks/replication.json)")
    p.add_argument("--quick", action="store_true", help="tiny worlds and 2 RL steps: tests the plumbing, not the effect")
    p.add_argument("--gin_file", action="append", default=[])
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--overwrite", action="store_true", help="start RUN_ROOT afresh (other commit or settings)")
    p.add_argument("--warm_from", default=None, help="copy finished warm starts from this replication run root "
                                                      "(same warm-start settings) instead of training them")
    p.add_argument("--breakdown", action="store_true",
                   help="only read RUN_ROOT (any commit): print EM on trap / other questions, self-reflection "
                        "and searches per question of every warm start and arm, from their held-out dumps")
    p.add_argument("--combine", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="only read these results files (other seeds each): paired differences over all their "
                        "worlds and over the worlds with the prior; with --json_out, written there")
    p.add_argument("--prior_min", type=float, default=2.0, help="--combine: probe / fresh success ratio at the "
                                                                 "warm start that counts as having the prior")
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.combine:
        try:
            out, lines = combine(args.combine, args.prior_min)
        except (BadInput, OSError, KeyError, json.JSONDecodeError) as e:
            print(f"replication: --combine: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        if args.json_out:
            _write_json(args.json_out, out)
        return 0
    if args.breakdown:
        with open(os.path.join(args.run_root, "results.json")) as f:
            results = json.load(f)
        print("\n".join(breakdown_lines(results, args.run_root, replication_config(args))))
        return 0
    try:
        return run(args)
    except BadInput as e:
        print(f"replication: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
