"""QA data in Search-R1 form: readers, prompts, sharded resumable iterators, synthetic world.

The tfds builder lives in `rexrag_jax.data.tfds_qa` (imported on demand: it needs tensorflow-datasets).
"""
from rexrag_jax.data.iterator import ShardedIterator, epoch_permutation, shard_for_host
from rexrag_jax.data.prompts import PROMPT_TEMPLATE, build_prompt_text, render_prompt
from rexrag_jax.data.readers import QADataError, ReadStats, read_qa_file, read_qa_file_with_stats, read_qa_files
from rexrag_jax.data.schema import BENCHMARK_SOURCES, QAExample, canonical_source, infer_data_source

__all__ = ["QAExample", "read_qa_file", "read_qa_file_with_stats", "read_qa_files", "QADataError", "ReadStats",
           "build_prompt_text", "render_prompt", "PROMPT_TEMPLATE", "ShardedIterator", "epoch_permutation",
           "shard_for_host", "BENCHMARK_SOURCES", "canonical_source", "infer_data_source"]
