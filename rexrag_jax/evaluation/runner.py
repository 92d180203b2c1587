"""Greedy evaluation loop: batched generate_fn over QAExamples, scoring, trajectory jsonl, summary."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Sequence

from tqdm.auto import tqdm

from rexrag_jax.data.schema import QAExample
from rexrag_jax.io import paths
from rexrag_jax.evaluation.scoring import Summary, score_and_summarize

GenerateFn = Callable[[list[QAExample]], list[str]]


def write_jsonl_atomic(path, records) -> None:
    """Write records as jsonl to a temp file beside `path`, then rename (a failure leaves `path` intact).
    A gs:// URL is written as one upload (rexrag_jax.io.paths: the object appears whole or not at all)."""
    path = os.fspath(path)
    if paths.is_remote(path):
        paths.write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def evaluate(examples: Sequence[QAExample], generate_fn: GenerateFn, *, batch_size: int = 64,
             out_path=None, progress: bool = True, raw_fallback: bool = False) -> tuple[list[dict], Summary]:
    """Run `generate_fn` over `examples` in batches, score every response, optionally dump all trajectories.

    generate_fn(list[QAExample]) -> list[str] returns one response text per example (the model's
    turns and the appended observations, without the prompt); `rexrag_jax.rollout` provides it for a
    policy + retriever (see `build_generate_fn`). Returns (records, summary); each record is
    {"id", "data_source", "question", "golden_answers", "response", "prediction", "em"}.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    records = []
    with tqdm(total=len(examples), desc="eval", unit="q", disable=not progress) as bar:
        for lo in range(0, len(examples), batch_size):
            batch = list(examples[lo:lo + batch_size])
            responses = generate_fn(batch)
            if len(responses) != len(batch):
                raise ValueError(f"generate_fn returned {len(responses)} responses for {len(batch)} examples")
            for ex, resp in zip(batch, responses):
                if not isinstance(resp, str):
                    raise TypeError(f"generate_fn must return strings, got {type(resp).__name__} for id {ex.id}")
                records.append({"id": ex.id, "data_source": ex.data_source, "question": ex.question,
                                "golden_answers": list(ex.golden_answers), "response": resp})
            bar.update(len(batch))
    records, summary = score_and_summarize(records, raw_fallback=raw_fallback)
    if out_path is not None:
        write_jsonl_atomic(out_path, records)
    return records, summary


# ---------------------------------------------------------------------------------------------------
# WIRING POINT (model-running path). Everything above is model-free and tested; this function is the
# one place that turns a policy checkpoint + retriever into a generate_fn, via evaluation/policy.py
# (imported lazily so `rexrag eval --rescore` never imports JAX models).
# ---------------------------------------------------------------------------------------------------
def build_generate_fn(**model_kwargs) -> GenerateFn:
    """generate_fn for greedy, probe-free rollouts (SPEC §1 loop: 500 tokens/turn, top-3, max 5 turns).

    `rexrag_jax.evaluation.policy.make_eval_generate_fn(**model_kwargs)`; model_kwargs come from
    `rexrag eval` (checkpoint, tokenizer, gin files/params, retriever url or corpus, ...).
    """
    from rexrag_jax.evaluation.policy import make_eval_generate_fn

    return make_eval_generate_fn(**model_kwargs)
