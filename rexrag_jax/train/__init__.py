"""REX-RAG / GRPO training: `rexrag train --gin_file gin/rexrag.gin --gin_file gin/model/<size>.gin ...`.

Modules (submodules are imported on demand; this package imports nothing heavy):
  trainer.py         Trainer: rollout → rewards → π_old / π_ref → probe filtering → advantages →
                     behaviour density → mini-batch updates; checkpoints, resume, SIGTERM, validation
  update.py          jitted update (exact micro-batch accumulation, non-finite skip) and log-prob passes
  prepare.py         host-side batch assembly (rewards, filtering, fixed-shape mini-batches)
  optim.py           AdamW + linear-warmup-then-constant lr (verl semantics)
  checkpoint.py      orbax CheckpointManager wrapper (composite: state + JSON meta, never NaN)
  metrics_log.py     TensorBoard scalars/text, metrics.jsonl, console line
  rollout_source.py  SearchRollout (real multi-turn rollout on the generation engine) + retriever factories
  synthetic.py       SyntheticRollout: deterministic random trajectories for tests / smoke runs
  main.py            the `rexrag train` entry point (gin flags)
"""
