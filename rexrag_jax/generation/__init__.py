"""Jitted KV-cache generation: chunked prefill/append, decode loop, stop strings, row-prefix copy."""
from rexrag_jax.generation.engine import GenerationEngine, GenOut
from rexrag_jax.generation.stops import find_stop_cut, stop_token_sequences

__all__ = ["GenerationEngine", "GenOut", "find_stop_cut", "stop_token_sequences"]
