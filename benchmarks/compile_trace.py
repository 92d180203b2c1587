"""Which rollout-engine programs (prefill / decode shape keys) each RL step adds, and its compile count.

    JAX_LOG_COMPILES=1 python benchmarks/compile_trace.py --demo_run runs/replication/seed3/warm --seed 3

Diagnosis of recompiles after the first steps (docs/benchmarks/train.md); with JAX_LOG_COMPILES=1 jax
also names every other program compiled (the query encoder, the trainer's passes).
"""
import sys, os, collections, tempfile, argparse
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE); sys.path.insert(0, os.path.dirname(HERE))
import rl_step
from rexrag_jax.generation import kernels, engine as eng
from rexrag_jax.train import compile_watch

keys_seen = set()
step_keys = collections.defaultdict(list)
cur = [0]
orig_prefill, orig_decode = kernels.prefill, kernels.decode_chunk
def prefill(*a, **k):
    key = ("prefill", a[6].shape[0], a[6].shape[1], k["window"], k["all_rows"], k["owned_rows"])
    if key not in keys_seen:
        keys_seen.add(key); step_keys[cur[0]].append(key)
    return orig_prefill(*a, **k)
def decode(*a, **k):
    key = ("decode", k["window"], k["greedy"], k["use_top_p"], k["steps"])
    if key not in keys_seen:
        keys_seen.add(key); step_keys[cur[0]].append(key)
    return orig_decode(*a, **k)
eng.kernels.prefill = prefill; eng.kernels.decode_chunk = decode
ap = argparse.ArgumentParser(); ap.add_argument("--demo_run"); ap.add_argument("--seed", type=int); ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--config", default="replication")
a0 = ap.parse_args()
a = rl_step._args(["--demo_run", a0.demo_run, "--config", a0.config, "--seed", str(a0.seed)])
compile_watch.install()
with tempfile.TemporaryDirectory() as work:
    trainer, label = rl_step.build_trainer(a, os.path.join(work, "rl"))
    print("engine batch", trainer.rollout.engine.batch_size if hasattr(trainer.rollout, "engine") else "?",
          "chunk", getattr(getattr(trainer.rollout, "engine", None), "prefill_chunk", "?"),
          "min_window", getattr(getattr(trainer.rollout, "engine", None), "min_window", "?"), flush=True)
    for i in range(a0.steps):
        cur[0] = i
        c0 = compile_watch.compilations()
        m = trainer.train_step()
        print(f"step {i}: {m['time/step']:.2f}s compiles +{compile_watch.compilations() - c0}; new engine keys {len(step_keys[i])}: {sorted(step_keys[i])}", flush=True)
    trainer.ckpt.close()
