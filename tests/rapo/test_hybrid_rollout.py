"""Hybrid rollouts on the scripted engine: insertion rate, segment codes / loss mask of inserted steps,
KV cache contents, answer-step policy, determinism, retrieved-step searches executed."""
import jax
import numpy as np
import pytest

from rexrag_jax.data.schema import QAExample
from rexrag_jax.rapo.hybrid_rollout import HybridConfig, run_hybrid_rollouts
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, history_key
from rexrag_jax.rollout import types as T
from rexrag_jax.rollout.loop import RolloutConfig, format_observation
from rapo_fakes import FakeRetriever, ScriptedEngine, ToyTokenizer, bow_encode, fake_logprob

TOK = ToyTokenizer()
STORED = ["<think> stored a </think> <search> stored query a </search>",
          "<think> stored b </think> <search> stored query b </search>"]


def n_done(ctx_text):
    body = ctx_text.split("<|im_start|>assistant\n", 1)[1]
    return body.count("<information>") + body.count("My action is invalid.")


def responder(row, ctx_text, ctx_tokens):
    """Searches for 3 turns, then answers."""
    k = n_done(ctx_text)
    return f"<think> r{row} t{k} </think> <answer> A </answer>" if k >= 3 else f"<search> r{row} t{k} </search>"


def buffer_with(values, recorder=None):
    def enc(texts):
        if recorder is not None:
            recorder.extend(texts)
        return bow_encode(texts)
    buf = TraceBuffer(enc, capacity=100, searcher="exact")
    buf.add([f"question about stored {i}" for i in range(len(values))], values)
    if recorder is not None:
        recorder.clear()
    return buf


def run(buffer, n_examples=4, group=4, seed=0, max_turns=5, **hyb):
    examples = [QAExample(str(i), f"q{i}", ["A"], "nq") for i in range(n_examples)]
    engine = ScriptedEngine(TOK, responder, n_examples * group)
    retriever = FakeRetriever()
    batch, stats = run_hybrid_rollouts(engine, TOK, retriever, examples, group, jax.random.PRNGKey(seed), buffer,
                                       RolloutConfig(probes=False, max_turns=max_turns), HybridConfig(**hyb))
    return batch, stats, engine, retriever


def runs(batch, n):
    segs, toks = batch.segments[n], batch.tokens[n]
    out, start = [], 0
    for t in range(1, len(segs) + 1):
        if t == len(segs) or segs[t] != segs[start]:
            if segs[start] != T.SEG_PAD:
                out.append((int(segs[start]), TOK.decode(toks[start:t].tolist()), start, t))
            start = t
    return out


def test_insertion_rate_segments_masks_and_cache():
    batch, stats, engine, retriever = run(buffer_with(STORED), insert_prob=0.5)
    # every step (model turn) of every trajectory is either generated (RESPONSE run) or inserted
    inserted_steps = generated_steps = 0
    for n in range(batch.size):
        length = int(batch.attention_mask[n].sum())
        assert engine.cache[n] == batch.tokens[n, :length].tolist()  # the KV cache holds the inserted text
        for seg, text, s, e in runs(batch, n):
            if seg == SEG_RETRIEVED:
                inserted_steps += 1
                assert text in STORED
                assert not batch.loss_mask[n, s:e].any() and (batch.sample_logprobs[n, s:e] == 0).all()
            elif seg == T.SEG_RESPONSE:
                generated_steps += 1
                assert batch.loss_mask[n, s:e].all()
                np.testing.assert_allclose(batch.sample_logprobs[n, s:e], [fake_logprob(p) for p in range(s, e)])
        # an inserted <search> is executed like a generated one
        segs = runs(batch, n)
        for (seg, text, s, e), nxt in zip(segs, segs[1:]):
            if seg == SEG_RETRIEVED:
                query = text.split("<search>")[1].split("</search>")[0].strip()
                assert nxt[0] == T.SEG_INFO and nxt[1] == format_observation(FakeRetriever().search([query], 3)[0])
    decisions = inserted_steps + generated_steps
    assert stats["insertions"] == inserted_steps == stats["insert_draws"] and stats["insert_misses"] == 0
    assert decisions >= 60
    # Binomial(decisions, 0.5): 4 sigma band
    assert abs(inserted_steps - 0.5 * decisions) <= 4 * np.sqrt(0.25 * decisions), (inserted_steps, decisions)
    assert stats["inserted_tokens"] == int((batch.segments == SEG_RETRIEVED).sum())
    assert batch.loss_mask.sum() == int((batch.segments == T.SEG_RESPONSE).sum())
    assert stats["insert_log"] and all(t <= 5 for t, _, _ in stats["insert_log"])


@pytest.mark.parametrize("p", [0.0, 0.25, 1.0])
def test_configured_rate(p):
    batch, stats, _, _ = run(buffer_with(STORED), n_examples=8, group=4, insert_prob=p, seed=3)
    gen = sum(1 for n in range(batch.size) for r in runs(batch, n) if r[0] == T.SEG_RESPONSE)
    ins = stats["insertions"]
    if p == 0.0:
        assert ins == 0 and not (batch.segments == SEG_RETRIEVED).any()
    elif p == 1.0:  # inserted searches in all 5 search turns; the final turn is generated (an answer)
        assert ins == batch.size * 5 and gen == batch.size
        assert all(runs(batch, n)[-1][0] == T.SEG_RESPONSE and "<answer>" in runs(batch, n)[-1][1]
                   for n in range(batch.size))
    else:
        assert abs(ins - p * (ins + gen)) <= 4 * np.sqrt(p * (1 - p) * (ins + gen)), (ins, gen)


def test_deterministic_per_seed():
    a = run(buffer_with(STORED), seed=5)[1]["insert_log"]
    b = run(buffer_with(STORED), seed=5)[1]["insert_log"]
    c = run(buffer_with(STORED), seed=6)[1]["insert_log"]
    assert a == b and a != c


def test_answer_steps_skipped_unless_allowed():
    answer = "<think> stored </think> <answer> A </answer>"
    batch, stats, _, _ = run(buffer_with([answer]), insert_prob=1.0, insert_answers=False, max_turns=2)
    assert stats["insertions"] == 0 and stats["insert_misses"] == stats["insert_draws"] > 0
    batch, stats, _, _ = run(buffer_with([answer]), insert_prob=1.0, insert_answers=True, max_turns=2)
    assert stats["insertions"] == batch.size  # each trajectory ends with the inserted answer at turn 0
    for n in range(batch.size):
        assert [r[0] for r in runs(batch, n)] == [T.SEG_PROMPT, SEG_RETRIEVED]
        assert batch.response_text[n] == answer


def test_queries_use_history_keys():
    seen = []
    run(buffer_with(STORED, recorder=seen), n_examples=2, group=1, insert_prob=1.0, max_turns=2)
    assert seen[:2] == [history_key("q0", ""), history_key("q1", "")]
    second = seen[2]  # row 0 after its inserted first step and the observation
    assert second.startswith("q0\n<think> stored") and second.endswith("</information>\n\n")


def test_empty_buffer_and_bad_config():
    batch, stats, _, _ = run(TraceBuffer(bow_encode), insert_prob=1.0, max_turns=1)
    assert stats["insertions"] == 0 and not (batch.segments == SEG_RETRIEVED).any()
    with pytest.raises(ValueError, match="probes must be False"):
        run_hybrid_rollouts(ScriptedEngine(TOK, responder, 1), TOK, FakeRetriever(), [QAExample("0", "q", ["A"], "nq")],
                            1, 0, TraceBuffer(bow_encode), RolloutConfig(probes=True))
    with pytest.raises(ValueError, match="insert_prob=1.5"):
        HybridConfig(insert_prob=1.5)


def test_final_turn_inserts_only_answers():
    answer = "<think> stored </think> <answer> A </answer>"
    buf = buffer_with(STORED + [answer])  # the search steps' keys are nearer to nothing in particular
    batch, stats, _, _ = run(buf, insert_prob=1.0, insert_answers=False, max_turns=0)
    assert stats["insert_draws"] == 0 and not (batch.segments == SEG_RETRIEVED).any()
    batch, stats, _, _ = run(buf, insert_prob=1.0, insert_answers=True, max_turns=0)
    assert stats["insertions"] == batch.size and all(t == answer for t in batch.response_text)
