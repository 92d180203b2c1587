"""RAPO (arXiv 2603.03078, SPEC §8): step-trace buffer, hybrid rollouts, trainer hook."""
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, history_key, minilm_encode_fn, trajectory_steps

__all__ = ["SEG_RETRIEVED", "TraceBuffer", "history_key", "minilm_encode_fn", "trajectory_steps"]
