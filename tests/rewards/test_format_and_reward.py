"""Format rating levels and the training reward, on hand-made strings (values computed by hand)."""
import pytest

from rexrag_jax.rewards import F_MAX, compute_reward, format_components, format_rating

FULL = ("<think>a</think><search>q</search><information>d</information>"
        "<think>b</think><answer>c</answer>")


def _approx(d):
    return {k: pytest.approx(v) for k, v in d.items()}


def test_full_trajectory_scores_the_maximum():
    assert format_components(FULL) == _approx({"diversity": 0.4, "closure": 0.3, "tidiness": 0.3, "order": 0.21})
    assert format_rating(FULL) == pytest.approx(1.21) == pytest.approx(F_MAX)


def test_think_answer_and_answer_only():
    assert format_rating("<think> a </think>\n<answer> b </answer>\n") == pytest.approx(0.2 + 0.3 + 0.3 + 0.21)
    # answer without think: order grammar not met, but the answer is last -> 0.1
    assert format_components("<answer> b </answer>") == _approx(
        {"diversity": 0.1, "closure": 0.3, "tidiness": 0.3, "order": 0.1})


def test_no_tags_and_empty():
    assert format_rating("plain text") == 0.0
    assert format_rating("") == 0.0
    assert format_rating("   \n") == 0.0


def test_untidy_text_outside_blocks():
    # "<think>ab</think>" has 17 non-space chars inside a block; "xyz" is 3 stray chars -> T = 0.3*17/20.
    c = format_components("xyz <think>ab</think><answer>c</answer>")
    inside = len("<think>ab</think>") + len("<answer>c</answer>")
    assert c["tidiness"] == pytest.approx(0.3 * inside / (inside + 3))
    assert c["order"] == pytest.approx(0.21)  # stray text does not break the block order


def test_unclosed_tag():
    # tags: <think> </think> <answer>  -> 1 block, 3 occurrences, 1 broken
    text = "<think>a</think><answer> b"
    c = format_components(text)
    assert c["diversity"] == pytest.approx(0.1)
    assert c["closure"] == pytest.approx(0.3 * 2 / 3)
    inside = len("<think>a</think>")
    assert c["tidiness"] == pytest.approx(0.3 * inside / (inside + len("<answer>b")))
    assert c["order"] == 0.0


def test_nested_tags_are_broken():
    # <think> <search> q </search> </think>: the search pair is a block, both think tags are broken.
    text = "<think> x <search> q </search> </think><answer> y </answer>"
    c = format_components(text)
    assert c["diversity"] == pytest.approx(0.2)            # search + answer
    assert c["closure"] == pytest.approx(0.3 * 4 / 6)
    stray = len("<think>x") + len("</think>")
    total = len(text.replace(" ", ""))
    assert c["tidiness"] == pytest.approx(0.3 * (total - stray) / total)
    assert c["order"] == pytest.approx(0.1)                # answer last, but something is broken


def test_interleaved_and_stray_closers():
    text = "<think> a <answer> b </think> c </answer>"
    c = format_components(text)
    assert c["diversity"] == 0.0 and c["closure"] == 0.0 and c["order"] == 0.0 and c["tidiness"] == 0.0
    assert format_rating("</think></search>") == 0.0


def test_wrong_order_and_trailing_text():
    # search before think: blocks S I T A do not match (TSI)*TA; answer is last -> 0.1
    assert format_components("<search>q</search><information>d</information><think>t</think><answer>a</answer>")[
        "order"] == pytest.approx(0.1)
    # text after the answer: not last -> order 0
    assert format_components("<think>t</think><answer>a</answer> more")["order"] == 0.0
    # two answers: grammar fails, last block is an answer -> 0.1
    assert format_components("<think>t</think><answer>a</answer><answer>b</answer>")["order"] == pytest.approx(0.1)
    # search without information: grammar fails; last block is not an answer -> 0
    assert format_components("<think>t</think><search>q</search>")["order"] == 0.0


def test_rating_is_bounded():
    for text in [FULL, FULL * 3, "<think>" * 5, "x" + FULL, "<answer>a</answer>" * 4]:
        assert 0.0 <= format_rating(text) <= F_MAX + 1e-9


def test_compute_reward():
    golds = ["Paris", "City of Light"]
    hit = "<think> t </think><answer> paris </answer>"
    miss = "<think> t </think><answer> Lyon </answer>"
    assert compute_reward(hit, golds) == 1.0
    assert compute_reward(miss, golds) == 0.0
    assert compute_reward("<think> no answer </think>", golds) == 0.0
    # the last answer counts
    assert compute_reward("<answer> Lyon </answer><answer> Paris </answer>", golds) == 1.0
    s = 0.2
    f = format_rating(hit)
    assert f == pytest.approx(1.01)
    assert compute_reward(hit, golds, structure_format_score=s) == pytest.approx(1 + s * f)
    assert compute_reward(miss, golds, structure_format_score=s) == pytest.approx(s * format_rating(miss))
