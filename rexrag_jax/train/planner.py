"""Memory plan per device: will this gin config fit this TPU slice with this mesh?

    rexrag plan --gin_file gin/rexrag.gin --gin_file gin/model/qwen2.5-3b.gin \
                --mesh data=1,fsdp=8,tensor=1 --tpu v5e-8

Everything is bytes per device, from shapes alone (nothing is allocated):

  parameters        Σ_leaf shard(leaf) · bytes(param_dtype); shard() divides each dim by the mesh axes
                    the sharding rules give it (rexrag_jax.sharding.rules.spec_for_shape, the same
                    function the trainer uses, so non-divisible dims stay replicated here too)
  AdamW moments     2 · shard(params) · bytes(param_dtype)   (optax keeps m and v in the params' dtype)
  reference policy  shard(params) · bytes(param_dtype), when the KL term is on (kl_coef > 0)
  gradients         shard(params) · bytes(param_dtype)  (one micro-batch's gradient)
                    + shard(params) · 4 when accumulating over > 1 micro-batch (float32 accumulator)
  activations       per micro-batch of b = ceil(MICRO_BATCH / (data·fsdp)) rows of T tokens (see
                    `activation_bytes`), with and without per-layer remat
  KV cache          (rollout) shard([L, B, S, KV, Hd]) · 2 (k and v) · bytes(dtype),
                    B = ROLLOUT_BATCH rows, S = MAX_SEQ_LEN
  decode logits     (rollout) ceil(B / (data·fsdp)) · V / tensor · 4

Two phases share the device (colocated rollout and training, weights and optimizer state stay resident):
  train peak   = params + moments + reference + gradients + activations(remat as configured)
  rollout peak = params + moments + reference + KV cache + decode logits
and the plan fits when max(train peak, rollout peak) <= HBM per device. XLA's own temporaries,
fragmentation and the compiled programs are not counted: keep some headroom (the table flags > 90%).

There is no separate float32 master copy: the params are the master weights. param_dtype="float32" with
dtype="bfloat16" is the mixed-precision setup (the model casts weights to bf16 where it uses them);
param_dtype="bfloat16" halves params, moments and gradients but updates bf16 weights directly, so steps
below bf16's resolution (~0.4% of a weight; RL learning rates of 1e-6 are far below it) round away. The
plan prints a warning for it.

gin: model gin files set `MODEL_PRESET = "qwen2.5-3b"`; run-type gin files set `MAX_SEQ_LEN`,
`ROLLOUT_BATCH` (trajectories per rollout step), `MINI_BATCH`, `MICRO_BATCH` (global counts). Files are
parsed with skip_unknown=True; command-line flags override or stand in for every value.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import types
from typing import Sequence

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.sharding.rules import LOGICAL_AXIS_RULES, MESH_AXES, spec_for_shape
from rexrag_jax.config.cli_style import conventional

GiB = 1024 ** 3

# HBM per JAX device (per chip; per TensorCore for v2/v3, which expose each core as a device).
HBM_GIB = {"v2": 8, "v3": 16, "v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
_TYPE_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

CACHE_LOGICAL_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
AOT_PROGRAMS = ("update", "logprob", "prefill", "decode")  # rexrag_jax.train.aot.PROGRAMS (jax-free here)


# ---- TPU types and meshes ---------------------------------------------------------------------------
def tpu_devices(tpu: str) -> tuple[str, int, float]:
    """'v5e-8' -> ("v5e", JAX devices, HBM GiB per device).

    Slice sizes count TensorCores for v2/v3/v4/v5p and chips for v5e/v6e. v4 and v5p chips are one
    (megacore) device holding 2 cores, so v4-8 has 4 devices; v2/v3 expose each core as a device.
    """
    gen, _, size = tpu.lower().partition("-")
    gen = _TYPE_ALIASES.get(gen, gen)
    if gen not in HBM_GIB or not size.isdigit() or int(size) <= 0:
        raise ValueError(f"--tpu {tpu!r} not understood; expected e.g. v4-8, v5e-8 (v5litepod-8), v5p-8, v6e-8 "
                         f"(generations: {', '.join(HBM_GIB)})")
    n = int(size)
    devices = n // 2 if gen in ("v4", "v5p") else n
    if devices < 1:
        raise ValueError(f"--tpu {tpu!r}: a {gen} slice counts TensorCores, 2 per chip; expected an even size")
    return gen, devices, float(HBM_GIB[gen])


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,fsdp=8,tensor=1' -> {"data": 1, "fsdp": 8, "tensor": 1} (missing axes are 1)."""
    mesh = {a: 1 for a in MESH_AXES}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: bad entry {part!r}; expected axis=size with axis in "
                             f"{MESH_AXES} and size >= 1, e.g. data=1,fsdp=8,tensor=1")
        mesh[name] = int(value)
    return mesh


def _fake_mesh(mesh: dict[str, int]):
    # spec_for_shape only reads mesh.shape, so no devices are needed to plan a 256-chip slice.
    return types.SimpleNamespace(shape=dict(mesh))


def shard_elements(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: dict[str, int],
                   rules=LOGICAL_AXIS_RULES) -> int:
    """Elements of one device's shard: Π_d ceil(shape[d] / Π mesh sizes of the axes dim d is split over)."""
    spec = spec_for_shape(logical_axes, shape, _fake_mesh(mesh), rules)
    total = 1
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        total *= -(-size // math.prod(mesh[a] for a in axes))
    return total


# ---- model sizes ------------------------------------------------------------------------------------
def _param_tables(cfg: Qwen2Config):
    # Same leaves as models.qwen2.model.param_shapes / PARAM_LOGICAL_AXES (kept here to stay import-light;
    # tests check both agree).
    L, D, H, KV, Hd, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.vocab_size)
    leaves = {
        "embed": ((V, D), ("vocab", "embed")),
        "attn_norm": ((L, D), ("layers", "norm")),
        "q_kernel": ((L, D, H, Hd), ("layers", "embed", "heads", "head_dim")),
        "q_bias": ((L, H, Hd), ("layers", "heads", "head_dim")),
        "k_kernel": ((L, D, KV, Hd), ("layers", "embed", "kv_heads", "head_dim")),
        "k_bias": ((L, KV, Hd), ("layers", "kv_heads", "head_dim")),
        "v_kernel": ((L, D, KV, Hd), ("layers", "embed", "kv_heads", "head_dim")),
        "v_bias": ((L, KV, Hd), ("layers", "kv_heads", "head_dim")),
        "o_kernel": ((L, H, Hd, D), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": ((L, D), ("layers", "norm")),
        "gate_kernel": ((L, D, F), ("layers", "embed", "mlp")),
        "up_kernel": ((L, D, F), ("layers", "embed", "mlp")),
        "down_kernel": ((L, F, D), ("layers", "mlp", "embed")),
        "final_norm": ((D,), ("norm",)),
    }
    if not cfg.tie_word_embeddings:
        leaves["lm_head"] = ((D, V), ("embed", "vocab"))
    return leaves


def param_count(cfg: Qwen2Config) -> int:
    """N = V·D + L·(2D + D·H·Hd + H·Hd + 2·(D·KV·Hd + KV·Hd) + H·Hd·D + 3·D·F) + D  (+ D·V if untied)."""
    return sum(math.prod(shape) for shape, _ in _param_tables(cfg).values())


def param_shard_elements(cfg: Qwen2Config, mesh: dict[str, int]) -> int:
    """Parameter elements held by one device under the sharding rules."""
    return sum(shard_elements(shape, axes, mesh) for shape, axes in _param_tables(cfg).values())


def _split(n: int, k: int) -> int:
    """Per-device size of a dim of n split k ways when divisible (the rules replicate it otherwise)."""
    return n // k if n % k == 0 else n


def activation_bytes(cfg: Qwen2Config, rows: int, seq_len: int, tensor: int = 1, remat: bool = False,
                     logprob_chunk: int | None = None) -> int:
    """Bytes kept for the backward pass of one micro-batch on one device (approximate, from the layer code).

    Per token and layer, with β = bytes(dtype), heads/mlp/vocab dims divided by `tensor` when divisible:
        a_layer = β·(4D + (2H + 2KV)·Hd + 3F) + (4 + β)·H·T
    (layer input, 2 normed inputs, post-attention residual; q,k,v and the attention output; gate, up,
    silu(gate)·up; softmax probabilities over T keys in float32 and cast to β).
        no remat: L · a_layer · rows · T
        remat:    (L · β·D + a_layer) · rows · T        (layer inputs + one layer recomputed at a time)
    plus float32 logits and their log-softmax, 2 · 4 · V per token over T tokens (or over
    `logprob_chunk` tokens when the log-prob pass is chunked).
    """
    b = DTYPE_BYTES[cfg.dtype]
    D, L = cfg.hidden_size, cfg.num_layers
    H, KV = _split(cfg.num_heads, tensor), _split(cfg.num_kv_heads, tensor)
    F, V = _split(cfg.intermediate_size, tensor), _split(cfg.vocab_size, tensor)
    per_layer = b * (4 * D + (2 * H + 2 * KV) * cfg.head_dim + 3 * F) + (4 + b) * H * seq_len
    tokens = rows * seq_len
    layers = (L * b * D + per_layer) * tokens if remat else L * per_layer * tokens
    logit_tokens = rows * (min(logprob_chunk, seq_len) if logprob_chunk else seq_len)
    return layers + 2 * 4 * V * logit_tokens


def kv_cache_bytes(cfg: Qwen2Config, batch: int, max_len: int, mesh: dict[str, int]) -> int:
    """One device's k and v: 2 · shard([L, B, S, KV, Hd]) · bytes(dtype) (B over data·fsdp, KV over tensor)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return 2 * shard_elements(shape, CACHE_LOGICAL_AXES, mesh) * DTYPE_BYTES[cfg.dtype]


# ---- the plan ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlanInputs:
    cfg: Qwen2Config
    preset: str
    mesh: dict[str, int]
    tpu: str
    max_seq_len: int
    rollout_batch: int
    mini_batch: int
    micro_batch: int
    reference_model: bool = True
    logprob_chunk: int | None = None
    cache_len: int | None = None  # engine KV slots: RolloutConfig.max_context + max_new_tokens (None: MAX_SEQ_LEN)
    prefill_chunk: int = 512      # GenerationEngine.prefill_chunk: tokens per append call (PREFILL_CHUNK)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    num_params: int
    devices: int
    hbm_bytes: int
    rows_per_device: int
    components: dict[str, int]  # name -> bytes per device
    train_peak: int
    rollout_peak: int

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.rollout_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm_bytes


def make_plan(inp: PlanInputs) -> MemoryPlan:
    cfg, mesh = inp.cfg, inp.mesh
    _, devices, hbm_gib = tpu_devices(inp.tpu)
    if math.prod(mesh.values()) != devices:
        raise ValueError(f"--mesh {mesh} has {math.prod(mesh.values())} devices but {inp.tpu} has {devices}")
    for name in ("max_seq_len", "rollout_batch", "mini_batch", "micro_batch"):
        if getattr(inp, name) <= 0:
            raise ValueError(f"{name.upper()} must be a positive integer, got {getattr(inp, name)}")
    if inp.mini_batch % inp.micro_batch:
        raise ValueError(f"MINI_BATCH ({inp.mini_batch}) must be a multiple of MICRO_BATCH ({inp.micro_batch})")
    pb = DTYPE_BYTES[cfg.param_dtype]
    shard = param_shard_elements(cfg, mesh)
    batch_ways = mesh["data"] * mesh["fsdp"]
    rows = -(-inp.micro_batch // batch_ways)
    act = {remat: activation_bytes(cfg, rows, inp.max_seq_len, mesh["tensor"], remat, inp.logprob_chunk)
           for remat in (False, True)}
    c = {
        "parameters": shard * pb,
        "adamw_moments": 2 * shard * pb,
        "reference_policy": shard * pb if inp.reference_model else 0,
        "gradients": shard * pb,
        "grad_accumulator": shard * 4 if inp.mini_batch > inp.micro_batch else 0,
        "activations_no_remat": act[False],
        "activations_remat": act[True],
        "kv_cache": kv_cache_bytes(cfg, inp.rollout_batch, inp.cache_len or inp.max_seq_len, mesh),
        "decode_logits": -(-inp.rollout_batch // batch_ways) * _split(cfg.vocab_size, mesh["tensor"]) * 4,
    }
    resident = c["parameters"] + c["adamw_moments"] + c["reference_policy"]
    train = resident + c["gradients"] + c["grad_accumulator"] + act[cfg.remat]
    rollout = resident + c["kv_cache"] + c["decode_logits"]
    return MemoryPlan(inp, param_count(cfg), devices, int(hbm_gib * GiB), rows, c, train, rollout)


# ---- per compiled program (compared with XLA's memory_analysis by benchmarks/aot_plan.py) ---------------
PREFILL_CHUNK = 512   # GenerationEngine.prefill_chunk default: the largest append chunk
DECODE_CHUNK = 16     # SearchRollout.decode_chunk default


def engine_rows(inp: PlanInputs) -> int:
    """GenerationEngine rows: required_batch_size(ROLLOUT_BATCH) = ROLLOUT_BATCH (probes reuse their row)."""
    return inp.rollout_batch


def engine_len(inp: PlanInputs) -> int:
    return inp.cache_len or inp.max_seq_len


def program_bytes_v0(inp: PlanInputs) -> dict[str, int]:
    """What the plan counted before per-program estimates, mapped onto the compiled programs: the update
    = parameters + moments + gradients + accumulator + activations; the log-prob pass = parameters (its
    activations were not modelled); prefill and decode = parameters + KV cache + decode logits."""
    c = make_plan(inp).components
    act = c["activations_remat"] if inp.cfg.remat else c["activations_no_remat"]
    upd = c["parameters"] + c["adamw_moments"] + c["gradients"] + c["grad_accumulator"] + act
    gen = c["parameters"] + c["kv_cache"] + c["decode_logits"]
    return {"update": upd, "logprob": c["parameters"], "prefill": gen, "decode": gen}


def _layer_kernel_bytes(cfg: Qwen2Config, tensor: int, nbytes: int) -> int:
    """One layer's 7 kernels gathered whole over fsdp (split over tensor where divisible)."""
    D, Hd = cfg.hidden_size, cfg.head_dim
    H, KV, F = (_split(cfg.num_heads, tensor), _split(cfg.num_kv_heads, tensor),
                _split(cfg.intermediate_size, tensor))
    return nbytes * (2 * D * H * Hd + 2 * D * KV * Hd + 3 * D * F)


def program_bytes(inp: PlanInputs) -> dict[str, int]:
    """Predicted per-device bytes (arguments + outputs - aliased + temporaries, as XLA's memory_analysis
    counts them; donated buffers once) of each compiled program (benchmarks/aot_plan.py compares them).

    With b rows per device, S = 4·b·H·T² (one float32 [b, H, T, T] attention-score buffer), W = one
    layer's kernels gathered whole in float32, E = the (tied) embedding / lm_head gathered whole in the
    compute dtype, P = the parameter shard in bytes, KV = the engine's k + v shard, G = decode logits:

      update   3·P (params + 2 moments) + micro-batch inputs
               + 3·P·4/pb (float32 gradient accumulator, one micro-batch's gradient, the update)
               + 4·S (scores, masked scores, softmax and its gradient of the layer being differentiated)
               + L·b·T·D·4 (the remat scan's saved layer inputs, float32) + W
      logprob  P + tokens + 3·S (forward: scores, masked, softmax) + W (the output table is not gathered
               whole: the vocab-parallel head, qwen2.model.vocab_parallel_head, keeps it split by rows;
               + E where the vocabulary does not divide by fsdp and the head keeps the parameter layout)
      prefill  P + KV + G + 3·A + 5·G + E + W + 3·b_e·C·D·2, A = 4·b_e·H·C·N (one float32 [b_e, H, C, N]
               score buffer of the append chunk: b_e = engine rows per device, C = PREFILL_CHUNK tokens,
               N = the engine's window; then the float32 logits copies as in decode, the gathered lm_head
               and one layer's kernels as in logprob, and three 16-bit [b_e, C, D] hidden buffers);
               the largest append covers every row, which kernels.prefill(all_rows=True) does without
               gathering rows (before it, replicated row indices made the partitioner all-gather the whole
               cache on every device: 3 float32 copies of all rows, 439 GiB at 0.5B fsdp=8)
      decode   P + KV + G + 2·KV (the while loop's copies of k and v) + 5·G + V·D·pb (the lm_head or
               tied embedding gathered whole over fsdp in the param dtype: what dominates at fsdp >= 128)

    The multiplicities (4·S, 3·S, 3·P) are the buffers XLA keeps live at the peak in the buffer assignment
    of these programs (XLA:CPU, which also upcasts bf16 gathers/scatters to float32; TPU not measured).
    Not modelled: decode with KV heads split over tensor > 1 (XLA:CPU takes the CPU-only decode attention
    path, whose flat [B, S*KV, Hd] view makes XLA copy the cache once more: up to 1.33x this estimate).
    """
    cfg, mesh = inp.cfg, inp.mesh
    pb = DTYPE_BYTES[cfg.param_dtype]
    ways, tensor = mesh["data"] * mesh["fsdp"], mesh["tensor"]
    P = param_shard_elements(cfg, mesh) * pb
    T, D, L = inp.max_seq_len, cfg.hidden_size, cfg.num_layers
    b = -(-inp.micro_batch // ways)
    H, V = _split(cfg.num_heads, tensor), _split(cfg.vocab_size, tensor)
    S = 4 * b * H * T * T
    W = _layer_kernel_bytes(cfg, tensor, 4)
    E = V * D * DTYPE_BYTES[cfg.dtype]
    n_micro = inp.mini_batch // inp.micro_batch
    inputs = n_micro * b * T * (4 + 1 + 1 + 4 + (4 if inp.reference_model else 0)) + n_micro * b * (4 + 1)
    update = 3 * P + inputs + 3 * (P // pb) * 4 + 4 * S + L * b * T * D * 4 + W
    if not cfg.remat:  # not measured: every layer's activations kept instead of its input (activation_bytes)
        update += (activation_bytes(cfg, b, T, tensor, False, inp.logprob_chunk)
                   - activation_bytes(cfg, b, T, tensor, True, inp.logprob_chunk))
    logprob = P + b * T * (4 + 1) + 3 * S + W
    if mesh["fsdp"] > 1 and cfg.vocab_size % (mesh["fsdp"] * (tensor if cfg.vocab_size % tensor == 0 else 1)):
        logprob += E  # the vocabulary does not split over fsdp: the table is gathered whole as before
    rows, slots = engine_rows(inp), engine_len(inp)
    kv = kv_cache_bytes(cfg, rows, slots, mesh)
    logits = -(-rows // ways) * V * 4
    b_e, C = -(-rows // ways), inp.prefill_chunk
    prefill = P + kv + logits + 3 * 4 * b_e * H * C * slots + 5 * logits + E + W + 3 * b_e * C * D * 2
    decode = P + kv + logits + 2 * kv + 5 * logits + V * D * pb  # + the lm_head / embedding gathered whole
    return {"update": update, "logprob": logprob, "prefill": prefill, "decode": decode}


def resident_extra_bytes(inp: PlanInputs) -> dict[str, int]:
    """Bytes resident on the device while each program runs that are not its arguments: the reference
    policy (KL term), the optimizer moments outside the update, and the engine's KV cache and logits
    outside the rollout (GenerationEngine allocates them once and keeps them for the whole run)."""
    cfg, mesh = inp.cfg, inp.mesh
    P = param_shard_elements(cfg, mesh) * DTYPE_BYTES[cfg.param_dtype]
    ref = P if inp.reference_model else 0
    ways = mesh["data"] * mesh["fsdp"]
    engine = (kv_cache_bytes(cfg, engine_rows(inp), engine_len(inp), mesh)
              + -(-engine_rows(inp) // ways) * _split(cfg.vocab_size, mesh["tensor"]) * 4)
    return {"update": ref + engine, "logprob": 2 * P + ref + engine, "prefill": 2 * P + ref,
            "decode": 2 * P + ref}


def program_peaks(inp: PlanInputs) -> dict[str, int]:
    """Device bytes while each program runs: program_bytes + resident_extra_bytes."""
    extra = resident_extra_bytes(inp)
    return {k: v + extra[k] for k, v in program_bytes(inp).items()}


def _with(inp: PlanInputs, **kw) -> PlanInputs:
    return dataclasses.replace(inp, **kw)


def smallest_fix(inp: PlanInputs, program: str, hbm_bytes: int, max_fsdp: int = 4096) -> str | None:
    """The smallest change that brings `program`'s device peak under hbm_bytes, as a sentence (None when
    it fits): remat, then a smaller MICRO_BATCH (update / log-prob pass), then fewer ROLLOUT_BATCH rows (the
    engine's KV cache), else the fsdp size that fits with everything else unchanged."""
    fits = lambda i: program_peaks(i)[program] <= hbm_bytes  # noqa: E731
    if fits(inp):
        return None
    ways = inp.mesh["data"] * inp.mesh["fsdp"]
    if program in ("update", "logprob"):
        if not inp.cfg.remat and fits(_with(inp, cfg=inp.cfg.replace(remat=True))):
            return "remat on (model_config.remat = True)"
        micro = inp.micro_batch
        while micro > ways and micro % 2 == 0 and inp.mini_batch % (micro // 2) == 0:
            micro //= 2
            if fits(_with(inp, micro_batch=micro)):
                return f"MICRO_BATCH = {micro}"
    # the engine's KV cache (an argument of prefill / decode, resident otherwise) scales with its rows
    lo, hi = 0, inp.rollout_batch // ways  # rows per batch shard
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(_with(inp, rollout_batch=mid * ways)):
            lo = mid
        else:
            hi = mid - 1
    if lo > 0:
        return (f"ROLLOUT_BATCH (= NUM_QUESTIONS x GROUP_SIZE, the engine's rows) <= {lo * ways}, "
                f"{inp.rollout_batch / (lo * ways):.1f}x fewer")
    fsdp = inp.mesh["fsdp"]
    while fsdp < max_fsdp:
        fsdp *= 2
        mesh = dict(inp.mesh, fsdp=fsdp)
        wider = _with(inp, mesh=mesh, micro_batch=max(inp.micro_batch, mesh["data"] * fsdp))
        if fits(wider):
            return f"fsdp={fsdp} ({fsdp * inp.mesh['data'] * inp.mesh['tensor']} devices)"
    return f"nothing up to fsdp={max_fsdp} fits: the program's own temporaries exceed the chip"


def undivided_leaves(cfg: Qwen2Config, mesh: dict[str, int], rules=LOGICAL_AXIS_RULES) -> list[str]:
    """Parameter leaves with a dim that its mesh axes do not divide (spec_for_shape then leaves that dim
    unsplit, e.g. Qwen2.5-0.5B's embed dim 896 on fsdp=256: every kernel is replicated over fsdp)."""
    out = []
    table = dict(rules)
    for name, (shape, axes) in _param_tables(cfg).items():
        spec = spec_for_shape(axes, shape, _fake_mesh(mesh), rules)
        for dim, (lname, size) in enumerate(zip(axes, shape)):
            target = table.get(lname) if lname else None
            want = tuple(a for a in ((target,) if isinstance(target, str) else tuple(target or ()))
                         if mesh.get(a, 1) > 1)
            got = spec[dim] if dim < len(spec) else None
            got = (got,) if isinstance(got, str) else tuple(got or ())
            lost = [a for a in want if a not in got]
            # an axis used by an earlier dim of the same leaf is not a loss
            used = {a for d in range(dim) for a in ((spec[d],) if isinstance(spec[d], str) else tuple(spec[d] or ()))}
            lost = [a for a in lost if a not in used]
            if lost:
                out.append(f"{name} dim {dim} ({lname}, {size}) not divisible by "
                           + " x ".join(f"{a}={mesh[a]}" for a in lost))
    return out


def format_programs(plan: MemoryPlan) -> list[str]:
    """Lines of the per-program table of format_plan (estimates calibrated on XLA's memory_analysis)."""
    inp = plan.inputs
    _, _, hbm = tpu_devices(inp.tpu)
    est, extra = program_bytes(inp), resident_extra_bytes(inp)
    lines = ["", f"  compiled programs (per device; program = XLA arguments + outputs - aliased + temporaries, "
                 "see program_bytes; + resident = state held meanwhile)",
             f"  {'program':9s} {'program':>12s} {'+ resident':>12s} {'peak':>12s}  verdict"]
    for prog in est:
        peak = est[prog] + extra[prog]
        share = peak / plan.hbm_bytes
        verdict = "fits" if share <= 0.9 else ("fits, tight (> 90%)" if share <= 1 else "DOES NOT FIT")
        lines.append(f"  {prog:9s} {est[prog] / GiB:8.2f} GiB {extra[prog] / GiB:8.2f} GiB {peak / GiB:8.2f} GiB  "
                     f"{share:6.1%} of {hbm:g} GiB: {verdict}")
        fix = smallest_fix(inp, prog, plan.hbm_bytes)
        if fix:
            lines.append(f"  {'':9s} smallest change that fits: {fix}")
    return lines


def max_rollout_rows(plan: MemoryPlan) -> int:
    """Largest ROLLOUT_BATCH whose rollout phase fits (0 if the resident state alone does not fit)."""
    inp = plan.inputs
    resident = plan.rollout_peak - plan.components["kv_cache"] - plan.components["decode_logits"]
    free = plan.hbm_bytes - resident
    ways = inp.mesh["data"] * inp.mesh["fsdp"]
    one = (kv_cache_bytes(inp.cfg, ways, inp.cache_len or inp.max_seq_len, inp.mesh)
           + _split(inp.cfg.vocab_size, inp.mesh["tensor"]) * 4)  # one row per batch shard
    return max(0, free // one) * ways if free > 0 else 0


def plan_to_dict(plan: MemoryPlan) -> dict:
    inp = plan.inputs
    return {"preset": inp.preset, "tpu": inp.tpu, "mesh": inp.mesh, "devices": plan.devices,
            "num_params": plan.num_params, "param_dtype": inp.cfg.param_dtype, "dtype": inp.cfg.dtype,
            "remat": inp.cfg.remat, "max_seq_len": inp.max_seq_len, "rollout_batch": inp.rollout_batch,
            "mini_batch": inp.mini_batch, "micro_batch": inp.micro_batch, "hbm_bytes": plan.hbm_bytes,
            "bytes_per_device": dict(plan.components), "train_peak": plan.train_peak,
            "rollout_peak": plan.rollout_peak, "fits": plan.fits, "max_rollout_rows": max_rollout_rows(plan)}


def _gib(n: int) -> str:
    return f"{n / GiB:10.2f} GiB"


def format_plan(plan: MemoryPlan) -> str:
    inp, cfg, c = plan.inputs, plan.inputs.cfg, plan.components
    gen, _, hbm = tpu_devices(inp.tpu)
    mesh = " ".join(f"{k}={v}" for k, v in inp.mesh.items())
    pdt, adt = cfg.param_dtype, cfg.dtype
    used = "remat" if cfg.remat else "no remat"
    rows = [
        ("parameters", f"{pdt}", c["parameters"]),
        ("AdamW moments", f"2 x {pdt}", c["adamw_moments"]),
        ("reference policy", "KL term" if c["reference_policy"] else "(no KL term)", c["reference_policy"]),
        ("gradients", f"{pdt}, one micro-batch", c["gradients"]),
        ("grad accumulator", "float32" if c["grad_accumulator"] else "(no accumulation)", c["grad_accumulator"]),
        ("activations, no remat", f"{plan.rows_per_device} rows/device x {inp.max_seq_len}, {adt}"
         + ("  <- used" if not cfg.remat else ""), c["activations_no_remat"]),
        ("activations, remat", f"{plan.rows_per_device} rows/device x {inp.max_seq_len}, {adt}"
         + ("  <- used" if cfg.remat else ""), c["activations_remat"]),
        ("KV cache (rollout)", f"{inp.rollout_batch} rows x {inp.max_seq_len}, {adt}", c["kv_cache"]),
        ("decode logits (rollout)", "float32", c["decode_logits"]),
    ]
    lines = [
        f"memory plan: {inp.preset} on {inp.tpu} ({plan.devices} devices, {hbm:g} GiB HBM each; mesh {mesh})",
        f"  {plan.num_params:,} parameters ({plan.num_params / 1e9:.2f}B), param_dtype={pdt}, dtype={adt}, "
        f"remat={'on' if cfg.remat else 'off'}",
        f"  MAX_SEQ_LEN={inp.max_seq_len} ROLLOUT_BATCH={inp.rollout_batch} MINI_BATCH={inp.mini_batch} "
        f"MICRO_BATCH={inp.micro_batch} ({plan.rows_per_device} per device, "
        f"{inp.mini_batch // inp.micro_batch} accumulation steps)",
        "",
        f"  {'component':26s} {'detail':40s} {'per device':>14s}",
        f"  {'-' * 26} {'-' * 40} {'-' * 14}",
    ]
    lines += [f"  {name:26s} {detail:40s} {_gib(n)}" for name, detail, n in rows]
    lines.append(f"  {'-' * 26} {'-' * 40} {'-' * 14}")
    for name, n in ((f"train peak ({used})", plan.train_peak), ("rollout peak", plan.rollout_peak)):
        share = n / plan.hbm_bytes
        verdict = "fits" if share <= 0.9 else ("fits, tight (> 90%)" if share <= 1 else "DOES NOT FIT")
        lines.append(f"  {name:26s} {f'{share:6.1%} of {hbm:g} GiB: {verdict}':40s} {_gib(n)}")
    lines.append("")
    lines.append(f"  verdict: {'fits' if plan.fits else 'does NOT fit'} on {inp.tpu} "
                 f"(peak {plan.peak / GiB:.2f} GiB of {hbm:g} GiB per device)")
    if plan.rollout_peak > plan.hbm_bytes:
        lines.append(f"  rollout: at most {max_rollout_rows(plan)} rows fit the KV cache at this MAX_SEQ_LEN; "
                     "generate in chunks of that many rows or add devices")
    if plan.train_peak > plan.hbm_bytes and not cfg.remat:
        lines.append("  training: try remat (model_config.remat = True) or a smaller MICRO_BATCH")
    lines += format_programs(plan)
    lost = undivided_leaves(cfg, inp.mesh)
    if lost:
        lines.append(f"  warning: {len(lost)} parameter dims stay unsplit (replicated over that axis; the AdamW "
                     "moments follow): " + "; ".join(lost[:4]) + ("; ..." if len(lost) > 4 else ""))
    if cfg.param_dtype != "float32":
        lines.append(f"  warning: param_dtype={cfg.param_dtype} updates the weights in {cfg.param_dtype} (no float32 "
                     "master copy): steps below ~0.4% of a weight round away, which at RL learning rates "
                     "(1e-6) is most of them; use param_dtype float32 with dtype bfloat16")
    return "\n".join(lines)


# ---- gin + CLI --------------------------------------------------------------------------------------
def _gin_values(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> dict[str, object]:
    """Parse gin files (skip_unknown) and read the planner's macros and model_config bindings."""
    import gin

    from rexrag_jax.models.qwen2 import config as _config  # noqa: F401  (registers model_config)
    from rexrag_jax.rollout import loop as _loop  # noqa: F401  (registers RolloutConfig)

    gin.clear_config()
    for f in gin_files:
        if not os.path.exists(f):
            raise FileNotFoundError(f"--gin_file {f}: no such file")
        gin.add_config_file_search_path(os.path.dirname(os.path.abspath(f)))
    gin.add_config_file_search_path(os.getcwd())
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings), skip_unknown=True,
                                            finalize_config=False)
    except Exception as e:  # gin raises several types; name the inputs
        raise ValueError(f"gin: cannot parse {list(gin_files)} with bindings {list(gin_bindings)}: {e}") from e
    out = {}
    for key in ("MODEL_PRESET", "MAX_SEQ_LEN", "ROLLOUT_BATCH", "MINI_BATCH", "MICRO_BATCH", "LOGPROB_CHUNK",
                "KL_COEF"):
        try:
            out[key] = gin.query_parameter(f"%{key}")
        except ValueError:
            pass
    for key in ("preset", "dtype", "param_dtype", "remat"):
        try:
            out[key] = gin.query_parameter(f"model_config.{key}")
        except ValueError:
            pass
    for key in ("max_context", "max_new_tokens"):  # the engine's KV slots = max_context + max_new_tokens
        try:
            out[key] = gin.query_parameter(f"RolloutConfig.{key}")
        except ValueError:
            pass
    for key, value in list(out.items()):
        out[key] = _resolve_macro(gin, key, value)
    if "max_context" in out and "max_new_tokens" in out:
        out["CACHE_LEN"] = int(out.pop("max_context")) + int(out.pop("max_new_tokens"))
    gin.clear_config()
    return out


def _resolve_macro(gin, key: str, value, depth: int = 0):
    """`model_config.preset = %MODEL_PRESET` queries back as a reference to gin.macro; follow it."""
    if isinstance(value, gin.config.ConfigurableReference):
        *scopes, selector = value.scoped_selector.split("/")
        if selector.endswith("macro") and scopes and depth < 8:
            return _resolve_macro(gin, key, gin.query_parameter("%" + "/".join(scopes)), depth + 1)
        raise ValueError(f"gin: {key} must be a literal value or a macro, got @{value.scoped_selector}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rexrag plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
    p.add_argument("--gin_bindings", action="append", default=[], help="gin binding (repeatable)")
    p.add_argument("--mesh", default="data=1,fsdp=8,tensor=1", help="mesh axis sizes [data=1,fsdp=8,tensor=1]")
    p.add_argument("--tpu", default="v5e-8", help="TPU type: v4-8, v5e-8, v5p-8, v6e-8, ... [v5e-8]")
    p.add_argument("--preset", help="model preset (else %%MODEL_PRESET / model_config.preset)")
    p.add_argument("--max_seq_len", type=int, help="training sequence length (default: MAX_SEQ_LEN of the gin files)")
    p.add_argument("--rollout_batch", type=int, help="rollout rows per step (default: ROLLOUT_BATCH)")
    p.add_argument("--mini_batch", type=int, help="rows per optimizer step (default: MINI_BATCH)")
    p.add_argument("--micro_batch", type=int, help="rows per forward/backward pass (default: MICRO_BATCH)")
    p.add_argument("--param_dtype", choices=sorted(DTYPE_BYTES), help="parameter dtype (default: model_config.param_dtype)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="compute / activation dtype")
    p.add_argument("--remat", choices=("on", "off"), help="per-layer rematerialisation (default: model_config.remat)")
    p.add_argument("--logprob_chunk", type=int, help="tokens per chunk of the log-prob pass (0 = full logits)")
    p.add_argument("--no_reference", action="store_true", help="no reference policy (KL coefficient 0)")
    p.add_argument("--check", action="store_true", help="exit 1 when the plan does not fit")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes per device)")
    p.add_argument("--aot", action="store_true",
                   help="also compile the real programs with abstract inputs (nothing allocated) on this host's "
                        "devices and print XLA's per-device memory next to the plan; on a CPU host the mesh's "
                        "devices are faked (--xla_force_host_platform_device_count)")
    p.add_argument("--programs", nargs="+", default=list(AOT_PROGRAMS), choices=AOT_PROGRAMS,
                   help=f"programs --aot compiles (default: {' '.join(AOT_PROGRAMS)})")
    return conventional(p)


def plan_from_args(argv: Sequence[str]) -> tuple[MemoryPlan, argparse.Namespace]:
    args = _parser().parse_args(list(argv))
    g = _gin_values(args.gin_file, args.gin_bindings) if (args.gin_file or args.gin_bindings) else {}

    def pick(flag, *keys, required=True):
        if flag is not None:
            return flag
        for k in keys:
            if k in g:
                return g[k]
        if required:
            names = " / ".join(f"%{k}" if k.isupper() else f"model_config.{k}" for k in keys)
            raise ValueError(f"no value for {names}: set it in a gin file or pass the flag")
        return None

    preset = str(pick(args.preset, "MODEL_PRESET", "preset"))
    cfg = Qwen2Config.from_preset(preset)
    overrides = {}
    for field, flag in (("param_dtype", args.param_dtype), ("dtype", args.dtype)):
        value = pick(flag, field, required=False)
        if value is not None:
            overrides[field] = str(value)
    remat = pick(None if args.remat is None else args.remat == "on", "remat", required=False)
    if remat is not None:
        overrides["remat"] = bool(remat)
    cfg = cfg.replace(**overrides)
    chunk = pick(args.logprob_chunk, "LOGPROB_CHUNK", required=False)
    kl = g.get("KL_COEF")
    inp = PlanInputs(
        cfg=cfg, preset=preset, mesh=parse_mesh(args.mesh), tpu=args.tpu,
        max_seq_len=int(pick(args.max_seq_len, "MAX_SEQ_LEN")),
        rollout_batch=int(pick(args.rollout_batch, "ROLLOUT_BATCH")),
        mini_batch=int(pick(args.mini_batch, "MINI_BATCH")),
        micro_batch=int(pick(args.micro_batch, "MICRO_BATCH")),
        reference_model=not args.no_reference and not (kl is not None and float(kl) == 0.0),
        logprob_chunk=int(chunk) if chunk else None,
        cache_len=int(g["CACHE_LEN"]) if "CACHE_LEN" in g else None,
    )
    return make_plan(inp), args


def aot_check_inputs(inp: PlanInputs) -> None:
    """--aot: the batch dims the compiled programs shard over data x fsdp must divide (one-line errors)."""
    ways = inp.mesh["data"] * inp.mesh["fsdp"]
    for name in ("micro_batch", "rollout_batch"):
        if getattr(inp, name) % ways:
            raise ValueError(f"--aot: {name.upper()} = {getattr(inp, name)} is not divisible by data x fsdp = {ways} "
                             f"(mesh {inp.mesh}); the trainer shards these rows over both axes")


def aot_devices(n: int):
    """n JAX devices for the compile: this host's accelerators, else n fake CPU devices (the flag is set
    before JAX creates its CPU client, so it must not have been created yet in this process)."""
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}={n}").strip()
    import jax

    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"--aot: the mesh needs {n} devices but this host has {len(devices)} "
                         f"{devices[0].platform} devices (on CPU: XLA_FLAGS={flag}={n}, or leave XLA_FLAGS unset)")
    return devices[:n]


def aot_report(plan: MemoryPlan, programs: Sequence[str]) -> list[dict]:
    """Compile each program (rexrag_jax.train.aot) on the plan's mesh; per device: XLA's memory_analysis,
    the planner's estimate, peak = XLA total + the planner's resident state, compile seconds, and the
    parameter / optimizer leaves over 1 MiB left fully replicated."""
    from rexrag_jax.sharding import make_mesh
    from rexrag_jax.train.aot import compile_and_audit, shapes_for_plan

    inp = plan.inputs
    aot_check_inputs(inp)
    devices = aot_devices(plan.devices)
    mesh = make_mesh(inp.mesh["data"], inp.mesh["fsdp"], inp.mesh["tensor"], devices=devices)
    est, extra = program_bytes(inp), resident_extra_bytes(inp)
    rows = []
    for prog in programs:
        res = compile_and_audit(prog, inp.cfg, mesh, shapes_for_plan(inp, DECODE_CHUNK))
        m = res["memory"]
        rows.append({"program": prog, "platform": devices[0].platform, "xla_bytes": m["total"],
                     "argument_bytes": m["argument"], "output_bytes": m["output"], "alias_bytes": m["alias"],
                     "temp_bytes": m["temp"], "planner_bytes": int(est[prog]), "resident_bytes": int(extra[prog]),
                     "peak_bytes": m["total"] + int(extra[prog]), "fits": m["total"] + extra[prog] <= plan.hbm_bytes,
                     "compile_s": round(res["compile_s"], 2),
                     "replicated_state_over_1mib": [x.path for x in res["replicated_state"]]})
        del res
    return rows


def format_aot(plan: MemoryPlan, rows: Sequence[dict]) -> str:
    _, _, hbm = tpu_devices(plan.inputs.tpu)
    lines = ["", f"  AOT: the programs compiled on {len(rows) and rows[0]['platform']} devices (XLA memory_analysis per "
                 "device; peak = XLA total + resident state)",
             f"  {'program':9s} {'argument':>9s} {'output':>9s} {'alias':>9s} {'temp':>9s} {'XLA total':>10s} "
             f"{'planner':>9s} {'ratio':>6s} {'peak':>9s}  {'verdict':28s} {'compile':>8s}  replicated state > 1 MiB"]
    for r in rows:
        share = r["peak_bytes"] / plan.hbm_bytes
        verdict = "fits" if share <= 0.9 else ("fits, tight (> 90%)" if share <= 1 else "DOES NOT FIT")
        g = lambda k: f"{r[k] / GiB:9.2f}"  # noqa: E731
        lines.append(f"  {r['program']:9s} {g('argument_bytes')} {g('output_bytes')} {g('alias_bytes')} "
                     f"{g('temp_bytes')} {r['xla_bytes'] / GiB:10.2f} {g('planner_bytes')} "
                     f"{r['planner_bytes'] / max(r['xla_bytes'], 1):6.2f} {g('peak_bytes')}  "
                     f"{f'{share:6.1%} of {hbm:g} GiB: {verdict}':28s} {r['compile_s']:7.1f}s  "
                     f"{', '.join(r['replicated_state_over_1mib']) or 'none'}")
        if not r["fits"]:
            fix = smallest_fix(plan.inputs, r["program"], plan.hbm_bytes)
            if fix:
                lines.append(f"  {'':9s} smallest change that fits (planner): {fix}")
    if rows and rows[0]["platform"] == "cpu":
        lines.append(f"  (GiB; compiled by XLA:CPU on fake devices standing in for {plan.inputs.tpu}: the same "
                     "programs and shardings, CPU buffer assignment; run --aot on the TPU VM for TPU's own)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan, args = plan_from_args(argv)
        if args.aot:
            aot_check_inputs(plan.inputs)
    except (ValueError, FileNotFoundError) as e:
        print(f"rexrag plan: {e}", file=sys.stderr)
        return 2
    aot = None
    if not args.json:
        print(format_plan(plan), flush=True)
    if args.aot:
        try:
            aot = aot_report(plan, args.programs)
        except ValueError as e:
            print(f"rexrag plan: {e}", file=sys.stderr)
            return 2
    if args.json:
        d = plan_to_dict(plan)
        if aot is not None:
            d["aot"] = aot
        print(json.dumps(d, indent=2))
    elif aot is not None:
        print(format_aot(plan, aot))
    fits = plan.fits and (aot is None or all(r["fits"] for r in aot))
    return 1 if (args.check and not fits) else 0


if __name__ == "__main__":
    sys.exit(main())
