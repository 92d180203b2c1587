"""Multi-process (multi-host) setup from the environment, and host-local batches -> global arrays.

    initialize_from_env()            # before any other JAX call; a no-op for single-process runs
    mesh = make_mesh(data=-1, fsdp=..., tensor=...)     # over jax.devices(): all processes' devices
    batch = host_local_batch_to_global({"tokens": local_tokens, ...}, mesh)

Environment (explicit, e.g. GPU clusters or CPU tests): JAX_COORDINATOR_ADDRESS (host:port of process
0), JAX_PROCESS_COUNT, JAX_PROCESS_ID, optional JAX_LOCAL_DEVICE_IDS ("0,1"). On a multi-host Cloud
TPU slice (TPU_WORKER_HOSTNAMES lists more than one host) JAX detects all of this itself.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from rexrag_jax.sharding.rules import LOGICAL_AXIS_RULES, spec_for_shape

log = logging.getLogger(__name__)

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_ID")


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r}: expected an integer") from None


def initialize_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Call jax.distributed.initialize when the environment describes a multi-process job.

    Returns True if this call (or an earlier one) initialised the distributed runtime, False for a
    single-process run. Partially set variables are an error naming the missing ones.
    """
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return True
    present = [k for k in ENV_VARS if env.get(k)]
    if present:
        missing = [k for k in ENV_VARS if k not in present]
        if missing:
            raise ValueError(f"multi-process setup: {present} set but {missing} missing; set all of {list(ENV_VARS)}")
        count, pid = _int_env(env, "JAX_PROCESS_COUNT"), _int_env(env, "JAX_PROCESS_ID")
        if count < 1 or not 0 <= pid < count:
            raise ValueError(f"multi-process setup: JAX_PROCESS_ID={pid} must lie in [0, JAX_PROCESS_COUNT={count})")
        local = env.get("JAX_LOCAL_DEVICE_IDS")
        local_ids = [int(x) for x in local.split(",")] if local else None
        log.info("jax.distributed.initialize(%s, %d processes, id %d)", env["JAX_COORDINATOR_ADDRESS"], count, pid)
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=count,
                                   process_id=pid, local_device_ids=local_ids)
        return True
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        log.info("jax.distributed.initialize() on a %d-host TPU slice", len(hosts))
        jax.distributed.initialize()  # TPU cluster auto-detection
        return True
    return False


def host_local_batch_to_global(batch: Any, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Any:
    """Pytree of this process's rows (numpy, leading batch dim) -> global jax Arrays.

    Every process passes the same number of rows b (global dim 0 = b * process_count), sharded on
    "batch" (data x fsdp) over `mesh`. When each process's devices form a contiguous block of the batch
    axis (make_mesh over several CPU/GPU hosts; checked by the 2-process test) the global batch is the
    concatenation in process order; otherwise JAX places each process's rows on its own devices' slots.
    The global batch must divide by the data x fsdp size, else rows would have to be replicated.
    """
    n_proc = jax.process_count()

    def one(x):
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("host_local_batch_to_global: scalar leaf; every leaf needs a leading batch dim")
        global_shape = (x.shape[0] * n_proc, *x.shape[1:])
        spec = spec_for_shape(("batch",) + (None,) * (x.ndim - 1), global_shape, mesh, rules, name="batch")
        want = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
        got = np.prod([mesh.shape[a] for a in ((spec[0],) if isinstance(spec[0], str) else spec[0] or ())])
        if got != want:
            raise ValueError(f"host_local_batch_to_global: global batch {global_shape[0]} ({x.shape[0]} rows x "
                             f"{n_proc} processes) is not divisible by data*fsdp = {want}")
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree_util.tree_map(one, batch)
