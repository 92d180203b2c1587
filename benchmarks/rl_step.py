"""One RL step, measured: time split, real vs padded tokens, update MFU against this machine's GEMM peak.

    python benchmarks/rl_step.py --preset small                       # synthetic rollouts, demo batch shape
    python benchmarks/rl_step.py --demo_run runs/replication3/seed0/warm --config replication
    python benchmarks/rl_step.py --demo_run runs/demo --config demo     # a finished `rexrag demo` run dir

Two workloads, both through the real `Trainer.train_step` (rollout → π_old/π_ref passes → packed
mini-batch updates), after `--warmup` steps (compilation) and then `--steps` timed steps:
  * `--demo_run DIR`: the demo's RL trainer (`demo.make_rl_trainer`) from that run's warm-start policy,
    search rollouts on its world's retriever: the default demo's RL step as a user runs it.
  * `--preset P`: a random-init Qwen2 preset at the demo's batch shape (8 questions × 4 rollouts + probes,
    mini-batch 40, micro-batch 8), trajectories from `SyntheticRollout` with chunk lengths scaled by
    `--length_scale` (default 12: ~200 tokens each, a demo step's ~8k real tokens). Its rollout time is the
    synthetic generator's, not a policy's.
Model FLOPs: rexrag_jax/models/qwen2/flops.py (3 × forward on real tokens, no remat recompute). The GEMM
peak and read bandwidth are measured in the same run (benchmarks/_machine.py). Ends with
`update MFU X% (real tokens), padding Y%, step Z s`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _machine  # noqa: E402


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="random-init Qwen2 preset on synthetic rollouts (e.g. small)")
    ap.add_argument("--demo_run", default=None, help="a finished demo (or replication world's warm/) run dir")
    ap.add_argument("--config", default="demo", choices=["demo", "replication"],
                    help="the DemoConfig that --demo_run was made with (its world is checked against it)")
    ap.add_argument("--seed", type=int, default=0, help="the world seed of --demo_run")
    ap.add_argument("--length_scale", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no_pack", action="store_true", help="unpacked update/log-prob passes (the before)")
    ap.add_argument("--json_out", default=None)
    a = ap.parse_args(argv)
    if (a.preset is None) == (a.demo_run is None):
        ap.error("give exactly one of --preset or --demo_run")
    return a


def demo_config(name: str):
    from rexrag_jax import demo
    cfg = demo.DemoConfig()
    if name == "replication":
        from replication import REPLICATION_DEFAULTS
        cfg = dataclasses.replace(cfg, **REPLICATION_DEFAULTS)
    return cfg


def build_trainer(a, work: str):
    from rexrag_jax.train.trainer import Trainer, TrainConfig
    if a.demo_run:
        from rexrag_jax import demo
        cfg = demo_config(a.config)
        warm = demo.load_warm_start(a.demo_run, a.seed, cfg, evaluate=False)
        trainer = demo.make_rl_trainer(cfg, warm, work, a.seed)
        label = f"demo policy ({os.path.basename(os.path.normpath(a.demo_run))}, {a.config} config)"
    else:
        from rexrag_jax.models.qwen2.config import Qwen2Config
        from rexrag_jax.train.synthetic import SyntheticRollout, synthetic_examples
        from rexrag_jax import demo
        d = demo.DemoConfig()
        n_rows = d.num_questions * d.group_size
        cfg = TrainConfig(total_steps=a.warmup + a.steps + 1, num_questions=d.num_questions, group_size=d.group_size,
                          mini_batch=(-(-n_rows // d.micro_batch) + 1) * d.micro_batch, micro_batch=d.micro_batch,
                          max_seq_len=d.max_context + d.max_new_tokens, length_bucket=d.length_bucket,
                          kl_coef=d.kl_coef, initial_keep_ratio=d.initial_keep_ratio, logprob_chunk=0,
                          checkpoint_every=10 ** 6, eval_every=0)
        model_cfg = Qwen2Config.from_preset(a.preset)
        rollout = SyntheticRollout(vocab_size=min(512, model_cfg.vocab_size), probe_prob=0.6, correct_prob=0.3,
                                   length_scale=a.length_scale)
        trainer = Trainer(work, model_cfg=model_cfg, rollout=rollout, config=cfg,
                          train_examples=synthetic_examples(64), use_tensorboard=False)
        label = f"preset {a.preset} (random init, synthetic rollouts x{a.length_scale})"
    if a.no_pack:
        trainer.cfg = dataclasses.replace(trainer.cfg, pack_sequences=False)
    return trainer, label


def main(argv=None) -> int:
    a = _args(argv)
    from rexrag_jax.train import compile_watch
    compile_watch.install()
    machine = _machine.measure()
    peak, bw = machine["gemm_flops_per_s"], machine["read_bytes_per_s"]
    print(f"machine: fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s "
          f"({', '.join(f'{n}²: {v / 1e9:.0f}' for n, v in machine['gemm_per_size'].items())}), "
          f"read {bw / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory() as work:
        trainer, label = build_trainer(a, os.path.join(work, "rl"))
        print(f"workload: {label}; packing {'off' if a.no_pack else 'on'}")
        rows, compiles = [], []
        try:
            for i in range(a.warmup + a.steps):
                m = trainer.train_step()
                compiles.append(compile_watch.compilations())
                if i >= a.warmup:
                    rows.append(m)
                print(f"  step {i}{' (warm-up)' if i < a.warmup else ''}: {m['time/step']:.2f} s "
                      f"(rollout {m['time/rollout']:.2f}, logprob {m['time/logprob']:.2f}, update {m['time/update']:.2f}); "
                      f"{m['batch/trajectories']:.0f} traj, {m['tokens/real']:.0f} real / {m['tokens/padded']:.0f} "
                      f"slots; compilations so far {compiles[-1]}", flush=True)
        finally:
            trainer.ckpt.close()
    med = lambda k: statistics.median(float(r[k]) for r in rows)  # noqa: E731
    t_step, t_roll, t_lp, t_up = med("time/step"), med("time/rollout"), med("time/logprob"), med("time/update")
    real = sum(r["tokens/real"] for r in rows)
    slots = sum(r["tokens/padded"] for r in rows)
    flops = sum(r["perf/update_flops"] for r in rows)
    t_up_total = sum(r["time/update"] for r in rows)
    achieved = flops / t_up_total
    mfu = achieved / peak
    padding = 1 - real / slots
    new_compiles = compiles[-1] - compiles[min(2, len(compiles) - 1)]
    print(f"\nmedian over {len(rows)} steps: step {t_step:.2f} s = rollout {t_roll:.2f} + log-prob passes {t_lp:.2f} "
          f"+ update {t_up:.2f} s (+ {t_step - t_roll - t_lp - t_up:.2f} other)")
    print(f"tokens per step: real {real / len(rows):.0f}, padded slots {slots / len(rows):.0f} "
          f"(padding {100 * padding:.1f}%), log-prob slots {med('tokens/logprob_padded'):.0f}")
    print(f"update: {achieved / 1e9:.1f} GFLOP/s on real tokens (model FLOPs {flops / len(rows) / 1e9:.2f} G/step) "
          f"= {100 * mfu:.1f}% of the {peak / 1e9:.0f} GFLOP/s GEMM peak")
    print(f"compilations after step 3: {new_compiles}")
    print(f"update MFU {100 * mfu:.1f}% (real tokens), padding {100 * padding:.1f}%, step {t_step:.2f} s")
    if a.json_out:
        out = {"workload": label, "packing": not a.no_pack, "machine": machine, "step_s": t_step,
               "rollout_s": t_roll, "logprob_s": t_lp, "update_s": t_up, "real_tokens": real / len(rows),
               "padded_slots": slots / len(rows), "padding": padding, "update_flops_per_s": achieved, "mfu": mfu,
               "compilations_after_step3": new_compiles, "steps": [{k: v for k, v in r.items()
                                                                    if isinstance(v, (int, float))} for r in rows]}
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
