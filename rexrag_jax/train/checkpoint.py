"""Training checkpoints: one orbax CheckpointManager, composite items per step.

    <run_dir>/checkpoints/<step>/state   params + optimizer state (StandardSave: sharded arrays)
    <run_dir>/checkpoints/<step>/meta    JSON: step, data-iterator state, RNG seed/key data, EWMA keep
                                          ratio ρ, anything else small

orbax writes each step to a temporary directory and renames it when complete (on GCS, which has no
rename, it writes a commit_success.txt marker last instead), so a crash mid-save leaves the previous
checkpoint as the latest. `directory` may be a local path or a gs:// URL (rexrag_jax.io.paths).
Saves are synchronous (async disabled): when `save` returns, the step is on disk (in the bucket). A checkpoint is never written from non-finite params.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rexrag_jax.io import paths

log = logging.getLogger(__name__)


class NonFiniteCheckpointError(RuntimeError):
    pass


@jax.jit
def _tree_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = paths.as_path(directory)  # epath.Path: absolute local path or the gs:// URL
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Write step `step`; refuses (NonFiniteCheckpointError) if any float in `state` is NaN/inf."""
        if not bool(_tree_finite(state)):
            raise NonFiniteCheckpointError(f"refusing to write checkpoint {step} to {self.directory}: "
                                           "the training state holds non-finite values")
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        """(state, meta) of `step`; `like` is a pytree of arrays or ShapeDtypeStructs (with shardings)
        giving the structure, dtypes and placement to restore into."""
        abstract = jax.tree.map(_abstract, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
