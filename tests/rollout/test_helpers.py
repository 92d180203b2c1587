"""Pure helpers of the rollout loop and the TrajectoryBatch container."""
import math

import numpy as np
import pytest

from rexrag_jax.data.schema import QAExample
from rexrag_jax.rollout import types as T
from rexrag_jax.rollout.loop import (RolloutConfig, format_observation, parse_action, required_batch_size,
                                     search_r1_cut,
                                     revision_draw, split_at_char, truncate_context)
from rollout_fakes import ToyTokenizer


def test_parse_action_search_answer_invalid():
    a = parse_action("<think> x </think>\n<search>  capital of France </search>")
    assert (a.kind, a.content) == ("search", "capital of France")
    assert a.start == len("<think> x </think>\n") and a.end == len("<think> x </think>\n<search>  capital of France </search>")
    b = parse_action("I think <answer> Paris\n</answer>")
    assert (b.kind, b.content, b.start) == ("answer", "Paris", len("I think "))
    assert parse_action("no tags, <search> unclosed").kind is None
    assert parse_action("<search> a </answer>").kind is None       # mismatched tags are not an action
    # first complete block wins (Search-R1's re.search)
    c = parse_action("<answer> a </answer><search> b </search>")
    assert (c.kind, c.content) == ("answer", "a")


@pytest.mark.parametrize("turn, kind, content", [
    ("<think> not </answer> yet </think><answer> Paris </answer>", "answer", "Paris"),   # stray closer
    ("<think> </answer> hmm </think><search> q </search>", "search", "q"),
    ("<answer> a </answer> <answer> b </answer>", "answer", "a"),                        # duplicated: first
    ("<search> s </search><answer> a </answer>", "search", "s"),
    ("<answer> a <answer> b </answer>", "answer", "a <answer> b"),                       # nested: regex's
    ("<think> </answer> </think>", None, ""),
])
def test_parse_action_first_complete_block(turn, kind, content):
    """The engine keeps the turn up to the first complete block (stop_blocks); parse_action takes the
    regex's first match; on turns whose first closer closes a block this is Search-R1's action."""
    from rexrag_jax.generation.stops import _first_stop_end

    end = _first_stop_end(turn, ("</search>", "</answer>"), blocks=True)
    kept = turn if end < 0 else turn[:end]
    act = parse_action(kept)
    assert (act.kind, act.content) == (kind, content)
    ref = parse_action(search_r1_cut(turn))
    if turn.startswith("<think> not"):      # the documented difference: the reference cuts at the stray
        assert ref.kind is None             # `</answer>` (no `</search>` in the turn) -> invalid
    else:
        assert (ref.kind, ref.content) == (kind, content)


def test_format_observation_matches_search_r1_layout():
    hits = [{"document": {"id": "1", "contents": '"Paris"\nParis is the capital.'}, "score": 0.9},
            {"document": {"id": "2", "contents": '"Lyon"\nLyon is a city.\nSecond line.'}, "score": 0.5}]
    expected = ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital.\n'
                'Doc 2(Title: "Lyon") Lyon is a city.\nSecond line.</information>\n\n')
    assert format_observation(hits) == expected


def test_truncate_context_keeps_prompt_and_recent_tokens():
    toks = list(range(20))
    assert truncate_context(toks, 5, 30) == toks
    assert truncate_context(toks, 5, 12) == [0, 1, 2, 3, 4] + list(range(13, 20))
    assert truncate_context(toks, 15, 12) == list(range(8, 20))     # prompt alone too long: last tokens


def test_split_at_char_handles_straddling_token():
    tok = ToyTokenizer()
    text = "<think> a </think> x <answer> y </answer>"
    ids = tok.encode(text)
    cut = text[: text.index("<answer>")]                          # ends with "x " ; " <" straddles
    k, rest = split_at_char(ids, cut, tok.decode)
    assert tok.decode(ids[:k]) + rest == cut
    assert rest == " " and tok.decode(ids[k:k + 1]) == " <"
    k2, rest2 = split_at_char(ids, text, tok.decode)
    assert k2 == len(ids) and rest2 == ""


@pytest.mark.parametrize("p, bug, expected", [(0.2, False, 0.2), (0.2, True, 20 / 101), (0.5, False, 0.5)])
def test_revision_draw_rate_within_binomial_bounds(p, bug, expected):
    rng = np.random.default_rng(0)
    n = 40_000
    hits = sum(revision_draw(rng, p, bug) for _ in range(n))
    sd = math.sqrt(n * expected * (1 - expected))
    assert abs(hits - n * expected) < 4.5 * sd, (hits, n * expected)
    if bug:  # 20/101 = 0.198 vs 0.2: distinguishable only in expectation, check the exact support
        assert all(revision_draw(np.random.default_rng(s), 0.0, True) is False for s in range(50))


def test_revision_draw_bug_flag_is_exactly_20_of_101():
    class Counter:  # enumerate every outcome of integers(0, 101)
        def __init__(self):
            self.v = -1

        def integers(self, lo, hi):
            assert (lo, hi) == (0, 101)
            self.v += 1
            return self.v
    c = Counter()
    assert sum(revision_draw(c, 0.2, True) for _ in range(101)) == 20


def test_config_validation_and_batch_size():
    with pytest.raises(ValueError, match="revision_prob"):
        RolloutConfig(revision_prob=1.5)
    with pytest.raises(ValueError, match="probe_slot"):
        RolloutConfig(probe_slot="elsewhere")
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(max_turns=-1)
    assert required_batch_size(10, RolloutConfig()) == 10
    assert required_batch_size(10, RolloutConfig(probe_slot="free")) == 20
    assert required_batch_size(10, RolloutConfig(probe_slot="free", max_probe_fraction=0.25)) == 12
    assert required_batch_size(10, RolloutConfig(probe_slot="free", probes=False)) == 10


def _records():
    ex = [QAExample("a", "q a", ["x"], "nq"), QAExample("b", "q b", ["y", "z"], "hotpotqa")]
    return [
        dict(tokens=[5, 6, 7], segments=[T.SEG_PROMPT, T.SEG_RESPONSE, T.SEG_INFO], logprobs=[0, -0.5, 0],
             group_id=0, is_probe=False, probe_start=-1, probe_len=0, num_searches=1, example=ex[0],
             response_text="r0"),
        dict(tokens=[5, 8, 9, 10, 11], segments=[T.SEG_PROMPT, T.SEG_RESPONSE, T.SEG_PROBE, T.SEG_PROBE,
                                                 T.SEG_INVALID],
             logprobs=[0, -0.25, 0, 0, 0], group_id=1, is_probe=True, probe_start=2, probe_len=2,
             num_searches=0, example=ex[1], response_text="r1"),
    ]


def test_from_records_layout_and_masks():
    b = T.TrajectoryBatch.from_records(_records(), pad_id=99)
    assert b.tokens.tolist() == [[5, 6, 7, 99, 99], [5, 8, 9, 10, 11]]
    assert b.segments[0].tolist() == [0, 1, 3, 5, 5]
    assert b.loss_mask.tolist() == [[False, True, False, False, False], [False, True, True, True, False]]
    assert b.attention_mask.sum(1).tolist() == [3, 5] and b.lengths.tolist() == [3, 5]
    assert b.sample_logprobs[1].tolist() == [0, -0.25, 0, 0, 0]
    assert (b.tokens.dtype, b.segments.dtype, b.sample_logprobs.dtype) == (np.int32, np.int8, np.float32)
    assert np.isnan(b.rewards).all()
    with pytest.raises(ValueError, match="record 0"):
        bad = _records()
        bad[0]["segments"] = bad[0]["segments"][:2]
        T.TrajectoryBatch.from_records(bad, pad_id=0)


def test_select_concat_and_jsonl_rows():
    b = T.TrajectoryBatch.from_records(_records(), pad_id=99)
    s = b.select([1])
    assert s.size == 1 and s.tokens.tolist() == [[5, 8, 9, 10, 11]] and s.examples[0].id == "b"
    assert b.select(np.array([False, True])).group_ids.tolist() == [1]
    short = T.TrajectoryBatch.from_records(_records()[:1], pad_id=99)
    c = T.concat([short, b])
    assert c.tokens.shape == (3, 5) and c.tokens[0].tolist() == [5, 6, 7, 99, 99]
    assert c.segments[0, 3:].tolist() == [T.SEG_PAD] * 2 and not c.attention_mask[0, 3:].any()
    assert c.response_text == ["r0", "r0", "r1"]
    b.rewards[1] = 1.0
    rows = b.to_jsonl_rows()
    assert "reward" not in rows[0] and rows[1]["reward"] == 1.0
    assert rows[1] == {"question": "q b", "golden_answers": ["y", "z"], "data_source": "hotpotqa", "id": "b",
                       "response": "r1", "is_probe": True, "group_id": 1, "num_searches": 0, "probe_start": 2,
                       "probe_len": 2, "reward": 1.0}
    with pytest.raises(ValueError, match="pad ids"):
        T.concat([b, T.TrajectoryBatch.from_records(_records(), pad_id=0)])


def test_rollout_config_is_gin_configurable():
    import gin
    # scoped bindings leave every other test's (unscoped) configuration untouched
    with gin.unlock_config():
        gin.parse_config(["rollout_test/RolloutConfig.max_turns = 2",
                          "rollout_test/RolloutConfig.revision_prob = 0.5"])
    with gin.config_scope("rollout_test"):
        cfg = RolloutConfig()
    assert (cfg.max_turns, cfg.revision_prob, cfg.topk, cfg.max_context) == (2, 0.5, 3, 4096)
    assert RolloutConfig().max_turns == 5
