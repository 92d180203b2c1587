"""What the persistent XLA compilation cache saves on a launch's first step (issue 16 item 5).

    nice -n 19 python benchmarks/compile_cache.py                        # Qwen2.5-0.5B, fsdp=8, 4 programs
    nice -n 19 python benchmarks/compile_cache.py --presets qwen2.5-0.5b qwen2.5-3b --devices 8

The launch scripts point JAX_COMPILATION_CACHE_DIR at the run's bucket (launch/remote/start_train.sh), so
a restarted or preempted job, and every later job with the same programs, loads its executables instead of
compiling them. This script measures that on fake CPU devices: it compiles the trainer's and the rollout
engine's programs (the RL update step, the pi_old log-prob pass, the largest prefill chunk, a decode chunk;
benchmarks/aot_plan.py, abstract inputs, reference gin shapes) in a fresh process three times:

  - no cache              (JAX_COMPILATION_CACHE_DIR unset): today's first step without the cache;
  - cold cache            (an empty cache dir): the first launch, which also writes the entries;
  - warm cache            (the same dir, a new process): a restart.

It prints compile seconds per program (lowering excluded) for each, the cache's size, and the line
`compile cache: first-step compile X s -> Y s (Z% saved)`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_aot(preset: str, devices: int, programs, cache_dir: str | None, workdir: str) -> tuple[list[dict], float]:
    out = os.path.join(workdir, f"rows_{time.monotonic_ns()}.json")
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"   # as the launch scripts set it
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    cmd = [sys.executable, os.path.join(HERE, "aot_plan.py"), "--presets", preset, "--devices", str(devices),
           "--programs", *programs, "--json", out, "--no_audit_table"]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(out) as f:
        return json.load(f), wall


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b"])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--programs", nargs="+", default=["update", "logprob", "prefill", "decode"])
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="compile_cache_")
    results = []
    try:
        for preset in args.presets:
            cache = os.path.join(work, f"cache_{preset}")
            runs = {}
            for label, cdir in (("no cache", None), ("cold cache", cache), ("warm cache", cache)):
                rows, wall = _run_aot(preset, args.devices, args.programs, cdir, work)
                runs[label] = {"wall_s": wall, "programs": {r["program"]: r["compile_s"] for r in rows}}
            entries = len(os.listdir(cache)) if os.path.isdir(cache) else 0
            print(f"\n{preset}, fsdp={args.devices} (fake CPU devices): compile seconds per program (lowering excluded)")
            print(f"{'program':<10}" + "".join(f"{k:>12}" for k in runs))
            for prog in args.programs:
                print(f"{prog:<10}" + "".join(f"{runs[k]['programs'][prog]:>12.1f}" for k in runs))
            tot = {k: sum(v["programs"].values()) for k, v in runs.items()}
            print(f"{'total':<10}" + "".join(f"{tot[k]:>12.1f}" for k in runs))
            print(f"{'process':<10}" + "".join(f"{runs[k]['wall_s']:>12.1f}" for k in runs))
            size = _dir_bytes(cache) if os.path.isdir(cache) else 0
            saved = 100 * (1 - tot["warm cache"] / tot["no cache"])
            print(f"cache: {entries} entries, {size / 2**20:.1f} MiB; cold-cache overhead "
                  f"{tot['cold cache'] - tot['no cache']:+.1f} s")
            print(f"compile cache: first-step compile {tot['no cache']:.1f} s -> {tot['warm cache']:.1f} s "
                  f"({saved:.0f}% saved), {preset}")
            results.append({"preset": preset, "devices": args.devices, "runs": runs, "cache_entries": entries,
                            "cache_bytes": size, "saved_pct": saved})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
