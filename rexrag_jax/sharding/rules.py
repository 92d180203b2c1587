"""Sharding as data: logical axis names -> mesh axes (t5x / MaxText style).

Model code names the logical axes of every parameter and activation; this table alone decides how
they map onto the mesh axes (`data`, `fsdp`, `tensor`). `constrain` applies
`with_sharding_constraint` at activation boundaries when a mesh is active and is a no-op otherwise,
so the same model function runs unsharded in tests and sharded under pjit.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
from typing import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_AXIS_RULES: tuple[tuple[str, object], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("cache_length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    # vocab-parallel output head of the chunked log-prob passes (qwen2.model.vocab_parallel_head): the
    # [V, D] table split by vocabulary rows over tensor x fsdp, its hidden-state input whole over fsdp
    ("head_vocab", ("tensor", "fsdp")),
    ("head_batch", "data"),
    ("layers", None),
    ("norm", None),
)

_state = threading.local()
log = logging.getLogger(__name__)


def logical_to_spec(logical_axes: Sequence[str | None], rules=LOGICAL_AXIS_RULES,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once per array."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        target = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES")
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        # Drop mesh axes already used by an earlier dim, or of size 1 (keeps specs tidy).
        axes = tuple(a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return PartitionSpec(*out)


def spec_for_shape(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules=LOGICAL_AXIS_RULES, name: str = "array") -> PartitionSpec:
    """PartitionSpec for an array of `shape`: each dim gets the mesh axes its logical name maps to,
    minus axes already used by an earlier dim and size-1 axes, trimmed from the right until the dim
    size is divisible by their product (nothing left = replicated)."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"{name}: {len(logical_axes)} logical axes {tuple(logical_axes)} for shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    out = []
    for dim, (lname, size) in enumerate(zip(logical_axes, shape)):
        if lname is not None and lname not in table:
            raise KeyError(f"{name}: logical axis {lname!r} has no rule in LOGICAL_AXIS_RULES")
        target = table.get(lname) if lname is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
        wanted = axes
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        if axes != wanted:
            log.debug("%s: dim %d (%s, size %d) not divisible by mesh axes %s %s; using %s instead",
                      name, dim, lname, size, wanted, [mesh.shape[a] for a in wanted], axes or "replication")
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return PartitionSpec(*out)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Iterator[Mesh]:
    """Activate `mesh` + `rules` for `constrain` calls traced inside this context."""
    prev = getattr(_state, "active", None)
    _state.active = (mesh, rules)
    try:
        yield mesh
    finally:
        _state.active = prev


def active_mesh():
    return getattr(_state, "active", None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names (non-divisible dims replicated); identity without a mesh."""
    active = active_mesh()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for_shape(logical_axes, x.shape, mesh, rules, name="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
