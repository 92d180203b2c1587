"""Logical-axis sharding: rules table (rules.py), meshes and param/cache/batch shardings (partition.py)."""
from rexrag_jax.sharding.partition import (batch_sharding, cache_shardings, make_mesh, param_shardings,
                                           param_specs, shard_params, sharded_forward)
from rexrag_jax.sharding.rules import (LOGICAL_AXIS_RULES, MESH_AXES, constrain, logical_to_spec,
                                       spec_for_shape, use_mesh)

__all__ = ["LOGICAL_AXIS_RULES", "MESH_AXES", "batch_sharding", "cache_shardings", "constrain",
           "logical_to_spec", "make_mesh", "param_shardings", "param_specs", "shard_params",
           "sharded_forward", "spec_for_shape", "use_mesh"]
