"""Hybrid rollouts on the scripted engine, the paper's rule (SPEC §8): only N_hybrid rows per group are
hybrid, no insertion at step 0, every insertion followed by a policy step, the step wrapped in
<retrieve>...</retrieve> with one prompt sentence about it, its observation from the buffer (no tool
call); insertion rate, segment codes / loss mask, KV cache contents, determinism, skipped step kinds."""
import jax
import numpy as np
import pytest

from rexrag_jax.data.schema import QAExample
from rexrag_jax.rapo.hybrid_rollout import DEFAULT_PROMPT_NOTE, HybridConfig, insertable, run_hybrid_rollouts, wrap_step
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, history_key
from rexrag_jax.rollout import types as T
from rexrag_jax.rollout.loop import RolloutConfig
from rapo_fakes import FakeRetriever, ScriptedEngine, ToyTokenizer, bow_encode, fake_logprob

TOK = ToyTokenizer()
STORED = ["<think> stored a </think> <search> stored query a </search>\n\n<information>stored obs a</information>\n\n",
          "<think> stored b </think> <search> stored query b </search>\n\n<information>stored obs b</information>\n\n"]


def n_done(ctx_text):
    body = ctx_text.split("<|im_start|>assistant\n", 1)[1]
    return body.count("<information>") + body.count("My action is invalid.")


def responder(row, ctx_text, ctx_tokens):
    """Searches until 3 steps are done (an inserted step counts: it holds an observation), then answers."""
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


def kinds(batch, n):
    return [r[0] for r in runs(batch, n)]


def test_rule_every_step_of_a_hybrid_row():
    """p = 1: hybrid rows (first 2 of each group of 4) alternate policy / inserted steps from step 1 on;
    the other rows never insert. Inserted steps are wrapped, carry the stored observation, and make no
    tool call; the cache holds the trajectory; the prompt has the sentence about <retrieve>."""
    batch, stats, engine, retriever = run(buffer_with(STORED), insert_prob=1.0)
    P, R, I, S = T.SEG_PROMPT, T.SEG_RESPONSE, T.SEG_INFO, SEG_RETRIEVED
    for n in range(batch.size):
        length = int(batch.attention_mask[n].sum())
        assert engine.cache[n] == batch.tokens[n, :length].tolist()
        prompt = TOK.decode(batch.tokens[n, :int((batch.segments[n] == P).sum())].tolist())
        assert DEFAULT_PROMPT_NOTE in prompt and prompt.count(DEFAULT_PROMPT_NOTE) == 1
        if n % 4 < 2:  # hybrid: t0 search, t1 insert, t2 search, t3 insert, t4 answer (5 info blocks seen)
            assert kinds(batch, n) == [P, R, I, S, R, I, S, R], kinds(batch, n)
            assert batch.num_searches[n] == 2  # the two inserted observations were not tool calls
        else:         # pure on-policy: search, search, search, answer
            assert kinds(batch, n) == [P, R, I, R, I, R, I, R], kinds(batch, n)
            assert batch.num_searches[n] == 3
        for seg, text, s, e in runs(batch, n):
            if seg == S:
                assert text in {wrap_step(v) for v in STORED} and text.startswith("<retrieve><think> stored")
                assert text.endswith("</information></retrieve>\n\n")
                assert not batch.loss_mask[n, s:e].any() and (batch.sample_logprobs[n, s:e] == 0).all()
            elif seg == R:
                assert batch.loss_mask[n, s:e].all()
                np.testing.assert_allclose(batch.sample_logprobs[n, s:e], [fake_logprob(p) for p in range(s, e)])
    # no retriever call ever carried a stored query; calls = executed searches only
    queries = [q for qs, _ in retriever.calls for q in qs]
    assert not any("stored" in q for q in queries)
    assert len(queries) == stats["searches"] == int(batch.num_searches.sum()) == 8 * 2 + 8 * 3
    assert stats["tool_calls_per_traj"] == 2.5
    assert stats["insertions"] == 16 and stats["insertions_per_traj"] == 1.0
    assert stats["insertions_per_hybrid_traj"] == 2.0 and stats["hybrid_rows"] == 8
    assert stats["hybrid_rows_per_group"] == 2 and stats["insert_misses"] == 0 and stats["inserted_cut"] == 0
    assert stats["inserted_tokens"] == int((batch.segments == SEG_RETRIEVED).sum())
    assert batch.loss_mask.sum() == int((batch.segments == T.SEG_RESPONSE).sum())
    assert sorted({t for t, _, _ in stats["insert_log"]}) == [1, 3]
    assert 0 < stats["hit_score_mean"] <= 1.0 + 1e-6


def test_no_insertion_at_step_0_and_never_back_to_back():
    """At any rate, in every trajectory: the first step is the policy's, each inserted step is followed
    (after nothing else) by a policy step, and only hybrid rows insert."""
    for p in (0.5, 1.0):
        for seed in range(3):
            batch, stats, _, _ = run(buffer_with(STORED), n_examples=3, group=4, insert_prob=p, seed=seed,
                                     max_turns=6)
            for n in range(batch.size):
                k = kinds(batch, n)
                steps = [x for x in k if x in (T.SEG_RESPONSE, SEG_RETRIEVED)]
                assert steps[0] == T.SEG_RESPONSE and steps[-1] == T.SEG_RESPONSE
                assert all(not (a == b == SEG_RETRIEVED) for a, b in zip(steps, steps[1:]))
                for i, x in enumerate(k):
                    if x == SEG_RETRIEVED:
                        assert k[i + 1] == T.SEG_RESPONSE  # the observation is inside the block
                if n % 4 >= 2:
                    assert SEG_RETRIEVED not in k
            assert all(1 <= t < 6 for t, _, _ in stats["insert_log"])


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_configured_rate(p):
    """Insertions among the eligible row-steps (hybrid row, 1 <= t < max_turns, previous step not
    inserted) follow Binomial(eligible, p): 4 sigma band."""
    ins = elig = 0
    for seed in range(4):
        _, stats, _, _ = run(buffer_with(STORED), n_examples=8, group=4, insert_prob=p, seed=seed, max_turns=8)
        assert stats["insertions"] == stats["insert_draws"] and stats["insert_misses"] == 0
        ins, elig = ins + stats["insertions"], elig + stats["insert_eligible"]
    assert elig >= 100
    assert abs(ins - p * elig) <= 4 * np.sqrt(p * (1 - p) * elig), (ins, elig)


def test_rate_zero_and_num_hybrid_knob():
    batch, stats, _, _ = run(buffer_with(STORED), insert_prob=0.0)
    assert stats["insertions"] == 0 and not (batch.segments == SEG_RETRIEVED).any()
    assert stats["insert_eligible"] > 0
    batch, stats, _, _ = run(buffer_with(STORED), insert_prob=1.0, num_hybrid=4)
    assert stats["hybrid_rows"] == batch.size and all(SEG_RETRIEVED in kinds(batch, n) for n in range(batch.size))
    batch, stats, _, _ = run(buffer_with(STORED), insert_prob=1.0, num_hybrid=0)
    assert stats["hybrid_rows"] == 0 and stats["insert_eligible"] == 0 and stats["insertions"] == 0
    batch, stats, _, _ = run(buffer_with(STORED), insert_prob=1.0, group=5)  # None: group_size // 2 = 2
    assert stats["hybrid_rows_per_group"] == 2 and stats["hybrid_rows"] == 8
    with pytest.raises(ValueError, match="num_hybrid=5 > group_size=4"):
        run(buffer_with(STORED), num_hybrid=5)
    with pytest.raises(ValueError, match="num_hybrid=-1"):
        HybridConfig(num_hybrid=-1)


def test_deterministic_per_seed():
    a = run(buffer_with(STORED), seed=5)[1]["insert_log"]
    b = run(buffer_with(STORED), seed=5)[1]["insert_log"]
    c = run(buffer_with(STORED), seed=6)[1]["insert_log"]
    assert a == b and a != c


def test_only_complete_search_steps_are_inserted():
    answer = "<think> stored </think> <answer> A </answer>"
    bare = "<think> stored </think> <search> stored q </search>"  # no observation stored
    invalid = "<think> stored, no action </think>\nMy action is invalid. "
    for v in (answer, bare, invalid):
        assert not insertable(v)
    assert all(insertable(v) for v in STORED)
    batch, stats, _, _ = run(buffer_with([answer, bare, invalid]), insert_prob=1.0, max_turns=3)
    assert stats["insertions"] == 0 and stats["insert_misses"] == stats["insert_draws"] > 0
    assert not (batch.segments == SEG_RETRIEVED).any()
    # with an insertable step among the hits it is the one used
    batch, stats, _, _ = run(buffer_with([answer, bare, STORED[0]]), insert_prob=1.0, max_turns=3)
    assert stats["insertions"] > 0 and stats["insert_misses"] == 0
    assert all(r[1] == wrap_step(STORED[0]) for n in range(batch.size) for r in runs(batch, n) if r[0] == SEG_RETRIEVED)


def test_queries_use_history_keys():
    seen = []
    run(buffer_with(STORED, recorder=seen), n_examples=2, group=2, insert_prob=1.0, max_turns=2)
    # turn 1: the hybrid rows (trajectories 0 and 2) query with their history after step 0
    assert len(seen) == 2
    assert seen[0].startswith("q0\n<search> r0 t0 </search>") and seen[0].endswith("</information>\n\n")
    assert seen[1].startswith("q1\n<search> r2 t0 </search>")
    assert seen[0] == history_key("q0", seen[0].split("\n", 1)[1])


def test_insert_budget_keeps_closing_tag():
    batch, stats, _, _ = run(buffer_with(STORED), insert_prob=1.0, max_insert_tokens=40, max_turns=3)
    assert stats["insertions"] > 0 and stats["inserted_cut"] == stats["insertions"]
    for n in range(batch.size):
        for seg, text, s, e in runs(batch, n):
            if seg == SEG_RETRIEVED:
                assert e - s == 40 and text.startswith("<retrieve><think>") and text.endswith("</retrieve>\n\n")


def test_short_runs_empty_buffer_and_bad_config():
    # max_turns = 1: the only insertable turn would be 1, whose next step (the final turn) would not exist
    batch, stats, _, _ = run(buffer_with(STORED), insert_prob=1.0, max_turns=1)
    assert stats["insert_eligible"] == 0 and not (batch.segments == SEG_RETRIEVED).any()
    batch, stats, _, _ = run(TraceBuffer(bow_encode), insert_prob=1.0, max_turns=3)
    assert stats["insertions"] == 0 and not (batch.segments == SEG_RETRIEVED).any()
    with pytest.raises(ValueError, match="probes must be False"):
        run_hybrid_rollouts(ScriptedEngine(TOK, responder, 1), TOK, FakeRetriever(), [QAExample("0", "q", ["A"], "nq")],
                            1, 0, TraceBuffer(bow_encode), RolloutConfig(probes=True))
    with pytest.raises(ValueError, match="insert_prob=1.5"):
        HybridConfig(insert_prob=1.5)


def test_prompt_note_knob():
    batch, _, _, _ = run(buffer_with(STORED), n_examples=1, group=2, prompt_note="", max_turns=2)
    from rexrag_jax.data.prompts import render_prompt
    n_prompt = int((batch.segments[0] == T.SEG_PROMPT).sum())
    assert batch.tokens[0, :n_prompt].tolist() == TOK.encode(render_prompt(TOK, "q0"))
    text = render_prompt(TOK, "q0", "Extra sentence.")
    assert "</answer>. Extra sentence. Question: q0?\n" in text
