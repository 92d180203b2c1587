"""RAPO run type: the project's Trainer with hybrid rollouts and the RAPO update inputs.

One RAPO step s = Trainer.train_step with these hooks (differences in brackets):
  1. questions → hybrid rollouts [run_hybrid_rollouts: in N_hybrid rows per group, buffer steps (with
     their observations, no tool call) spliced in with p = 0.5 from step 1 on, never twice in a row; no probes]
  2. rewards R (prepare.score), fit_length
  3. π_old log-probs + entropies (the Trainer's old-policy pass) [entropies feed the retrieval reward]
  4. [rapo_update_arrays: A = (1 + 0.2 A_ret) A_acc, inserted tokens masked, ratio shaping folded
     into the behaviour log-prob, per-sequence mean aggregation] — no probe filtering, no behaviour
     density, β = 0
  5. mini-batch updates with the Trainer's jitted update step (ε = 0.28 from TrainConfig)
  6. [online filling only: every policy step of each trajectory with R >= 1 goes into the trace buffer]
The trace buffer: with `RapoTrainer.trace_buffer_dir` (gin TRACE_BUFFER_DIR) it is the static buffer that
`rexrag build-trace-buffer` wrote (the paper's: a stronger agent's top-K trajectories, checked at start:
encoder, world = the training questions, non-empty; rapo/static_buffer.py), and it does not change
(`online_fill` None -> False). Without a dir the buffer starts empty and fills online from the run's own
successes (`online_fill` None -> True; not the paper's method). With online filling the buffer is
written with every checkpoint to <run_dir>/trace_buffer/<step> (atomic) and restored with the step; a
static buffer without online filling is not copied into the run (it is reloaded from its dir).

    python -m rexrag_jax.rapo.trainer --gin_file gin/rapo.gin --gin_file gin/model/qwen2.5-3b.gin ... --run_dir R
"""
from __future__ import annotations

import dataclasses
import sys

import gin
import jax

from rexrag_jax.io import paths
from rexrag_jax.rapo.hook import RapoConfig, rapo_update_arrays
from rexrag_jax.rapo import synthetic  # noqa: F401  registers SyntheticHybridRollout with gin
from rexrag_jax.rapo.hybrid_rollout import HybridConfig, run_hybrid_rollouts
from rexrag_jax.rapo.static_buffer import load_static_buffer, questions_fingerprint
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, minilm_encode_fn
from rexrag_jax.train.rollout_source import SearchRollout
from rexrag_jax.train.trainer import Trainer


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
    """Trainer for the RAPO run type. `rollout` must expose `.buffer` (TraceBuffer) and `.tokenizer.decode`.

    trace_buffer_dir: a static buffer (`rexrag build-trace-buffer`), loaded into `rollout.buffer` and checked
    before the model is built (StartupInputError: `rexrag train` prints one line and exits 2).
    online_fill: add the run's own successful steps to the buffer after each update; None = True without a
    trace_buffer_dir (the behaviour before static buffers), False with one (the paper's static buffer).
    """

    def __init__(self, run_dir: str, rapo: RapoConfig | None = None, trace_buffer_dir: str | None = None,
                 online_fill: bool | None = None, **kw):
        self.trace_buffer_dir = trace_buffer_dir or None
        self.online_fill = (self.trace_buffer_dir is None) if online_fill is None else bool(online_fill)
        self.static_manifest = None
        # fail at start: before the model is built when rollout and questions are passed here; under gin
        # they are Trainer's bindings, injected into Trainer.__init__, so the check follows it
        early = bool(self.trace_buffer_dir) and "rollout" in kw and "train_examples" in kw
        if early:
            self._load_static_buffer(kw["rollout"], kw["train_examples"])
        super().__init__(run_dir, **kw)
        if self.trace_buffer_dir and not early:
            self._load_static_buffer(self.rollout, self.train_examples)
        self.rapo = rapo or RapoConfig()
        c, r = self.cfg, self.rapo
        if (c.eps_low, c.eps_high, c.kl_coef, c.use_probes) != (r.clip_eps, r.clip_eps, r.kl_coef, False):
            raise ValueError(f"RapoTrainer: TrainConfig eps_low={c.eps_low}, eps_high={c.eps_high}, "
                             f"kl_coef={c.kl_coef}, use_probes={c.use_probes}; RAPO needs {r.clip_eps}, {r.clip_eps}, {r.kl_coef}, False "
                             "(gin/rapo.gin sets them)")
        for attr in ("buffer", "tokenizer"):
            if not hasattr(self.rollout, attr):
                raise ValueError(f"RapoTrainer: the rollout source {type(self.rollout).__name__} has no .{attr}")
        hybrid = getattr(self.rollout, "hybrid", None)
        if hybrid is not None:  # fail at start, not at the first rollout
            try:
                hybrid.hybrid_rows(c.group_size)
            except ValueError as e:
                raise ValueError(f"RapoTrainer: {e} (TrainConfig.group_size); bind NUM_HYBRID with GROUP_SIZE") from None
        self.buffer_root = paths.join(self.run_dir, "trace_buffer")  # a local path or under a gs:// run dir

    def _load_static_buffer(self, rollout, train_examples) -> None:
        old = getattr(rollout, "buffer", None)
        if old is None or train_examples is None:
            raise ValueError("RapoTrainer.trace_buffer_dir needs a rollout source with .buffer and train_examples")
        buf, m = load_static_buffer(self.trace_buffer_dir, old.encode_fn,
                                    world_id=questions_fingerprint(list(train_examples)),
                                    extra_capacity=old.capacity if self.online_fill else 0,
                                    searcher=old.searcher_kind, encoder_name=old.encoder_name)
        buf.scann_min_size = old.scann_min_size
        rollout.buffer, self.static_manifest = buf, m
        chars = getattr(getattr(rollout, "hybrid", None), "history_chars", None)
        if chars is not None and m.get("history_chars") not in (None, chars):
            print(f"warning: {self.trace_buffer_dir}: keys built with history_chars={m['history_chars']}, the "
                  f"hybrid lookup uses HybridConfig.history_chars={chars}", flush=True)
        print(f"static trace buffer {self.trace_buffer_dir}: {len(buf)} steps "
              f"({m['counts'].get('insertable_steps')} insertable) from {m['counts'].get('trajectories_kept')} "
              f"trajectories, online filling {'on' if self.online_fill else 'off'}", flush=True)

    # Trainer.train_step with the RAPO hooks: no probes (use_probes is False, checked above), no
    # filtering / behaviour density / reference pass; the trace buffer grows after the update.
    def _update_inputs(self, batch, rewards, correct, old_logp, entropy) -> tuple[dict, dict]:
        arrays, metrics = rapo_update_arrays(batch, rewards, old_logp, entropy, self.rapo)
        mask = arrays["loss_mask"]
        metrics.update({"reward/mean": float(rewards.mean()), "em/train": float(correct.mean()),
                        "entropy": float((entropy * mask).sum() / max(mask.sum(), 1)),
                        "rapo/inserted_tokens": int((batch.segments == SEG_RETRIEVED).sum()),
                        "searches/mean": float(batch.num_searches.mean()),  # tool calls actually made
                        "batch/trajectories": batch.size})
        return arrays, metrics

    def train_step(self) -> dict:
        metrics = super().train_step()
        # the update's ratio is the shaped one (rapo.hook folds 1 + m F_ret into the behaviour log-prob)
        if "all/clip_frac" in metrics:
            metrics["rapo/shaped_ratio_clip_frac"] = metrics["all/clip_frac"]
        if "rollout/hit_score_mean" in metrics:
            metrics["rapo/buffer_hit_similarity"] = metrics["rollout/hit_score_mean"]
        return metrics

    def _after_update(self, batch, rewards) -> dict:
        if not self.online_fill:  # static buffer: unchanged during training
            return {"rapo/buffer_size": len(self.rollout.buffer), "rapo/buffer_added": 0}
        added = self.rollout.buffer.add_successful(batch, rewards, self.rollout.tokenizer.decode,
                                                   self.rapo.success_threshold)
        return {"rapo/buffer_size": len(self.rollout.buffer), "rapo/buffer_added": added}

    # --- the buffer travels with the checkpoints -----------------------------------------------------
    def save(self) -> None:
        super().save()
        if not self.online_fill:  # static: nothing of the buffer changes, it is reloaded from its dir
            return
        self.rollout.buffer.save(paths.join(self.buffer_root, str(self.step)))
        steps = sorted(int(d) for d in paths.listdir(self.buffer_root) if d.isdigit())
        for old in steps[:-self.cfg.keep_checkpoints]:
            paths.remove_tree(paths.join(self.buffer_root, str(old)))

    def maybe_restore(self) -> bool:
        if not super().maybe_restore():
            return False
        if not self.online_fill:  # the static buffer loaded at start is the buffer of every step
            return True
        path = paths.join(self.buffer_root, str(self.step))
        if paths.isfile(paths.join(path, "entries.json")):  # on GCS: written last, so the buffer is whole
            old = self.rollout.buffer
            self.rollout.buffer = TraceBuffer.load(path, old.encode_fn, capacity=old.capacity,
                                                   searcher=old.searcher_kind, scann_min_size=old.scann_min_size,
                                                   encoder_name=old.encoder_name)
        else:
            print(f"warning: no trace buffer at {path}; RAPO resumes with the current (empty) buffer", flush=True)
        return True


def main(argv=None) -> int:
    """`rexrag train` with `run_type.trainer = @RapoTrainer` (gin/rapo.gin binds it too, so
    `rexrag train --gin_file gin/rapo.gin ...` is the same run)."""
    from rexrag_jax.train import main as train_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return train_main.main(argv + ["--gin_bindings", "run_type.trainer = @RapoTrainer"])


if __name__ == "__main__":
    sys.exit(main())
