"""RAPO run type: the project's Trainer with hybrid rollouts and the RAPO update inputs.

One RAPO step s (differences from Trainer.train_step in brackets):
  1. questions → hybrid rollouts [run_hybrid_rollouts: buffer steps spliced in with p = 0.5; no probes]
  2. rewards R (prepare.score), fit_length
  3. π_old log-probs + entropies (the Trainer's old-policy pass) [entropies feed the retrieval reward]
  4. [rapo_update_arrays: A = (1 + 0.2 A_ret) A_acc, inserted tokens masked, ratio shaping folded
     into the behaviour log-prob] — no probe filtering, no behaviour density, β = 0
  5. mini-batch updates with the Trainer's jitted update step (ε = 0.28 from TrainConfig)
  6. [every policy step of each trajectory with R >= 1 goes into the trace buffer]
Checkpoints also write the buffer to <run_dir>/trace_buffer/<step> (atomic), restored with the step.

    python -m rexrag_jax.rapo.trainer --gin_file gin/rapo.gin --gin_file gin/model/qwen2.5-3b.gin ... --run_dir R
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time

import gin
import jax
import jax.numpy as jnp

from rexrag_jax.rapo.hook import RapoConfig, rapo_update_arrays
from rexrag_jax.rapo import synthetic  # noqa: F401  registers SyntheticHybridRollout with gin
from rexrag_jax.rapo.hybrid_rollout import HybridConfig, run_hybrid_rollouts
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, minilm_encode_fn
from rexrag_jax.train import prepare
from rexrag_jax.train.rollout_source import SearchRollout
from rexrag_jax.train.trainer import Trainer, _update_summary, step_seed


@gin.configurable
class HybridSearchRollout(SearchRollout):
    """SearchRollout whose rollouts are RAPO hybrids; owns the trace buffer (MiniLM keys by default)."""

    def __init__(self, tokenizer_path: str = gin.REQUIRED, retriever=gin.REQUIRED, config=None,
                 decode_chunk: int = 16, hybrid: HybridConfig | None = None, buffer_capacity: int = 20_000,
                 buffer_searcher: str = "exact", encoder_max_length: int = 256, buffer: TraceBuffer | None = None):
        super().__init__(tokenizer_path, retriever, config, decode_chunk)
        self.config = dataclasses.replace(self.config, probes=False)
        self.hybrid = hybrid or HybridConfig()
        self.buffer = buffer if buffer is not None else TraceBuffer(
            minilm_encode_fn(max_length=encoder_max_length), buffer_capacity, buffer_searcher)

    def __call__(self, params, examples, group_size: int, seed: int, use_probes: bool = False):
        self.engine.params = params
        return run_hybrid_rollouts(self.engine, self.tokenizer, self.retriever, examples, group_size,
                                   jax.random.PRNGKey(seed), self.buffer, self.config, self.hybrid)


@gin.configurable(denylist=["run_dir"])
class RapoTrainer(Trainer):
    """Trainer for the RAPO run type. `rollout` must expose `.buffer` (TraceBuffer) and `.tokenizer.decode`."""

    def __init__(self, run_dir: str, rapo: RapoConfig | None = None, **kw):
        super().__init__(run_dir, **kw)
        self.rapo = rapo or RapoConfig()
        c, r = self.cfg, self.rapo
        if (c.eps_low, c.eps_high, c.kl_coef, c.use_probes) != (r.clip_eps, r.clip_eps, r.kl_coef, False):
            raise ValueError(f"RapoTrainer: TrainConfig eps_low={c.eps_low}, eps_high={c.eps_high}, "
                             f"kl_coef={c.kl_coef}, use_probes={c.use_probes}; RAPO needs {r.clip_eps}, {r.clip_eps}, {r.kl_coef}, False "
                             "(gin/rapo.gin sets them)")
        for attr in ("buffer", "tokenizer"):
            if not hasattr(self.rollout, attr):
                raise ValueError(f"RapoTrainer: the rollout source {type(self.rollout).__name__} has no .{attr}")
        self.buffer_root = os.path.join(self.run_dir, "trace_buffer")

    def train_step(self) -> dict:
        cfg, s = self.cfg, self.step
        t0 = time.perf_counter()
        questions = next(self.data)
        batch, rstats = self.rollout(self.params, questions, cfg.group_size, step_seed(cfg.seed, s), False)
        t_rollout = time.perf_counter() - t0
        rewards, correct = prepare.score(batch, cfg.structure_format_score)
        batch.rewards = rewards
        batch, truncated = prepare.fit_length(batch, cfg.length_bucket, cfg.max_seq_len)
        with self._mesh_ctx():
            old_logp, entropy = self._rows(self._logprob, self.params, batch.tokens, batch.attention_mask)
        arrays, rapo_stats = rapo_update_arrays(batch, rewards, old_logp, entropy, self.rapo)
        t_logprob = time.perf_counter() - t0 - t_rollout

        outs = self._run_updates(arrays, s)
        t_update = time.perf_counter() - t0 - t_rollout - t_logprob

        added = self.rollout.buffer.add_successful(batch, rewards, self.rollout.tokenizer.decode,
                                                   self.rapo.success_threshold)
        self.step += 1
        metrics = _update_summary(outs)
        metrics.update(rapo_stats)
        mask = arrays["loss_mask"]
        metrics.update({"reward/mean": float(rewards.mean()), "em/train": float(correct.mean()),
                        "entropy": float((entropy * mask).sum() / max(mask.sum(), 1)), "lr": float(jnp.float32(self.opt_cfg.lr_at(s))),
                        "rapo/buffer_size": len(self.rollout.buffer), "rapo/buffer_added": added,
                        "rapo/inserted_tokens": int((batch.segments == SEG_RETRIEVED).sum()),
                        "truncated_rows": truncated, "batch/trajectories": batch.size, "time/rollout": t_rollout,
                        "time/logprob": t_logprob, "time/update": t_update, "time/step": time.perf_counter() - t0})
        for k, v in rstats.items():
            if isinstance(v, (int, float)):
                metrics[f"rollout/{k}"] = v
        return metrics

    # --- the buffer travels with the checkpoints -----------------------------------------------------
    def save(self) -> None:
        super().save()
        self.rollout.buffer.save(os.path.join(self.buffer_root, str(self.step)))
        steps = sorted(int(d) for d in os.listdir(self.buffer_root) if d.isdigit())
        for old in steps[:-self.cfg.keep_checkpoints]:
            shutil.rmtree(os.path.join(self.buffer_root, str(old)), ignore_errors=True)

    def maybe_restore(self) -> bool:
        if not super().maybe_restore():
            return False
        path = os.path.join(self.buffer_root, str(self.step))
        if os.path.isdir(path):
            old = self.rollout.buffer
            self.rollout.buffer = TraceBuffer.load(path, old.encode_fn, capacity=old.capacity,
                                                   searcher=old.searcher_kind, scann_min_size=old.scann_min_size,
                                                   encoder_name=old.encoder_name)
        else:
            print(f"warning: no trace buffer at {path}; RAPO resumes with the current (empty) buffer", flush=True)
        return True


def main(argv=None) -> int:
    """`rexrag train` with RapoTrainer in place of Trainer (use with gin/rapo.gin).

    train.main builds `Trainer(run_dir)` by name, imported from train.trainer when called; until it
    takes the trainer class from gin, this entry point swaps that name for the duration of the run.
    """
    import rexrag_jax.train.trainer as trainer_mod
    from rexrag_jax.train import main as train_main

    saved, trainer_mod.Trainer = trainer_mod.Trainer, RapoTrainer
    try:
        return train_main.main(argv)
    finally:
        trainer_mod.Trainer = saved


if __name__ == "__main__":
    sys.exit(main())
