"""Ahead-of-time lowering of the trainer's jitted programs with abstract inputs (no weights allocated).

    shapes = AotShapes.from_plan_inputs(plan_inputs)          # batch / sequence sizes of a gin config
    progs = lower_programs(cfg, mesh, shapes)                 # {"update": Lowered, "logprob": ..., ...}
    compiled = progs["update"].compile()
    compiled.memory_analysis(), compiled.input_shardings, compiled.as_text()

The programs are the ones the trainer and the rollout engine run, built by the same functions:

  update    train.update.make_update_fn (the unpacked mini-batch update: params and optimizer state in,
            [MINI/MICRO, MICRO, T] micro-batches scanned), out_shardings = (param, optimizer shardings),
            params / optimizer state donated, as Trainer wires it
  logprob   train.update.make_logprob_fn (the π_old pass with entropy), [rows, T] under the mesh
  prefill   generation.kernels.prefill: the largest append chunk the engine issues (every row, T =
            prefill_chunk tokens, attention window = the engine's max_len)
  decode    generation.kernels.decode_chunk: decode_chunk steps over every row, window = max_len

Every input is a jax.ShapeDtypeStruct carrying the NamedSharding the trainer gives the real array
(sharding.param_shardings, update.opt_state_shardings, batch dims on (data, fsdp), the KV cache by
CACHE_LOGICAL_AXES), and tracing runs under `use_mesh(mesh)` so the model's activation constraints apply.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.sharding.partition import param_shardings
from rexrag_jax.sharding.rules import logical_to_spec, spec_for_shape, use_mesh

PROGRAMS = ("update", "logprob", "prefill", "decode")
# positional argument names of each program (sharding.audit.replicated_inputs paths)
ARG_NAMES = {
    "update": ("params", "opt_state", "micro_batches", "lr", "poison"),
    "logprob": ("params", "tokens", "attention_mask"),
    "prefill": ("params", "k", "v", "lengths", "last_logits", "idx", "tokens", "num_new"),
    "decode": ("params", "k", "v", "lengths", "last_logits", "active", "remaining", "recent", "rng",
               "temperature", "top_p"),
}
STATE_ARGS = ("params", "opt_state")  # the leaves the fsdp audit requires sharded


@dataclasses.dataclass(frozen=True)
class AotShapes:
    """Sizes of the compiled programs (global, not per device).

    micro_batch / mini_batch / seq_len: the update's [mini/micro, micro, seq_len] micro-batches;
    logprob_rows: rows per π_old call (TrainConfig.logprob_batch or micro_batch); engine_rows / engine_len:
    the GenerationEngine's KV-cache rows and slots (required_batch_size(ROLLOUT_BATCH), max_context +
    max_new_tokens); prefill_chunk / decode_chunk: the engine's chunk sizes.
    """
    seq_len: int = 4096
    micro_batch: int = 8
    mini_batch: int = 256
    logprob_rows: int = 8
    logprob_chunk: int = 512
    kl: bool = True
    engine_rows: int = 2560
    engine_len: int = 4596
    prefill_chunk: int = 512
    decode_chunk: int = 16

    @property
    def n_micro(self) -> int:
        return self.mini_batch // self.micro_batch


def _sds(shape, dtype, mesh, logical_axes):
    spec = spec_for_shape(logical_axes, shape, mesh, name="aot input")
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def abstract_params(cfg: Qwen2Config, mesh, shardings=None):
    """ShapeDtypeStruct tree of init_params(cfg) (param_dtype) with the trainer's param shardings."""
    shardings = param_shardings(cfg, mesh) if shardings is None else shardings
    shapes = qwen2.param_shapes(cfg)
    return jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(cfg.param_dtype), sharding=sh), shapes, shardings,
        is_leaf=lambda x: isinstance(x, tuple))


def abstract_opt_state(optimizer, params_sds, shardings, mesh):
    """(ShapeDtypeStruct tree of optimizer.init(params), its shardings) as the trainer places it."""
    from rexrag_jax.train.update import opt_state_shardings

    shapes = jax.eval_shape(optimizer.init, params_sds)
    opt_sh = opt_state_shardings(optimizer, shapes, shardings, mesh)
    sds = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, opt_sh)
    return sds, opt_sh


def _update_args(cfg, mesh, shapes: AotShapes, optimizer, shardings):
    p = abstract_params(cfg, mesh, shardings)
    o, opt_sh = abstract_opt_state(optimizer, p, shardings, mesh)
    n, m, t = shapes.n_micro, shapes.micro_batch, shapes.seq_len
    row = (None, "batch", "length")  # Trainer._put(v, leading=1): the batch dim after the micro-batch axis
    mb = {"tokens": _sds((n, m, t), jnp.int32, mesh, row),
          "attention_mask": _sds((n, m, t), jnp.bool_, mesh, row),
          "loss_mask": _sds((n, m, t), jnp.bool_, mesh, row),
          "behaviour_logp": _sds((n, m, t), jnp.float32, mesh, row),
          "advantages": _sds((n, m), jnp.float32, mesh, row[:2]),
          "is_probe": _sds((n, m), jnp.bool_, mesh, row[:2])}
    if shapes.kl:
        mb["ref_logp"] = _sds((n, m, t), jnp.float32, mesh, row)
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    poison = jax.ShapeDtypeStruct((), jnp.bool_)
    return (p, o, mb, lr, poison), opt_sh


def _cache_sds(cfg, mesh, rows, length):
    shape = (cfg.num_layers, rows, length, cfg.num_kv_heads, cfg.head_dim)
    spec = logical_to_spec(qwen2.CACHE_LOGICAL_AXES, mesh=mesh)  # GenerationEngine._place
    return jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype), sharding=NamedSharding(mesh, spec))


def _engine_common(cfg, mesh, shapes: AotShapes, shardings):
    p = abstract_params(cfg, mesh, shardings)
    k = _cache_sds(cfg, mesh, shapes.engine_rows, shapes.engine_len)
    B = shapes.engine_rows
    rep = NamedSharding(mesh, PartitionSpec())
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rep)  # host-owned, copied in per call
    logits = jax.ShapeDtypeStruct((B, cfg.vocab_size), jnp.float32,
                                  sharding=NamedSharding(mesh, logical_to_spec(("batch", None), mesh=mesh)))
    return p, k, lengths, logits, rep


def lower_program(name: str, cfg: Qwen2Config, mesh, shapes: AotShapes, optimizer=None, shardings=None,
                  eos_ids: Iterable[int] = (151645, 151643)):
    """jax.stages.Lowered of one program (see the module docstring), traced under `use_mesh(mesh)`.

    `shardings` replaces the param shardings (tests use it to plant a replicated leaf)."""
    from rexrag_jax.train.optim import OptimizerConfig
    from rexrag_jax.train.update import LossConfig, make_logprob_fn, make_update_fn

    shardings = param_shardings(cfg, mesh) if shardings is None else shardings
    with use_mesh(mesh):
        if name == "update":
            optimizer = optimizer or OptimizerConfig().make()
            args, opt_sh = _update_args(cfg, mesh, shapes, optimizer, shardings)
            loss_cfg = LossConfig(kl_coef=0.001 if shapes.kl else 0.0, logprob_chunk=shapes.logprob_chunk or None)
            fn = make_update_fn(cfg, optimizer, loss_cfg, (shardings, opt_sh))
            return fn.lower(*args)
        if name == "logprob":
            fn = make_logprob_fn(cfg, 1.0, shapes.logprob_chunk or 512, True)
            p = abstract_params(cfg, mesh, shardings)
            tok = _sds((shapes.logprob_rows, shapes.seq_len), jnp.int32, mesh, ("batch", "length"))
            mask = _sds((shapes.logprob_rows, shapes.seq_len), jnp.bool_, mesh, ("batch", "length"))
            return fn.lower(p, tok, mask)
        if name == "prefill":
            from rexrag_jax.generation import kernels
            p, k, lengths, logits, rep = _engine_common(cfg, mesh, shapes, shardings)
            nb, T = shapes.engine_rows, shapes.prefill_chunk
            idx = jax.ShapeDtypeStruct((nb,), jnp.int32, sharding=rep)
            tokens = jax.ShapeDtypeStruct((nb, T), jnp.int32, sharding=rep)
            num_new = jax.ShapeDtypeStruct((nb,), jnp.int32, sharding=rep)
            # every row at once, as the engine issues it when all rows have tokens (all_rows: no row gather)
            return kernels.prefill.lower(p, k, k, lengths, logits, idx, tokens, num_new, cfg=cfg,
                                         window=shapes.engine_len, mesh=mesh, vocab_limit=None,
                                         all_rows=nb == shapes.engine_rows)
        if name == "decode":
            from rexrag_jax.generation import kernels
            p, k, lengths, logits, rep = _engine_common(cfg, mesh, shapes, shardings)
            B = shapes.engine_rows
            active = jax.ShapeDtypeStruct((B,), jnp.bool_, sharding=rep)
            recent = jax.ShapeDtypeStruct((B, 1), jnp.int32, sharding=rep)
            rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
            f = jax.ShapeDtypeStruct((), jnp.float32)
            return kernels.decode_chunk.lower(
                p, k, k, lengths, logits, active, lengths, recent, rng, f, f, greedy=False, cfg=cfg,
                steps=shapes.decode_chunk, window=shapes.engine_len, stop_seqs=(), eos_ids=tuple(eos_ids),
                use_top_p=False, pad_id=0, mesh=mesh, vocab_limit=None)
    raise ValueError(f"program {name!r}: expected one of {PROGRAMS}")


def memory_stats(compiled) -> dict[str, int]:
    """compiled.memory_analysis() per device: argument, output, alias, temp bytes and their total
    (argument + output - alias + temp: donated buffers are counted once)."""
    m = compiled.memory_analysis()
    out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
           "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes)}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compile_and_audit(name: str, cfg: Qwen2Config, mesh, shapes: AotShapes, shardings=None,
                      min_replicated_bytes: int = 1 << 20) -> dict:
    """Lower + compile one program; its per-device memory, compile time, the inputs >= min_replicated_bytes
    left fully replicated (sharding.audit.replicated_inputs; "replicated_state": those under params /
    opt_state) and its collectives (sharding.audit)."""
    import time

    from rexrag_jax.sharding import audit

    t0 = time.perf_counter()
    lowered = lower_program(name, cfg, mesh, shapes, shardings=shardings)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    args = lowered.args_info[0]  # the abstract positional arguments (ArgInfo: shape, dtype)
    text = compiled.as_text()
    ops = audit.collectives(text, unknown_trip=shapes.decode_chunk if name == "decode" else 1)
    replicated = audit.replicated_inputs(compiled, args, min_replicated_bytes, ARG_NAMES[name])
    state = [r for r in replicated if r.path.split("[")[0].split(".")[0] in STATE_ARGS]
    return {"program": name, "memory": memory_stats(compiled), "replicated_state": state, "lower_s": t1 - t0, "compile_s": t2 - t1,
            "replicated": replicated,
            "collectives": audit.summarize(ops, cfg.num_layers), "ops": ops, "compiled": compiled,
            "args": args}


def shapes_for_plan(inp, decode_chunk: int = 16) -> AotShapes:
    """AotShapes of a planner.PlanInputs: the update's micro-batches, the log-prob pass over MICRO_BATCH
    rows, and the engine's rows / slots / chunks as the planner counts them (planner.engine_rows/len)."""
    from rexrag_jax.train import planner

    return AotShapes(seq_len=inp.max_seq_len, micro_batch=inp.micro_batch, mini_batch=inp.mini_batch,
                     logprob_rows=inp.micro_batch, logprob_chunk=inp.logprob_chunk or 0, kl=inp.reference_model,
                     engine_rows=planner.engine_rows(inp), engine_len=planner.engine_len(inp),
                     prefill_chunk=inp.prefill_chunk, decode_chunk=decode_chunk)
