"""Greedy evaluation and re-scoring of trajectory dumps; per-data_source EM tables."""
from rexrag_jax.evaluation.dumps import read_trajectory_dump, strip_prompt
from rexrag_jax.evaluation.runner import build_generate_fn, evaluate, write_jsonl_atomic
from rexrag_jax.evaluation.scoring import Summary, format_table, score_and_summarize, score_response, summarize

__all__ = ["evaluate", "build_generate_fn", "score_and_summarize", "summarize", "score_response", "format_table",
           "Summary", "read_trajectory_dump", "strip_prompt", "write_jsonl_atomic"]
