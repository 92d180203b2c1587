"""GRPO (no probes) vs REX-RAG at equal rollout budget on the demo's synthetic world, over seeds.

    python benchmarks/replication.py [--seeds 0 1 2] [--run_root runs/replication] [--quick]
                                     [--shared_warm_start | --warm_run RUNS/DEMO]
                                     [--gin_param 'DemoConfig.rl_steps = 30']
                                     [--json_out rep.json]

Per seed: one warm start (SFT) shared by both arms, then two RL runs from it with the same questions per
step, group size and step count (GRPO: DemoConfig.use_probes = False; REX-RAG: probes + policy correction),
greedy held-out EM before/after, and a learning curve (greedy EM on a fixed held-out subset every
`curve_every` steps). Equal rollout budget = the same number of original rollouts (questions x group size x
steps); REX-RAG's probes are extra continuations of failed originals, as in the paper.

Prints mean ± std (over seeds) of held-out EM for each arm, the difference REX-RAG - GRPO, and a table of
the curves (EM per step, mean over seeds).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rexrag_jax import demo  # noqa: E402


def run_arm(run_dir: str, seed: int, cfg: demo.DemoConfig, use_probes: bool, warm: dict | None) -> dict:
    arm_cfg = dataclasses.replace(cfg, use_probes=use_probes)
    return demo.run_demo(run_dir, seed, arm_cfg, progress=False, warm=warm)


def mean_std(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--run_root", default="runs/replication")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gin_file", action="append", default=[])
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--json_out")
    p.add_argument("--warm_run", help="a finished `rexrag demo` run dir (same config, seed of the first --seeds): "
                   "its warm start is used for every seed (implies --shared_warm_start)")
    p.add_argument("--shared_warm_start", action="store_true",
                   help="one warm start (world and SFT of the first seed) for every seed; the seeds then vary "
                        "only the RL (rollout sampling, question order): cheaper, measures RL variance only")
    args = p.parse_args(argv)
    demo.enable_compile_cache()
    cfg = demo.parse_config(args.gin_file, args.gin_param, args.quick)
    if not cfg.curve_every:
        cfg = dataclasses.replace(cfg, curve_every=max(1, cfg.rl_steps // 5))
    # Equal rollout budget: both arms run exactly rl_steps steps (a wall-clock budget would give the
    # cheaper GRPO arm more steps, or either arm fewer under load).
    cfg = dataclasses.replace(cfg, rl_time_budget_s=None)
    results = {"grpo": [], "rexrag": []}
    t0 = time.perf_counter()
    shared = None
    if args.warm_run:
        args.shared_warm_start = True
        shared = demo.load_warm_start(args.warm_run, args.seeds[0], cfg)
        print(f"warm start from {args.warm_run}: held-out EM {100 * shared['before'].average:.1f}", flush=True)
    for seed in args.seeds:
        base = os.path.join(args.run_root, f"seed{seed}")
        warm = shared
        for arm, probes in (("grpo", False), ("rexrag", True)):
            s = run_arm(os.path.join(base, arm), seed, cfg, probes, warm)
            warm = s["warm_state"]  # the second arm reuses the first arm's world, index and SFT policy
            if args.shared_warm_start:
                shared = warm
            row = {"seed": seed, "em_warmstart": s["table"]["all"]["em_warmstart"], "em_rl": s["table"]["all"]["em_rl"],
                   "per_hop": {k: v["em_rl"] for k, v in s["table"].items() if k != "all"},
                   "curve": s["curve"], "seconds": s["total_seconds"]}
            results[arm].append(row)
            print(f"seed {seed} {arm:7s}: EM warm start {row['em_warmstart']:.1f} -> after RL {row['em_rl']:.1f} "
                  f"({row['seconds']:.0f}s)", flush=True)

    g = mean_std([r["em_rl"] for r in results["grpo"]])
    x = mean_std([r["em_rl"] for r in results["rexrag"]])
    w = mean_std([r["em_warmstart"] for r in results["grpo"]])
    diffs = [b["em_rl"] - a["em_rl"] for a, b in zip(results["grpo"], results["rexrag"])]
    d = mean_std(diffs)
    print(f"\nheld-out EM over seeds {args.seeds} ({cfg.rl_steps} RL steps x {cfg.num_questions} questions x "
          f"{cfg.group_size} rollouts):")
    print(f"  warm start      {w[0]:5.1f} ± {w[1]:.1f}")
    print(f"  GRPO            {g[0]:5.1f} ± {g[1]:.1f}")
    print(f"  REX-RAG         {x[0]:5.1f} ± {x[1]:.1f}")
    print(f"  REX-RAG - GRPO  {d[0]:+5.1f} ± {d[1]:.1f}   (goal: >= +5)")
    print("\ncurve (greedy EM on the curve subset, mean over seeds):")
    steps = [c["step"] for c in results["grpo"][0]["curve"]]
    print(f"  {'step':>5}  {'GRPO':>6}  {'REX-RAG':>8}")
    for i, step in enumerate(steps):
        ge = statistics.mean(100 * r["curve"][i]["em"] for r in results["grpo"] if i < len(r["curve"]))
        xe = statistics.mean(100 * r["curve"][i]["em"] for r in results["rexrag"] if i < len(r["curve"]))
        print(f"  {step:>5}  {ge:6.1f}  {xe:8.1f}")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    if args.json_out:
        with open(args.json_out + ".tmp", "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "seeds": args.seeds, **results}, f, indent=2)
        os.replace(args.json_out + ".tmp", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
