"""Host-side multi-turn rollout loop with REX-RAG probes; emits `TrajectoryBatch` (see loop.py, types.py)."""
from rexrag_jax.rollout.loop import (RolloutConfig, format_observation, parse_action, required_batch_size,
                                     run_rollouts, truncate_context)
from rexrag_jax.rollout.types import (SEG_INFO, SEG_INVALID, SEG_PAD, SEG_PROBE, SEG_PROMPT, SEG_RESPONSE,
                                      SEGMENT_NAMES, TrajectoryBatch, concat)

__all__ = ["RolloutConfig", "run_rollouts", "required_batch_size", "parse_action", "format_observation",
           "truncate_context", "TrajectoryBatch", "concat", "SEG_PROMPT", "SEG_RESPONSE", "SEG_INVALID",
           "SEG_INFO", "SEG_PROBE", "SEG_PAD", "SEGMENT_NAMES"]
