"""Worker for test_two_process_train.py: 2 GRPO update steps of a tiny Qwen2 on a synthetic batch.

Modes (argv[1]), output argv[2]:
  multi  : (argv[2] = .npz) one of JAX_PROCESS_COUNT processes (jax.distributed over loopback); params and optimizer
           state sharded over a (data, fsdp) mesh spanning every process's CPU devices; each process
           feeds only its contiguous share of the global batch via host_local_batch_to_global.
  reference : (argv[2] = a directory) one process, one device, no mesh: single.npz from the full batch
           (the reference) and half.npz from rows [0, N/2) only (a control: must differ from the full batch).
Each step: old log-probs under the current params (computed on the host's first device from the
gathered params, identical on every process), GRPO advantages, behaviour = old log-probs (plain
GRPO), then one make_update_fn step (AdamW, lr 1e-3). Writes all params after 2 steps and prints
"RESULT {json}" per run.
"""
import json
import sys

import numpy as np

MODE, OUT = sys.argv[1], sys.argv[2]
if MODE == "multi":
    from rexrag_jax.sharding.distributed import initialize_from_env
    assert initialize_from_env(), "multi mode needs JAX_COORDINATOR_ADDRESS / JAX_PROCESS_COUNT / JAX_PROCESS_ID"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rexrag_jax.models.qwen2 import model as qwen2  # noqa: E402
from rexrag_jax.models.qwen2.config import Qwen2Config  # noqa: E402
from rexrag_jax.rl.advantages import group_advantages  # noqa: E402
from rexrag_jax.train import prepare  # noqa: E402
from rexrag_jax.train.optim import OptimizerConfig  # noqa: E402
from rexrag_jax.train.synthetic import synthetic_batch, synthetic_examples, synthetic_pool  # noqa: E402
from rexrag_jax.train.update import LossConfig, make_update_fn, policy_logprobs  # noqa: E402

STEPS, LR, ROWS, T = 2, 1e-3, 8, 32
BARRIER_TIMEOUT_MS = 300_000
cfg = Qwen2Config.from_preset("tiny")
optimizer = OptimizerConfig(learning_rate=LR, warmup_fraction=0.0).make()
loss_cfg = LossConfig(eps_low=0.2, eps_high=0.2, kl_coef=0.0)


def global_batch(step):
    """The same ROWS-row batch on every process (deterministic from the step)."""
    b = synthetic_batch(synthetic_examples(4), 4, cfg.vocab_size, seed=100 + step, pool=synthetic_pool(cfg.vocab_size),
                        probe_prob=0.0, correct_prob=0.5, pad_to=T)
    b = b.select(np.arange(ROWS))
    b.rewards = prepare.score(b)[0]
    return b


local_dev = jax.local_devices()[0]
logp_fn = jax.jit(lambda p, t, m: policy_logprobs(p, t, m, cfg))  # runs where its (local) inputs live


def host_arrays(params_host, step):
    b = global_batch(step)
    p = jax.device_put(params_host, local_dev)
    old = np.asarray(logp_fn(p, jax.device_put(b.tokens, local_dev), jax.device_put(b.attention_mask, local_dev)))
    adv = np.asarray(group_advantages(b.rewards, b.group_ids), np.float32)
    return {"tokens": b.tokens, "attention_mask": b.attention_mask, "loss_mask": b.loss_mask,
            "behaviour_logp": old.astype(np.float32), "advantages": adv, "is_probe": b.is_probe}


init_host = jax.tree.map(np.asarray, qwen2.init_params(cfg, jax.random.PRNGKey(0)))
if MODE == "multi":
    from jax._src import distributed as jax_distributed  # the coordination-service barrier (no Gloo)
    from rexrag_jax.sharding import make_mesh, param_shardings, use_mesh
    from rexrag_jax.sharding.distributed import host_local_batch_to_global
    from jax.sharding import NamedSharding, PartitionSpec
    import optax

    n_proc, pid = jax.process_count(), jax.process_index()
    mesh = make_mesh(data=2, fsdp=len(jax.devices()) // 2, tensor=1)
    p_sh = param_shardings(cfg, mesh)
    params = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx, x=x: x[idx]),
                          init_host, p_sh)
    shapes = jax.eval_shape(optimizer.init, params)
    o_sh = optax.tree_map_params(optimizer, lambda _, s: s, shapes, p_sh,
                                 transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()))
    with use_mesh(mesh):
        opt_state = jax.jit(optimizer.init, out_shardings=o_sh)(params)
    update = make_update_fn(cfg, optimizer, loss_cfg, (p_sh, o_sh))
    add_micro_axis = jax.jit(lambda t: jax.tree.map(lambda x: x[None], t))
    replicate = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, PartitionSpec()))
    client = jax_distributed.global_state.client
    n_barriers = [0]

    def synced(jitted, *args):
        """Compile first, then meet at a barrier, then run: Gloo gives a collective's first use only 30 s
        for every process to arrive, less than one compile takes on a loaded 2-core machine."""
        compiled = jitted.lower(*args).compile()
        n_barriers[0] += 1
        client.wait_at_barrier(f"collective_{n_barriers[0]}", BARRIER_TIMEOUT_MS)
        return compiled(*args)

    def gather(tree):
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), synced(replicate, tree))

    share = ROWS // n_proc
    for step in range(STEPS):
        arrays = host_arrays(gather(params), step)
        local = {k: v[pid * share:(pid + 1) * share] for k, v in arrays.items()}  # this host's rows only
        with use_mesh(mesh):
            mb = synced(add_micro_axis, host_local_batch_to_global(local, mesh))
            params, opt_state, metrics = synced(update, params, opt_state, mb, jnp.float32(LR), jnp.bool_(False))
    final = gather(params)
    info = {"pid": pid, "processes": n_proc, "devices": len(jax.devices()), "local": len(jax.local_devices()),
            "mesh": dict(mesh.shape), "loss_tokens": int(gather(metrics["loss_tokens"]))}


def flat_params(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def single_process(rows):
    """One device, no mesh; rows >= `rows` get an empty loss mask (same shapes: one compile serves both)."""
    params = jax.tree.map(jnp.asarray, init_host)
    opt_state = optimizer.init(params)
    update = make_update_fn(cfg, optimizer, loss_cfg)
    for step in range(STEPS):
        arrays = host_arrays(jax.tree.map(np.asarray, params), step)
        arrays["loss_mask"][rows:] = False
        mb = {k: jnp.asarray(v)[None] for k, v in arrays.items()}
        params, opt_state, metrics = update(params, opt_state, mb, jnp.float32(LR), jnp.bool_(False))
    return flat_params(params), {"pid": 0, "processes": 1, "loss_tokens": int(metrics["loss_tokens"])}


def checksum(flat):
    return float(sum(np.abs(v.astype(np.float64)).sum() for v in flat.values()))


if MODE == "multi":
    flat = flat_params(final)
    np.savez(OUT, **flat)
    info["checksum"] = checksum(flat)
    print("RESULT " + json.dumps(info), flush=True)
    jax.distributed.shutdown()
else:  # the references: full batch -> OUT/single.npz, first half only -> OUT/half.npz
    for name, rows in (("single", ROWS), ("half", ROWS // 2)):
        flat, info = single_process(rows)
        np.savez(f"{OUT}/{name}.npz", **flat)
        print("RESULT " + json.dumps(dict(info, mode=name, checksum=checksum(flat))), flush=True)
