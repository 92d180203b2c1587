"""Mesh construction and parameter / cache / batch shardings derived from the logical axis rules.

    mesh = make_mesh(data=2, fsdp=2, tensor=2)          # product must equal the device count
    shardings = param_shardings(cfg, mesh)              # from PARAM_LOGICAL_AXES via LOGICAL_AXIS_RULES
    params = shard_params(params, shardings)
    fwd = sharded_forward(cfg, mesh)                    # jitted, in/out shardings, constraints active
    logits = fwd(params, tokens, attention_mask)

A dimension whose size is not divisible by its mesh axes falls back to replication for that dimension
only (e.g. Qwen2.5-3B's 2 KV heads on a tensor axis of 4); the fallback is logged at DEBUG level.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rexrag_jax.sharding.rules import LOGICAL_AXIS_RULES, MESH_AXES, spec_for_shape, use_mesh

def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """Mesh with axes ("data", "fsdp", "tensor") over `devices` (default jax.devices()).

    At most one axis may be -1 (= whatever the other two leave). On TPU the device order follows the
    physical topology (mesh_utils.create_device_mesh), so the innermost axis ("tensor") stays on
    neighbouring chips.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(data), int(fsdp), int(tensor)]
    n = len(devices)
    if sizes.count(-1) > 1:
        raise ValueError(f"make_mesh: at most one axis may be -1, got data={data}, fsdp={fsdp}, tensor={tensor}")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if rest <= 0 or n % rest:
            raise ValueError(f"make_mesh: {n} devices cannot be split as data={data}, fsdp={fsdp}, "
                             f"tensor={tensor} (the fixed axes multiply to {rest})")
        sizes[sizes.index(-1)] = n // rest
    if any(s <= 0 for s in sizes) or math.prod(sizes) != n:
        raise ValueError(f"make_mesh: data*fsdp*tensor = {sizes[0]}*{sizes[1]}*{sizes[2]} = "
                         f"{math.prod(sizes)} but there are {n} devices ({devices[0].platform}); "
                         "the product must equal the device count")
    try:
        grid = mesh_utils.create_device_mesh(tuple(sizes), devices)
    except (ValueError, NotImplementedError, AssertionError):  # odd topologies: plain row-major order
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES)


def _tree_paths(tree) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {jax.tree_util.keystr(p): v for p, v in flat}


def param_specs(cfg, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """PartitionSpec pytree matching init_params(cfg) (tied models have no lm_head)."""
    from rexrag_jax.models.qwen2 import model as qwen2  # lazy: model.py imports sharding.rules

    axes, shapes = qwen2.param_logical_axes(cfg), qwen2.param_shapes(cfg)
    is_leaf = lambda x: isinstance(x, tuple)  # noqa: E731
    paths = _tree_paths(axes)
    names = iter(paths)
    return jax.tree_util.tree_map(
        lambda a, s: spec_for_shape(a, s, mesh, rules, name=f"params{next(names)}"), axes, shapes,
        is_leaf=is_leaf)


def param_shardings(cfg, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedSharding pytree matching init_params(cfg)."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(cfg, mesh, rules),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def cache_shardings(cfg, mesh: Mesh, batch: int, max_len: int, rules=LOGICAL_AXIS_RULES) -> dict:
    """NamedShardings for init_cache(cfg, batch, max_len): k/v by CACHE_LOGICAL_AXES, lengths by batch."""
    from rexrag_jax.models.qwen2 import model as qwen2

    kv_shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    kv = NamedSharding(mesh, spec_for_shape(qwen2.CACHE_LOGICAL_AXES, kv_shape, mesh, rules, name="cache.k"))
    lengths = NamedSharding(mesh, spec_for_shape(("batch",), (batch,), mesh, rules, name="cache.lengths"))
    return {"k": kv, "v": kv, "lengths": lengths}


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules=LOGICAL_AXIS_RULES) -> NamedSharding:
    """Shard dim 0 as "batch" (data x fsdp), replicate the rest."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, spec_for_shape(axes, shape, mesh, rules, name="batch"))


def shard_params(params, shardings):
    """Place each leaf with its sharding; a structure mismatch names the offending path."""
    p_paths = _tree_paths(params)
    s_paths = _tree_paths(jax.tree_util.tree_map(lambda s: (s,), shardings,
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    if p_paths.keys() != s_paths.keys():
        missing = sorted(s_paths.keys() - p_paths.keys())
        extra = sorted(p_paths.keys() - s_paths.keys())
        raise ValueError(f"shard_params: params/shardings trees differ; missing in params: {missing}, "
                         f"not in shardings: {extra}")
    return jax.device_put(params, shardings)


def sharded_forward(cfg, mesh: Mesh, shardings=None, rules=LOGICAL_AXIS_RULES) -> Callable:
    """Jitted `(params, tokens, attention_mask) -> float32 logits [B,T,V]` over `mesh`.

    Params take `shardings` (default param_shardings), tokens / mask are sharded on batch, logits come
    back as (batch, length, act_vocab); `constrain` calls in the model are active while tracing.
    """
    from rexrag_jax.models.qwen2 import model as qwen2

    shardings = param_shardings(cfg, mesh, rules) if shardings is None else shardings

    def fwd(params, tokens, attention_mask):
        return qwen2.forward(params, tokens, cfg, attention_mask=attention_mask)[0]

    compiled: dict[tuple, Callable] = {}

    def run(params, tokens, attention_mask=None):
        tokens = jnp.asarray(tokens)
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, jnp.int32)
        key = tuple(tokens.shape)
        if key not in compiled:
            data = batch_sharding(mesh, tokens.shape, rules)
            out = NamedSharding(mesh, spec_for_shape(("batch", "length", "act_vocab"),
                                                     (*tokens.shape, cfg.vocab_size), mesh, rules, "logits"))
            compiled[key] = jax.jit(fwd, in_shardings=(shardings, data, data), out_shardings=out)
        with use_mesh(mesh, rules):  # constrain() reads the active mesh at trace time
            return compiled[key](params, tokens, attention_mask)

    return run
