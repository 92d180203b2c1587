"""Sharding audit of a compiled program: replicated big inputs, and the collectives in its HLO.

    compiled = jax.jit(f).lower(*abstract_args).compile()
    bad = replicated_inputs(compiled, args, min_bytes=1 << 20)     # [] on a healthy fsdp mesh
    ops = collectives(compiled.as_text())                        # one Collective per HLO instruction
    print(format_collectives(summarize(ops, num_layers=cfg.num_layers)))

replicated_inputs reads `compiled.input_shardings` (what XLA will actually expect, after propagation)
and names every input leaf of at least `min_bytes` whose sharding is fully replicated over a mesh
with more than one device.

collectives parses the HLO text: every all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute (synchronous, or the `-start` of an async pair), with its computation, the bytes of
its result (the sum over a tuple result) and how often it runs per program call. The execution count
of a computation is the sum over its call sites of the caller's count times the trip count of the
while loop it is the body of (XLA's `known_trip_count`; 1 for other calls). Bytes are those of the
result buffer: the whole gathered / reduced array for all-gather and all-reduce, one shard for
reduce-scatter, the exchanged buffer for all-to-all and collective-permute.

Per layer: an instruction inside a while loop whose trip count equals the model's number of layers
(the layer scan of training and the fori_loop of the cached forward) runs once per layer; its
per-execution count and bytes are the per-layer figures.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import jax

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
               "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
               "c64": 8, "c128": 16, "token": 0}

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class ReplicatedInput:
    path: str
    shape: tuple
    dtype: str
    nbytes: int


def _nbytes(shape, dtype) -> int:
    import numpy as np
    return int(math.prod(shape) * np.dtype(dtype).itemsize)


def replicated_inputs(compiled, args, min_bytes: int = 1 << 20, arg_names=None) -> list[ReplicatedInput]:
    """Input leaves of `args` (the positional arguments the program was lowered with: arrays or
    ShapeDtypeStructs) of >= min_bytes that the compiled program takes fully replicated. Paths start
    with arg_names[i] (else the argument index). Single-device shardings never count."""
    in_sh = compiled.input_shardings[0]
    flat_args, _ = jax.tree_util.tree_flatten_with_path(tuple(args))
    # an argument the program does not use is pruned: its sharding is None (kept as a leaf here)
    flat_sh = jax.tree_util.tree_flatten(
        in_sh, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))[0]
    if len(flat_args) != len(flat_sh):
        raise ValueError(f"replicated_inputs: {len(flat_args)} input leaves but {len(flat_sh)} input shardings; "
                         "pass the exact positional arguments the program was lowered with")
    out = []
    for (path, a), sh in zip(flat_args, flat_sh):
        if sh is None or len(sh.device_set) <= 1:
            continue
        n = _nbytes(a.shape, a.dtype)
        if n >= min_bytes and sh.is_fully_replicated:
            head, rest = path[0].idx, jax.tree_util.keystr(path[1:])
            name = arg_names[head] if arg_names and head < len(arg_names) else f"[{head}]"
            out.append(ReplicatedInput(name + rest, tuple(a.shape), str(a.dtype), n))
    return out


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str            # one of KINDS
    name: str            # HLO instruction name
    computation: str     # the computation holding it
    result_bytes: int    # bytes of the result buffer(s) of one execution
    executions: int      # executions per program call
    trips: tuple         # trip counts of the enclosing while loops, outermost first (-1: not known)
    op_name: str = ""    # jax op_name metadata (where in the program it comes from)


def _shape_bytes(text: str) -> int:
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def parse_hlo(text: str):
    """{computation: [(instruction name, result type text, opcode, rest of line)]}, entry name."""
    comps: dict[str, list] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            # headers start at column 0 ("[ENTRY ]%name (params) -> type {"); instructions are indented
            if line[:1] not in ("", " ", "\t") and line.rstrip().endswith("{") and "->" in line:
                m = _COMP_RE.match(line.strip())
                if m:
                    current = m.group(2)
                    comps[current] = []
                    if m.group(1):
                        entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR_RE.match(line)
        if m:
            comps[current].append((m.group(2), m.group(3), m.group(4), m.group(5)))
    if entry is None:
        raise ValueError("parse_hlo: no ENTRY computation in the HLO text")
    return comps, entry


def _callees(opcode: str, rest: str, unknown_trip: int = 1):
    """(callee, multiplier) pairs of one instruction."""
    out = []
    if opcode == "while":
        trip = _TRIP_RE.search(rest)
        n = int(trip.group(1)) if trip else unknown_trip
        body = re.search(r"body=%?([\w.\-]+)", rest)
        cond = re.search(r"condition=%?([\w.\-]+)", rest)
        if body:
            out.append((body.group(1), n, n if trip else -1))
        if cond:
            out.append((cond.group(1), n + 1, None))
        return out
    for key in ("calls", "to_apply", "true_computation", "false_computation"):
        for m in re.finditer(rf"\b{key}=%?([\w.\-]+)", rest):
            out.append((m.group(1), 1, None))
    m = re.search(r"branch_computations=\{([^}]*)\}", rest)
    if m:
        out += [(c.strip().lstrip("%"), 1, None) for c in m.group(1).split(",") if c.strip()]
    return out


def collectives(hlo_text: str, unknown_trip: int = 1) -> list[Collective]:
    """Every collective instruction of the HLO module text with its per-call execution count.

    A while loop without a known trip count (lax.while_loop with a data-dependent exit, e.g. the decode
    chunk's early stop) counts `unknown_trip` iterations (pass its upper bound) and shows as -1 in `trips`."""
    comps, entry = parse_hlo(hlo_text)
    execs: dict[str, int] = defaultdict(int)
    trips: dict[str, tuple] = {}
    execs[entry], trips[entry] = 1, ()
    # Computations are printed callees first; walk from the entry in reverse print order (callers first).
    order = list(comps)[::-1]
    if order and order[0] != entry:
        order.remove(entry)
        order.insert(0, entry)
    for comp in order:
        if execs.get(comp, 0) == 0:
            continue
        for _, _, opcode, rest in comps[comp]:
            for callee, mult, trip in _callees(opcode, rest, unknown_trip):
                if callee not in comps:
                    continue
                execs[callee] += execs[comp] * mult
                trips.setdefault(callee, trips[comp] + ((trip,) if trip is not None else ()))
    out = []
    for comp, instrs in comps.items():
        for name, rtype, opcode, rest in instrs:
            kind = opcode[:-6] if opcode.endswith("-start") else opcode
            if kind not in KINDS or opcode.endswith("-done"):
                continue
            nbytes = _shape_bytes(rtype)
            if opcode.endswith("-start"):  # async: ((operands), results, ...) tuple; count the results
                parts = re.findall(r"[a-z][a-z0-9]*\[[0-9,]*\]", rtype)
                nbytes = max((_shape_bytes(p) for p in parts), default=0) if kind != "all-reduce" else nbytes // 2
            op = re.search(r'op_name="([^"]*)"', rest)
            out.append(Collective(kind, name, comp, nbytes, execs.get(comp, 0), trips.get(comp, ()),
                                  op.group(1) if op else ""))
    return out


def summarize(ops: list[Collective], num_layers: int | None = None) -> dict:
    """Totals per kind: per program call (count, bytes), and per layer (instructions in a loop whose trip
    count is num_layers: count and bytes of one execution, i.e. of one layer)."""
    per_call = {k: {"count": 0, "bytes": 0} for k in KINDS}
    per_layer = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for op in ops:
        per_call[op.kind]["count"] += op.executions
        per_call[op.kind]["bytes"] += op.executions * op.result_bytes
        if num_layers and num_layers in op.trips:
            per_layer[op.kind]["count"] += 1
            per_layer[op.kind]["bytes"] += op.result_bytes
    return {"per_call": per_call, "per_layer": per_layer, "instructions": len(ops)}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_collectives(summary: dict, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"  {'collective':20s} {'per call: count':>16s} {'MiB':>12s} {'per layer: count':>17s} {'MiB':>10s}")
    for k in KINDS:
        c, layer = summary["per_call"][k], summary["per_layer"][k]
        lines.append(f"  {k:20s} {c['count']:16,d} {_mib(c['bytes']):>12s} {layer['count']:17,d} "
                     f"{_mib(layer['bytes']):>10s}")
    return "\n".join(lines)


def format_ops(ops: list[Collective], top: int = 12) -> str:
    """The instructions moving the most bytes per call (where the traffic comes from)."""
    ranked = sorted(ops, key=lambda o: -o.executions * o.result_bytes)[:top]
    lines = [f"  {'kind':18s} {'MiB/exec':>10s} {'execs':>7s} {'MiB/call':>11s}  loops      op"]
    for o in ranked:
        src = "/".join(o.op_name.split("/")[-2:]) if o.op_name else o.name
        where = "transpose" if "transpose(" in o.op_name else ""
        lines.append(f"  {o.kind:18s} {_mib(o.result_bytes):>10s} {o.executions:7d} "
                     f"{_mib(o.executions * o.result_bytes):>11s}  {str(list(o.trips)):10s} {where} {src}")
    return "\n".join(lines)
