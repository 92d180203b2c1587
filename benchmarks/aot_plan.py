"""AOT memory plan: compile the real programs with abstract inputs on fake CPU meshes, compare with `rexrag plan`.

    nice -n 19 python benchmarks/aot_plan.py                       # 0.5B/3B/7B x fsdp 8/16/32/64
    nice -n 19 python benchmarks/aot_plan.py --presets qwen2.5-0.5b --devices 8 --programs update

For each (model, mesh, program) it lowers and compiles, with jax.ShapeDtypeStruct inputs (nothing is
allocated), the program the trainer / rollout engine runs (rexrag_jax.train.aot: the RL update step, the
π_old log-prob pass, the largest prefill chunk and a decode chunk) at the batch and sequence lengths of
the reference gin files (gin/rexrag.gin + gin/model/<preset>.gin), and prints XLA's per-device
compiled.memory_analysis() (arguments, outputs, aliased, temporaries; total = arg + out - alias + temp)
next to the planner's per-program prediction (rexrag_jax.train.planner.program_bytes) and the compile
time. It also runs the sharding audit (rexrag_jax.sharding.audit): parameter / optimizer-state inputs
over 1 MiB left fully replicated on an fsdp > 1 mesh, and the collectives per call and per layer.

Meshes are (data=1, fsdp=n, tensor=1) over n fake CPU devices (--xla_force_host_platform_device_count,
set before jax is imported). The reference MICRO_BATCH (8) cannot be split over more than 8
data-parallel devices (the trainer refuses it), so on n > 8 devices MICRO_BATCH = n, the smallest change
the trainer accepts (the log-prob pass takes MICRO_BATCH rows too).

Writes --json (docs/benchmarks/aot_plan.json): a list of {"model", "mesh", "program", "planner_bytes",
"xla_bytes", "compile_s", ...}. --xla_cache reuses the XLA figures of an earlier run's JSON (only the
planner column is recomputed; no compile).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT_DEVICES = (8, 16, 32, 64)
DEFAULT_PRESETS = ("qwen2.5-0.5b", "qwen2.5-3b", "qwen2.5-7b")
GIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gin")


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    p.add_argument("--devices", nargs="+", type=int, default=list(DEFAULT_DEVICES))
    p.add_argument("--programs", nargs="+", default=["update", "logprob", "prefill", "decode"])
    p.add_argument("--json", default="docs/benchmarks/aot_plan.json")
    p.add_argument("--xla_cache", help="JSON of an earlier run: reuse its XLA figures, recompute the planner")
    p.add_argument("--tensor", type=int, default=1, help="tensor axis size (fsdp = devices / tensor)")
    p.add_argument("--micro_batch", type=int, help="MICRO_BATCH (default: the gin value, raised to fsdp)")
    p.add_argument("--markdown", help="also write the rows as markdown tables (memory; collectives) to this file")
    p.add_argument("--no_audit_table", action="store_true", help="skip the per-program collectives tables")
    return p


def reference_inputs(preset: str, devices: int, tensor: int = 1, micro_batch: int | None = None):
    """PlanInputs and AotShapes of gin/rexrag.gin + gin/model/<preset>.gin on (1, devices / tensor, tensor)
    (MICRO_BATCH: micro_batch, else the gin value raised to the data-parallel size)."""
    from rexrag_jax.train import planner
    from rexrag_jax.train.aot import shapes_for_plan

    gins = [os.path.join(GIN_DIR, "rexrag.gin"), os.path.join(GIN_DIR, "model", f"{preset}.gin")]
    g = planner._gin_values(gins, [])
    fsdp = devices // tensor
    micro = micro_batch or max(int(g["MICRO_BATCH"]), fsdp)
    cfg = planner.Qwen2Config.from_preset(str(g["MODEL_PRESET"])).replace(
        dtype=str(g["dtype"]), param_dtype=str(g["param_dtype"]), remat=bool(g["remat"]))
    inp = planner.PlanInputs(cfg=cfg, preset=preset, mesh={"data": 1, "fsdp": fsdp, "tensor": tensor},
                             tpu=f"v5e-{devices}", max_seq_len=int(g["MAX_SEQ_LEN"]),
                             rollout_batch=int(g["ROLLOUT_BATCH"]), mini_batch=int(g["MINI_BATCH"]),
                             micro_batch=micro, reference_model=float(g["KL_COEF"]) > 0,
                             logprob_chunk=int(g["LOGPROB_CHUNK"]) or None,
                             cache_len=int(g["CACHE_LEN"]) if "CACHE_LEN" in g else None)
    return inp, shapes_for_plan(inp, planner.DECODE_CHUNK)


def markdown(rows) -> str:
    """The memory table and the collectives table of `rows` (GiB / MiB per device)."""
    G, M = 2 ** 30, 2 ** 20
    out = ["| model | mesh | program | argument | output | alias | temp | XLA total | planner | planner / XLA "
           "| planner before | compile s | replicated state > 1 MiB |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        out.append(f"| {r['model']} | {r['mesh']} | {r['program']} | {r['argument_bytes'] / G:.2f} | "
                   f"{r['output_bytes'] / G:.2f} | {r['alias_bytes'] / G:.2f} | {r['temp_bytes'] / G:.2f} | "
                   f"{r['xla_bytes'] / G:.2f} | {r['planner_bytes'] / G:.2f} | {r['ratio']:.2f} | "
                   f"{r['planner_v0_bytes'] / G:.2f} | {r['compile_s']:.1f} | "
                   f"{', '.join(r['replicated_state_over_1mib']) or 'none'} |")
    out += ["", "Collectives per program call (count / MiB) and per layer (count / MiB), from the compiled HLO:", "",
            "| model | mesh | program | all-gather | reduce-scatter | all-reduce | all-to-all | collective-permute "
            "| per layer: all-gather | per layer: all-reduce | per layer: reduce-scatter |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        c, ly = r["collectives_per_call"], r["collectives_per_layer"]
        cell = lambda d: f"{d['count']:,} / {d['bytes'] / M:,.0f}"  # noqa: E731
        out.append(f"| {r['model']} | {r['mesh']} | {r['program']} | " + " | ".join(
            cell(c[k]) for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"))
            + " | " + " | ".join(cell(ly[k]) for k in ("all-gather", "all-reduce", "reduce-scatter")) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    bad = [n for n in args.devices if n < 1 or n % args.tensor]
    if bad:
        print(f"aot_plan: --devices {bad}: expected positive multiples of --tensor {args.tensor}", file=sys.stderr)
        return 2
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={max(args.devices)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from rexrag_jax.sharding import audit, make_mesh
    from rexrag_jax.train import planner
    from rexrag_jax.train.aot import PROGRAMS, compile_and_audit

    unknown = [p for p in args.programs if p not in PROGRAMS]
    if unknown:
        print(f"aot_plan: --programs {unknown}: expected some of {PROGRAMS}", file=sys.stderr)
        return 2
    cache = {}
    if args.xla_cache:
        with open(args.xla_cache) as f:
            cache = {(r["model"], r["mesh"], r["program"]): r for r in json.load(f)}
    rows = []
    GiB = 2 ** 30
    head = (f"{'model':14s} {'mesh':9s} {'program':8s} {'arg':>7s} {'out':>7s} {'alias':>7s} {'temp':>8s} "
            f"{'XLA total':>9s} {'planner':>8s} {'ratio':>6s} {'compile':>8s}  replicated inputs > 1 MiB")
    print(head + "\n" + "-" * len(head), flush=True)
    for preset in args.presets:
        for n in args.devices:
            inp, shapes = reference_inputs(preset, n, args.tensor, args.micro_batch)
            est = planner.program_bytes(inp)
            mesh_name = f"fsdp={n // args.tensor}" + (f",tensor={args.tensor}" if args.tensor > 1 else "")
            if args.micro_batch:
                mesh_name += f",micro={args.micro_batch}"
            mesh = None
            for prog in args.programs:
                key = (preset, mesh_name, prog)
                if key in cache:
                    r = dict(cache[key])
                else:
                    if mesh is None:
                        mesh = make_mesh(1, n // args.tensor, args.tensor, devices=jax.devices()[:n])
                    res = compile_and_audit(prog, inp.cfg, mesh, shapes)
                    m = res["memory"]
                    r = {"model": preset, "mesh": mesh_name, "program": prog, "xla_bytes": m["total"],
                         "compile_s": round(res["compile_s"], 2), "argument_bytes": m["argument"],
                         "output_bytes": m["output"], "alias_bytes": m["alias"], "temp_bytes": m["temp"],
                         "replicated_over_1mib": [x.path for x in res["replicated"]],
                         "replicated_state_over_1mib": [x.path for x in res["replicated_state"]],
                         "collectives_per_call": res["collectives"]["per_call"],
                         "collectives_per_layer": res["collectives"]["per_layer"],
                         "micro_batch": shapes.micro_batch, "engine_rows": shapes.engine_rows,
                         "engine_len": shapes.engine_len}
                    if not args.no_audit_table:
                        print(audit.format_collectives(res["collectives"], f"  collectives: {preset} {mesh_name} {prog}"))
                        print(audit.format_ops(res["ops"], 5), flush=True)
                    del res
                r["planner_bytes"] = int(est[prog])
                r["planner_v0_bytes"] = int(planner.program_bytes_v0(inp)[prog])
                r["ratio"] = round(r["planner_bytes"] / r["xla_bytes"], 3)
                rows.append(r)
                print(f"{preset:14s} {mesh_name:9s} {prog:8s} {r['argument_bytes'] / GiB:7.2f} "
                      f"{r['output_bytes'] / GiB:7.2f} {r['alias_bytes'] / GiB:7.2f} {r['temp_bytes'] / GiB:8.2f} "
                      f"{r['xla_bytes'] / GiB:9.2f} {r['planner_bytes'] / GiB:8.2f} {r['ratio']:6.2f} "
                      f"{r['compile_s']:7.1f}s  {len(r['replicated_state_over_1mib'])} state, "
                      f"{len(r['replicated_over_1mib'])} all", flush=True)
                if args.json:
                    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))
    within = [r for r in rows if abs(r["ratio"] - 1) <= 0.15]
    print(f"\nplanner within ±15% of XLA's per-device total: {len(within)}/{len(rows)} configurations (GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
