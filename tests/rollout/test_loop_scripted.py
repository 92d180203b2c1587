"""The rollout loop driven by a scripted engine (a random model never emits tags)."""
import jax
import numpy as np
import pytest

from rexrag_jax.data.prompts import render_prompt
from rexrag_jax.data.schema import QAExample
from rexrag_jax.rl.prompt_pool import DEFAULT_REVISION_PROMPTS
from rexrag_jax.rollout import types as T
from rexrag_jax.rollout.loop import RolloutConfig, format_observation, run_rollouts, truncate_context
from rollout_fakes import FakeRetriever, ScriptedEngine, ToyTokenizer, fake_logprob, question_of

TOK = ToyTokenizer()
EXAMPLES = [QAExample("0", "alpha", ["A"], "nq"), QAExample("1", "beta", ["B"], "hotpotqa")]


def runs(batch, n):
    """[(segment, text)] for maximal runs of equal segment codes in trajectory n (padding dropped)."""
    segs, toks = batch.segments[n], batch.tokens[n]
    out, start = [], 0
    for t in range(1, len(segs) + 1):
        if t == len(segs) or segs[t] != segs[start]:
            if segs[start] != T.SEG_PAD:
                out.append((int(segs[start]), TOK.decode(toks[start:t].tolist())))
            start = t
    return out


def n_turns_done(ctx_text):
    """Turns already taken by this row: observations, invalid notes and probe prompts after the prompt."""
    body = ctx_text.split("<|im_start|>assistant\n", 1)[1]
    return (body.count("<information>") + body.count("My action is invalid.")
            + sum(body.count(p) for p in DEFAULT_REVISION_PROMPTS))


def has_probe_prompt(ctx_text):
    return any(p in ctx_text for p in DEFAULT_REVISION_PROMPTS)


def rollout(responder, batch_size=4, group_size=2, examples=EXAMPLES, seed=0, **cfg):
    engine = ScriptedEngine(TOK, responder, batch_size)
    retriever = FakeRetriever()
    config = RolloutConfig(**cfg)
    batch, stats = run_rollouts(engine, TOK, retriever, examples, group_size, jax.random.PRNGKey(seed), config)
    return batch, stats, engine, retriever


def prompt_text(q):
    return render_prompt(TOK, q)


# ---------------------------------------------------------------------------------------------
SCRIPT_A = {
    0: ["<think> need </think> <search> alpha fact </search>", "<answer> A </answer>"],
    1: ["garbage", "<search> alpha two </search>", "<answer> nope </answer>"],
    2: ["<search> beta </search>", "<search> beta again </search>", "<search> x </search>",
        "<search> never </search> trailing"],
    3: ["<answer> B </answer> ignored"],
}


def script_a(row, ctx_text, ctx_tokens):
    return SCRIPT_A[row][n_turns_done(ctx_text)]


def hits(q, k=3):
    return FakeRetriever().search([q], k)[0]


def test_multi_turn_segments_and_observations():
    batch, stats, engine, retriever = rollout(script_a, max_turns=3, probes=False)
    assert batch.size == 4 and not batch.is_probe.any()
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    P0, P1 = prompt_text("alpha"), prompt_text("beta")
    R, I, V, PR = T.SEG_RESPONSE, T.SEG_INFO, T.SEG_INVALID, T.SEG_PROMPT
    assert runs(batch, 0) == [(PR, P0), (R, SCRIPT_A[0][0]), (I, format_observation(hits("alpha fact"))),
                              (R, "<answer> A </answer>")]
    assert runs(batch, 1) == [(PR, P0), (R, "garbage"), (V, "\nMy action is invalid. "),
                              (R, "<search> alpha two </search>"), (I, format_observation(hits("alpha two"))),
                              (R, "<answer> nope </answer>")]
    # 3 search-enabled turns, then a final turn whose <search> is not executed; text cut after </search>
    assert runs(batch, 2) == [(PR, P1), (R, "<search> beta </search>"), (I, format_observation(hits("beta"))),
                              (R, "<search> beta again </search>"), (I, format_observation(hits("beta again"))),
                              (R, "<search> x </search>"), (I, format_observation(hits("x"))),
                              (R, "<search> never </search>")]
    assert runs(batch, 3) == [(PR, P1), (R, "<answer> B </answer>")]
    assert batch.num_searches.tolist() == [1, 1, 3, 0]
    # ONE retriever call per turn with every search query of that turn, top-k = 3; none in the final turn
    assert retriever.calls == [(["alpha fact", "beta"], 3), (["alpha two", "beta again"], 3), (["x"], 3)]
    assert stats["searches"] == 5 and stats["retriever_calls"] == 3 and stats["invalid_actions"] == 1
    assert stats["turns"] == 4 and stats["answers"] == 3
    # loss mask = response | probe; logprobs sit on sampled tokens only (slot == index here)
    np.testing.assert_array_equal(batch.loss_mask, (batch.segments == R) | (batch.segments == T.SEG_PROBE))
    for n in range(batch.size):
        for t in range(batch.tokens.shape[1]):
            want = fake_logprob(t) if batch.segments[n, t] == R else 0.0
            assert batch.sample_logprobs[n, t] == pytest.approx(want), (n, t)
        length = int(batch.lengths[n])
        assert batch.attention_mask[n, :length].all() and not batch.attention_mask[n, length:].any()
        prompt_len = len(TOK.encode(P0 if n < 2 else P1))
        assert batch.response_text[n] == TOK.decode(batch.tokens[n, prompt_len:length].tolist())
    assert (batch.tokens[batch.segments == T.SEG_PAD] == TOK.pad_id).all()


def test_obs_truncated_to_max_obs_tokens():
    def always_search(row, ctx_text, ctx_tokens):
        return f"<search> {question_of(ctx_text)} </search>"
    batch, stats, _, retriever = rollout(always_search, max_turns=2, max_obs_tokens=10, probes=False)
    for n in range(batch.size):
        info = [txt for seg, txt in runs(batch, n) if seg == T.SEG_INFO]
        q = batch.examples[n].question + "?"
        full = TOK.encode(format_observation(hits(q)))
        assert info == [TOK.decode(full[:10])] * 2
        assert (batch.segments[n] == T.SEG_INFO).sum() == 20
    assert stats["obs_truncated"] == 8 and len(retriever.calls) == 2
    assert batch.num_searches.tolist() == [2, 2, 2, 2]


def test_eos_without_action_is_trimmed_when_the_row_continues():
    eos = TOK.eos_id

    def script(row, ctx_text, ctx_tokens):
        if n_turns_done(ctx_text) == 0:
            return TOK.encode("babble") + [eos]
        return "<answer> A </answer>"
    batch, stats, engine, _ = rollout(script, batch_size=1, group_size=1, examples=EXAMPLES[:1], max_turns=2)
    assert eos not in batch.tokens[0].tolist()
    assert [s for s, _ in runs(batch, 0)] == [T.SEG_PROMPT, T.SEG_RESPONSE, T.SEG_INVALID, T.SEG_RESPONSE]
    assert runs(batch, 0)[1][1] == "babble" and stats["eos_trimmed"] == 1
    assert engine.cache[0] == batch.tokens[0, : batch.lengths[0]].tolist()

    # a trajectory that ends on EOS (final, search-disabled turn) keeps it
    batch, stats, _, _ = rollout(lambda *a: TOK.encode("end") + [eos], batch_size=1, group_size=1,
                                 examples=EXAMPLES[:1], max_turns=0)
    assert batch.tokens[0, batch.lengths[0] - 1] == eos and stats["eos_trimmed"] == 0


def test_left_truncation_keeps_prompt_and_latest_tokens():
    seen = []

    def script(row, ctx_text, ctx_tokens):
        seen.append(list(ctx_tokens))
        return "<search> a rather long query text to fill the context </search>"
    prompt_len = len(TOK.encode(prompt_text("alpha")))
    max_context = prompt_len + 60
    batch, stats, _, _ = rollout(script, batch_size=1, group_size=1, examples=EXAMPLES[:1], max_turns=4,
                                 max_obs_tokens=25, max_context=max_context, probes=False)
    assert stats["context_truncations"] >= 2
    traj = batch.tokens[0, : batch.lengths[0]].tolist()
    assert len(traj) > max_context                                # the trajectory keeps everything
    starts = [t for t in range(len(traj)) if batch.segments[0, t] == T.SEG_RESPONSE
              and batch.segments[0, t - 1] != T.SEG_RESPONSE]
    assert len(seen) == len(starts) == 5
    for ctx, start in zip(seen, starts):  # each turn's context = prompt + newest tokens of the trajectory
        assert len(ctx) <= max_context
        assert ctx == truncate_context(traj[:start], prompt_len, max_context)


def test_engine_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size=3 < 4"):
        run_rollouts(ScriptedEngine(TOK, script_a, 3), TOK, FakeRetriever(), EXAMPLES, 2, 0, RolloutConfig())
    with pytest.raises(ValueError, match="max_len"):
        run_rollouts(ScriptedEngine(TOK, script_a, 4, max_len=1000), TOK, FakeRetriever(), EXAMPLES, 2, 0,
                     RolloutConfig())


# --- probes ------------------------------------------------------------------------------------
def script_probe(row, ctx_text, ctx_tokens):
    """row 0: wrong answer in turn 0 (" <" straddles "<answer>"); row 1: right answer; row 2: searches
    until the final turn and answers wrong there; row 3: invalid, then a wrong answer. Probes search once
    (beta) or answer wrong again."""
    q, turn = question_of(ctx_text), n_turns_done(ctx_text)
    if has_probe_prompt(ctx_text):
        after = ctx_text.split(next(p for p in DEFAULT_REVISION_PROMPTS if p in ctx_text), 1)[1]
        if q == "beta?" and "<information>" not in after:
            return " then <search> probe query </search>"
        return " so <answer> still wrong </answer>"
    if row == 0:
        return "<think> hmm </think> x <answer> wrong </answer>"
    if row == 1:
        return "<answer>A</answer>"
    if row == 2:
        return "<search> s </search>" if turn < 3 else "<answer> late wrong </answer>"
    return "junk" if turn == 0 else "<think>ok</think><answer> nope </answer>"


def _check_probe(batch, engine, n_probe, n_orig, answer_turn_text):
    """The probe = original up to `<answer>` + one pool prompt + its own continuation."""
    orig_len, plen = int(batch.lengths[n_orig]), int(batch.probe_start[n_probe])
    prompt_len = len(TOK.encode(prompt_text(batch.examples[n_orig].question)))
    orig_text = TOK.decode(batch.tokens[n_orig, prompt_len:orig_len].tolist())
    probe_prefix_text = TOK.decode(batch.tokens[n_probe, prompt_len:plen].tolist())
    assert orig_text.endswith(answer_turn_text)
    assert probe_prefix_text == orig_text[: orig_text.rindex("<answer>")]
    inserted = TOK.decode(batch.tokens[n_probe, plen: plen + batch.probe_len[n_probe]].tolist())
    assert inserted in DEFAULT_REVISION_PROMPTS and batch.probe_len[n_probe] == len(TOK.encode(inserted))
    assert (batch.segments[n_probe, plen: plen + batch.probe_len[n_probe]] == T.SEG_PROBE).all()
    assert (batch.segments[n_probe] == T.SEG_PROBE).sum() == batch.probe_len[n_probe]
    assert batch.group_ids[n_probe] == batch.group_ids[n_orig] and batch.examples[n_probe] == batch.examples[n_orig]
    # tokens the original generated before the boundary are shared verbatim (ids, segments, logprobs)
    same = 0
    while batch.tokens[n_probe, same] == batch.tokens[n_orig, same] and same < plen:
        same += 1
    np.testing.assert_array_equal(batch.segments[n_probe, :same], batch.segments[n_orig, :same])
    np.testing.assert_array_equal(batch.sample_logprobs[n_probe, :same], batch.sample_logprobs[n_orig, :same])
    return same, plen


@pytest.mark.parametrize("slot_mode", ["source", "free"])
def test_probe_creation_rules_and_layout(slot_mode):
    bs = 4 if slot_mode == "source" else 8
    batch, stats, engine, retriever = rollout(script_probe, batch_size=bs, max_turns=3, revision_prob=1.0,
                                              probe_slot=slot_mode)
    # originals first, then probes in creation order: row 0's (turn 0) and row 3's (turn 1)
    assert batch.size == 6 and batch.is_probe.tolist() == [False] * 4 + [True] * 2
    assert stats["probe_candidates"] == 2 and stats["probes_created"] == 2    # row 2 answered in the final turn
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 0, 1]
    assert (batch.probe_start[:4] == -1).all() and (batch.probe_len[:4] == 0).all()

    same, plen = _check_probe(batch, engine, 4, 0, "<think> hmm </think> x <answer> wrong </answer>")
    # " <" straddled the boundary: that token is dropped and " " re-appended as response text, logprob 0
    assert same == plen - 1 and TOK.decode([int(batch.tokens[4, plen - 1])]) == " "
    assert batch.segments[4, plen - 1] == T.SEG_RESPONSE and batch.sample_logprobs[4, plen - 1] == 0.0
    assert runs(batch, 4)[-1] == (T.SEG_RESPONSE, " so <answer> still wrong </answer>")

    same3, plen3 = _check_probe(batch, engine, 5, 3, "<think>ok</think><answer> nope </answer>")
    assert same3 == plen3                                    # no straddle: pure prefix of the original
    tail = runs(batch, 5)[-4:]
    assert tail[0][0] == T.SEG_PROBE and tail[1] == (T.SEG_RESPONSE, " then <search> probe query </search>")
    assert tail[2] == (T.SEG_INFO, format_observation(hits("probe query")))
    assert tail[3] == (T.SEG_RESPONSE, " so <answer> still wrong </answer>")      # probes never probed again
    assert batch.num_searches.tolist() == [0, 0, 3, 0, 0, 1]
    third = ["s", "probe query"] if slot_mode == "source" else ["probe query", "s"]   # queries in row order
    assert retriever.calls == [(["s"], 3), (["s"], 3), (third, 3)]

    # the engine rows of the probes hold exactly their trajectories (no recomputation of the prefix)
    ops = [op for op in engine.log if op[0] in ("truncate", "copy_prefix")]
    if slot_mode == "source":
        assert ops == [("truncate", 0, same), ("truncate", 3, same3)]
        rows = {4: 0, 5: 3}
    else:
        assert [op[:2] for op in ops] == [("copy_prefix", 0), ("copy_prefix", 3)]
        # slots of ended trajectories are reused: row 1 (answered right in turn 0), then row 0
        assert ops[0][2:] == (1, same) and ops[1][2:] == (0, same3)
        rows = {4: ops[0][2], 5: ops[1][2]}
    for n, row in rows.items():
        assert engine.cache[row] == batch.tokens[n, : batch.lengths[n]].tolist()
    assert stats["prefill_tokens_saved_by_splice"] == same + same3


def test_no_probes_when_disabled_or_zero_probability():
    for cfg in (dict(probes=False, revision_prob=1.0), dict(probes=True, revision_prob=0.0)):
        batch, stats, _, _ = rollout(script_probe, max_turns=3, **cfg)
        assert batch.size == 4 and not batch.is_probe.any() and stats["probes_created"] == 0


def all_wrong(row, ctx_text, ctx_tokens):
    if has_probe_prompt(ctx_text):
        return " <answer> again </answer>"
    return "<answer> wrong </answer>"


def test_budget_and_free_slot_drops_are_counted():
    batch, stats, _, _ = rollout(all_wrong, max_turns=2, revision_prob=1.0, max_probe_fraction=0.5)
    assert stats["probes_created"] == 2 and stats["probes_dropped_budget"] == 2 and batch.is_probe.sum() == 2

    # free-slot mode with no spare rows: the first candidate finds none (the other source is still
    # needed), the second reuses the first source's row
    batch, stats, engine, _ = rollout(all_wrong, batch_size=2, group_size=2, examples=EXAMPLES[:1], max_turns=2,
                                      revision_prob=1.0, probe_slot="free", max_probe_fraction=1.0)
    assert stats["probes_dropped_no_slot"] == 1 and stats["probes_created"] == 1
    assert [op for op in engine.log if op[0] == "copy_prefix"][0][1:3] == (1, 0)
    assert batch.is_probe.tolist() == [False, False, True]


def test_probe_rate_matches_revision_prob():
    """Over many wrong answers the probe count is Binomial(n, p) (4.5 sigma bounds), for p and 20/101."""
    many = [QAExample(str(i), f"q{i}", ["right"], "nq") for i in range(50)]
    for cfg, p in ((dict(revision_prob=0.2), 0.2), (dict(revision_prob=0.2, reference_revision_bug=True), 20 / 101)):
        created = 0
        for seed in range(2):
            batch, stats, _, _ = rollout(all_wrong, batch_size=250, group_size=5, examples=many, seed=seed,
                                         max_turns=1, **cfg)
            assert stats["probe_candidates"] == 250
            created += stats["probes_created"]
        n = 500
        assert abs(created - n * p) < 4.5 * np.sqrt(n * p * (1 - p)), (created, n * p)


def test_probe_that_overflows_the_context_is_reprefilled_truncated():
    seen = []

    def script(row, ctx_text, ctx_tokens):
        seen.append(list(ctx_tokens))
        if has_probe_prompt(ctx_text):
            return "<answer> again </answer>"
        return "<think> " + "long thoughts " * 3 + "</think><answer> wrong </answer>"
    prompt_len = len(TOK.encode(prompt_text("alpha")))
    max_context = prompt_len + 50            # the turn fits; turn + revision prompt does not
    batch, stats, _, _ = rollout(script, batch_size=1, group_size=1, examples=EXAMPLES[:1], max_turns=2,
                                 max_context=max_context, revision_prob=1.0)
    assert batch.is_probe.tolist() == [False, True] and stats["context_truncations"] == 1
    assert stats["prefill_tokens_saved_by_splice"] == 0       # the splice was undone by the re-prefill
    end = int(batch.probe_start[1] + batch.probe_len[1])
    assert seen[1] == truncate_context(batch.tokens[1, :end].tolist(), prompt_len, max_context)
    assert len(seen[1]) == max_context and seen[1][:prompt_len] == batch.tokens[1, :prompt_len].tolist()
