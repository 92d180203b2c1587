"""Tunix side of benchmarks/train_step.py: one GRPO mini-batch update with Tunix's own trainer.

Run by train_step.py inside a separate venv that has google-tunix installed (never the system Python):
    /tmp/tunix-venv/bin/python benchmarks/_tunix_grpo_step.py '<json args>'
Prints a JSON line {"compile_s", "jax", "devices"} after compiling, then, for each line read on stdin,
a JSON line {"times_s": [...]} timing `steps` more updates (so the caller can interleave both sides). Uses tunix.models.qwen2.Qwen2 (random init), Tunix's
registered "grpo" policy loss (token-level PPO clip + low_var_kl, loss_agg_mode="token-mean"), and
rl.trainer.Trainer's jitted train step (nnx.jit, optimizer donated); gradient accumulation over
micro-batches is Tunix's: optax.MultiSteps, one jitted call per micro-batch.
"""
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen2 import model as tq
from tunix.rl import algo_core, common
from tunix.rl import trainer as rl_trainer
from tunix.rl.grpo.grpo_learner import GRPOConfig
from tunix.sft import peft_trainer


def main(a: dict) -> None:
    cfg = tq.ModelConfig(num_layers=a["num_layers"], vocab_size=a["vocab_size"], embed_dim=a["hidden_size"],
                         hidden_dim=a["intermediate_size"], num_heads=a["num_heads"], head_dim=a["head_dim"],
                         num_kv_heads=a["num_kv_heads"], rope_theta=int(a["rope_theta"]), norm_eps=1e-6,
                         use_tied_embedding=True)
    model = tq.Qwen2(cfg, rngs=nnx.Rngs(0))
    B, M, P, C = a["batch"], a["micro"], a["prompt_len"], a["completion_len"]
    accum = B // M
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(a["lr"], weight_decay=0.01))
    tcfg = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, gradient_accumulation_steps=accum if accum > 1 else None,
                                       checkpoint_root_directory=None)
    trainer = rl_trainer.Trainer(model, opt, tcfg, custom_checkpoint_metadata_fn=lambda: {})
    algo = GRPOConfig(num_generations=2, beta=a["kl_coef"], kl_loss_mode="low_var_kl", epsilon=0.2,
                      loss_agg_mode="token-mean")
    algo.temperature = 1.0  # GRPOLearner sets this from the rollout config
    # Wired exactly as GRPOLearner does (a loss closure + gen_model_input_fn building the kwargs).
    def loss_fn(model, train_example, algo_config):
        return algo_core.grpo_loss_fn(model, train_example, algo_config=algo_config, pad_id=0, eos_id=1)

    trainer.with_loss_fn(loss_fn, has_aux=True)
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    train_step, _ = trainer.jit_train_and_eval_step()

    rng = np.random.default_rng(0)
    examples = []
    for _ in range(accum):
        comp_len = rng.integers(C // 2, C + 1, M)
        completion = rng.integers(2, cfg.vocab_size, (M, C)).astype(np.int32)
        cmask = (np.arange(C)[None] < comp_len[:, None]).astype(np.int32)
        completion = np.where(cmask > 0, completion, 0)
        examples.append(common.TrainExample(
            prompt_ids=jnp.asarray(rng.integers(2, cfg.vocab_size, (M, P)).astype(np.int32)),
            prompt_mask=jnp.ones((M, P), jnp.int32), completion_ids=jnp.asarray(completion),
            completion_mask=jnp.asarray(cmask), advantages=jnp.asarray(rng.normal(size=M).astype(np.float32)),
            ref_per_token_logps=jnp.asarray(rng.normal(-np.log(cfg.vocab_size), 0.01, (M, C)).astype(np.float32)),
            old_per_token_logps=jnp.asarray(rng.normal(-np.log(cfg.vocab_size), 0.01, (M, C)).astype(np.float32))))

    def update():  # one optimizer step = `accum` micro-batch calls (MultiSteps applies on the last)
        out = None
        for ex in examples:
            out = train_step(ex)
        jax.block_until_ready(out)
        return out

    t0 = time.perf_counter()
    update()
    compile_s = time.perf_counter() - t0
    info = {"compile_s": compile_s, "jax": jax.__version__, "devices": str(jax.devices()[0].platform)}
    print(json.dumps(info), flush=True)
    # Interleaved timing: train_step.py writes one line per block; we answer with that block's times.
    for _ in sys.stdin:
        times = []
        for _ in range(a["steps"]):
            t0 = time.perf_counter()
            out = update()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times_s": times, "loss": float(out[0])}), flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main(json.loads(sys.argv[1]))
