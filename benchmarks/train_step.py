"""GRPO train-step time: rexrag_jax's jitted update vs Tunix 0.1.7 (google-tunix), same run, same shapes.

One "train step" here = one optimizer update on a mini-batch of B trajectories (prompt P + completion
C tokens), gradient-accumulated over B/M micro-batches, GRPO token-level clipped loss + k3 KL
(coef 0.001), token-mean aggregation, AdamW with clip 1.0 and weight decay 0.01, random-init Qwen2 of
the chosen preset. Ours: rexrag_jax.train.update.make_update_fn (one jitted call per mini-batch,
lax.scan over micro-batches, params/opt state donated). Tunix: tunix.rl.trainer.Trainer with its
registered "grpo" loss, wired as GRPOLearner wires it (nnx.jit per micro-batch, optax.MultiSteps).

Tunix runs in its own venv (never installed into the system Python, whose jax/flax others use):
    python -m venv /tmp/tunix-venv && /tmp/tunix-venv/bin/pip install google-tunix==0.1.7
    python benchmarks/train_step.py [--tunix_python /tmp/tunix-venv/bin/python] [--preset small]
If the Tunix side cannot run, the script says so and still times ours. Prints median seconds per
step for both and the ratio ours / Tunix (target <= 1.0).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16, help="trajectories per mini-batch (one optimizer step)")
    ap.add_argument("--micro", type=int, default=8, help="trajectories per micro-batch")
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--completion_len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block (after one compile step)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved blocks per side")
    ap.add_argument("--logprob_chunk", type=int, default=0, help="ours: 0 = full logits (as Tunix)")
    ap.add_argument("--tunix_python", default="/tmp/tunix-venv/bin/python")
    return ap.parse_args(argv)


def _inputs(cfg, a):
    import numpy as np
    rng = np.random.default_rng(0)
    B, P, C = a.batch, a.prompt_len, a.completion_len
    comp_len = rng.integers(C // 2, C + 1, B)
    T = P + C
    pos = np.arange(T)[None]
    attn = pos < (P + comp_len)[:, None]
    loss_mask = attn & (pos >= P)
    tokens = np.where(attn, rng.integers(2, cfg.vocab_size, (B, T)), 0).astype(np.int32)
    base = -np.log(cfg.vocab_size)  # random init is close to uniform
    lp = lambda: np.where(loss_mask, rng.normal(base, 0.01, (B, T)), 0).astype(np.float32)  # noqa: E731
    return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask, "behaviour_logp": lp(),
            "ref_logp": lp(), "advantages": rng.normal(size=B).astype(np.float32), "is_probe": np.zeros(B, bool)}


def setup_ours(a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.train.optim import OptimizerConfig
    from rexrag_jax.train.update import LossConfig, make_update_fn

    cfg = Qwen2Config.from_preset(a.preset)
    opt_cfg = OptimizerConfig(learning_rate=1e-6, warmup_fraction=0.0)
    opt = opt_cfg.make()
    update = make_update_fn(cfg, opt, LossConfig(kl_coef=0.001, logprob_chunk=a.logprob_chunk or None))
    params = qwen2.init_params(cfg, jax.random.PRNGKey(0))
    state = opt.init(params)
    n = a.batch // a.micro
    mb = {k: jnp.asarray(v.reshape((n, a.micro) + v.shape[1:])) for k, v in _inputs(cfg, a).items()}
    lr, poison = jnp.float32(1e-6), jnp.bool_(False)
    box = {"params": params, "state": state}

    def block():
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            box["params"], box["state"], m = update(box["params"], box["state"], mb, lr, poison)
            jax.block_until_ready((box["params"], m))
            times.append(time.perf_counter() - t0)
        return times

    t0 = time.perf_counter()
    box["params"], box["state"], m = update(box["params"], box["state"], mb, lr, poison)
    jax.block_until_ready(m)
    return block, {"compile_s": time.perf_counter() - t0, "jax": jax.__version__,
                   "devices": jax.devices()[0].platform}


def setup_tunix(a):
    from rexrag_jax.models.qwen2.config import Qwen2Config

    if not os.path.exists(a.tunix_python):
        return {"error": f"no Tunix venv at {a.tunix_python} (see this script's docstring to create it)"}
    cfg = Qwen2Config.from_preset(a.preset)
    if not cfg.tie_word_embeddings:
        return {"error": f"preset {a.preset} has untied embeddings; the Tunix side builds a tied model"}
    args = {"num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_heads": cfg.num_heads, "head_dim": cfg.head_dim,
            "num_kv_heads": cfg.num_kv_heads, "rope_theta": cfg.rope_theta, "batch": a.batch, "micro": a.micro,
            "prompt_len": a.prompt_len, "completion_len": a.completion_len, "lr": 1e-6, "kl_coef": 0.001,
            "steps": a.steps}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    try:
        proc = subprocess.Popen([a.tunix_python, str(HERE / "_tunix_grpo_step.py"), json.dumps(args)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return {"error": f"Tunix run failed to start: {e}"}

    def read_json():
        for line in proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        proc.wait()
        return {"error": f"Tunix run exited {proc.returncode}: {proc.stderr.read().strip().splitlines()[-1:]}"}

    info = read_json()
    if "error" in info:
        return info

    def block():
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = read_json()
        if "error" in out:
            raise RuntimeError(out["error"])
        return out["times_s"]

    info["block"], info["proc"] = block, proc
    return info


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None) -> int:
    a = _args(argv)
    sys.path.insert(0, str(HERE.parent))
    print(f"GRPO train step: preset={a.preset} mini-batch={a.batch} micro={a.micro} "
          f"T={a.prompt_len}+{a.completion_len} timed steps={a.steps}", flush=True)
    ours_block, ours = setup_ours(a)
    tunix = setup_tunix(a)
    ours_times, tunix_times = [], []
    for _ in range(a.rounds):  # interleaved blocks: load changes on a shared machine hit both sides alike
        ours_times += ours_block()
        if "error" not in tunix:
            tunix_times += tunix["block"]()
    print(f"rexrag_jax: median {_median(ours_times):.4f} s/step (compile {ours['compile_s']:.1f} s, "
          f"jax {ours['jax']}, {ours['devices']}) steps {[round(t, 3) for t in ours_times]}", flush=True)
    if "error" in tunix:
        print(f"Tunix 0.1.7: NOT MEASURED: {tunix['error']}")
        return 0
    tunix["proc"].stdin.close()
    tunix["proc"].wait(timeout=60)
    print(f"Tunix 0.1.7: median {_median(tunix_times):.4f} s/step (compile {tunix['compile_s']:.1f} s, "
          f"jax {tunix['jax']}, {tunix['devices']}) steps {[round(t, 3) for t in tunix_times]}")
    ratio = _median(ours_times) / _median(tunix_times)
    print(f"ratio ours/Tunix = {ratio:.2f}x (target <= 1.0x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
