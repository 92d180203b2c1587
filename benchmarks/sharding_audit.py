"""Sharding audit of the compiled RL programs (update step, log-prob pass, prefill, decode chunk).

    nice -n 19 python benchmarks/sharding_audit.py --preset qwen2.5-0.5b --mesh data=1,fsdp=8,tensor=1
    nice -n 19 python benchmarks/sharding_audit.py --preset qwen2.5-7b --mesh fsdp=32 --programs update

Compiles each program with the project's shardings (rexrag_jax.train.aot: abstract inputs, nothing
allocated) on fake CPU devices and prints (rexrag_jax.sharding.audit):
  * every parameter / optimizer-state input of >= --min_mib MiB left fully replicated (must be none on an
    fsdp > 1 mesh; exit 1 otherwise);
  * the all-gathers, reduce-scatters, all-reduces, all-to-alls and collective-permutes of the compiled HLO
    per program call and per layer, with their bytes, and the instructions moving the most bytes.
Shapes: the reference gin files (gin/rexrag.gin + gin/model/<preset>.gin), MICRO_BATCH raised to the
data-parallel size when it is smaller (as benchmarks/aot_plan.py).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--mesh", default="data=1,fsdp=8,tensor=1")
    p.add_argument("--programs", nargs="+", default=["update", "logprob", "prefill", "decode"])
    p.add_argument("--min_mib", type=float, default=1.0)
    p.add_argument("--top", type=int, default=8, help="instructions listed per program")
    args = p.parse_args(argv)
    from rexrag_jax.train.planner import parse_mesh
    try:
        mesh_sizes = parse_mesh(args.mesh)
    except ValueError as e:
        print(f"sharding_audit: {e}", file=sys.stderr)
        return 2
    n = math.prod(mesh_sizes.values())
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import dataclasses

    from aot_plan import reference_inputs
    from rexrag_jax.sharding import audit, make_mesh
    from rexrag_jax.train.aot import PROGRAMS, compile_and_audit

    bad = [x for x in args.programs if x not in PROGRAMS]
    if bad:
        print(f"sharding_audit: --programs {bad}: expected some of {PROGRAMS}", file=sys.stderr)
        return 2
    dp = mesh_sizes["data"] * mesh_sizes["fsdp"]
    inp, shapes = reference_inputs(args.preset, dp * mesh_sizes["tensor"], mesh_sizes["tensor"])
    shapes = dataclasses.replace(shapes, micro_batch=max(shapes.micro_batch, dp), logprob_rows=max(shapes.logprob_rows, dp))
    mesh = make_mesh(mesh_sizes["data"], mesh_sizes["fsdp"], mesh_sizes["tensor"])
    failed = False
    print(f"sharding audit: {args.preset} on {dict(mesh.shape)}; MICRO_BATCH {shapes.micro_batch}, T {shapes.seq_len}, "
          f"engine {shapes.engine_rows} x {shapes.engine_len}")
    for prog in args.programs:
        res = compile_and_audit(prog, inp.cfg, mesh, shapes, min_replicated_bytes=int(args.min_mib * 2 ** 20))
        print(f"\n== {prog}: compiled in {res['compile_s']:.1f} s; {res['collectives']['instructions']} collective "
              "instructions (per call = one call of the program; per layer = one iteration of the layer loop)")
        if mesh_sizes["fsdp"] > 1:
            state = res["replicated_state"]
            print(f"  params / optimizer leaves >= {args.min_mib:g} MiB fully replicated: "
                  + (", ".join(f"{r.path} {r.shape} {r.nbytes / 2**20:.1f} MiB" for r in state) or "none"))
            failed |= bool(state)
        other = [r for r in res["replicated"] if r not in res["replicated_state"]]
        if other:
            print("  other inputs replicated: " + ", ".join(f"{r.path} {r.shape} {r.nbytes / 2**20:.1f} MiB"
                                                       for r in other))
        print(audit.format_collectives(res["collectives"]))
        print(audit.format_ops(res["ops"], args.top))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
