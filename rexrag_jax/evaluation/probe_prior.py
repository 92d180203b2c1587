"""Does a revision prompt help this policy? Probe success vs fresh-sample success (REX-RAG's premise).

REX-RAG assumes that after a wrong conclusion, a revision prompt ("<think> Perhaps I overlooked ...")
makes the policy search on and sometimes find the answer, more often than simply sampling the question
again. Measured on questions the policy gets wrong greedily (the hard ones, where a fair baseline is a
fresh sample of the *same* question):

    fresh_success = mean EM of the sampled originals (group_size per question, no prompt),
    probe_success = mean EM of the probes: every original that answers wrongly in a search-enabled turn
                    is cut before its `<answer>` and continued after one pool prompt (revision_prob = 1,
                    exactly the training-time probe construction of rexrag_jax.rollout),
    reflect_rate  = share of originals that write a second `<think>` right after a `</think>` on their
                    own (unprompted self-reflection; the paper's base model rarely does this).

Probes continue *failed* originals, so they start from harder states than fresh samples; a ratio
above 1 is the prior REX-RAG exploits.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

_SELF_REFLECT = re.compile(r"</think>\s*<think>")


def probe_vs_fresh(rollout, params, examples, group_size: int = 4, seed: int = 0, batch_questions: int = 8,
                   temperature: float = 1.0) -> dict:
    """{probe_success, fresh_success, ratio, n_questions, n_fresh, n_probes, reflect_rate} on `examples`.

    rollout: a SearchRollout (rexrag_jax.train.rollout_source), e.g. the greedy evaluator: its config is
    reused with sampling at `temperature`, probes on; its engine must hold batch_questions * group_size rows.
    """
    from rexrag_jax.rewards import exact_match, extract_last_answer
    from rexrag_jax.rollout import run_rollouts

    cfg = dataclasses.replace(rollout.config, greedy=False, temperature=temperature, probes=True, revision_prob=1.0, max_probe_fraction=1.0,
                              probe_slot="source")
    rollout.engine.params = params
    if rollout.engine.batch_size < batch_questions * group_size:
        raise ValueError(f"probe_vs_fresh: engine has {rollout.engine.batch_size} rows < {batch_questions} questions "
                         f"x group_size {group_size}")
    fresh, probe, reflect = [], [], []
    for i, lo in enumerate(range(0, len(examples), batch_questions)):
        part = list(examples[lo:lo + batch_questions])
        batch, _ = run_rollouts(rollout.engine, rollout.tokenizer, rollout.retriever, part, group_size,
                                jax.random.PRNGKey(seed * 100003 + i), cfg, rollout.prompts)
        for ex, text, is_probe in zip(batch.examples, batch.response_text, batch.is_probe):
            em = exact_match(extract_last_answer(text), ex.golden_answers)
            (probe if is_probe else fresh).append(em)
            if not is_probe:
                reflect.append(bool(_SELF_REFLECT.search(text)))
    f = float(np.mean(fresh)) if fresh else float("nan")
    p = float(np.mean(probe)) if probe else float("nan")
    return {"probe_success": p, "fresh_success": f, "ratio": p / f if f > 0 else float("inf") if p > 0 else float("nan"),
            "n_questions": len(examples), "n_fresh": len(fresh), "n_probes": len(probe),
            "reflect_rate": float(np.mean(reflect)) if reflect else float("nan")}


def greedy_wrong(examples, records) -> list:
    """The examples whose greedy evaluation record (rexrag_jax.evaluation.evaluate) has EM < 1."""
    wrong = {r["id"] for r in records if r["em"] < 1.0}
    return [ex for ex in examples if ex.id in wrong]
