"""normalize / EM / answer extraction against hand-made strings and an independent SQuAD-style reference."""
import random
import re
import string

import pytest

from rexrag_jax.rewards import exact_match, extract_last_answer, normalize_answer


def _squad_reference(s):
    # Written independently of the module (str.translate, regex on the translated string).
    s = s.lower().translate(str.maketrans("", "", string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


@pytest.mark.parametrize("raw,expected", [
    ("The  Eiffel-Tower!", "eiffeltower"),
    ("  A cat, an apple and THE dog. ", "cat apple and dog"),
    ("theatre anthem", "theatre anthem"),       # a/an/the only as whole words
    ("U.S.A.", "usa"),
    ("Beyoncé’s", "beyoncé’s"),                # non-ASCII punctuation is kept
    ("1,000", "1000"),
    ("", ""),
    ("the", ""),
    ("a\tb\nc", "b c"),
])
def test_normalize_hand_values(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_matches_reference_on_random_strings():
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.punctuation + "  \t\n" + "éü’"
    words = ["a", "an", "the", "The", "A", "AN", "x"]
    for _ in range(500):
        parts = [rng.choice(words) if rng.random() < 0.3 else
                 "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 8))]
        s = rng.choice([" ", "", "-", "."]).join(parts)
        assert normalize_answer(s) == _squad_reference(s), repr(s)


def test_exact_match():
    assert exact_match("the Beatles", ["Beatles", "Fab Four"]) == 1.0
    assert exact_match("Fab four.", ["Beatles", "Fab Four"]) == 1.0
    assert exact_match("Beatle", ["Beatles"]) == 0.0
    assert exact_match("Paris", "paris") == 1.0           # a single gold string
    assert exact_match(None, ["x"]) == 0.0
    assert exact_match("", ["the"]) == 1.0                 # both normalise to ""
    assert exact_match("x", []) == 0.0
    with pytest.raises(TypeError):
        exact_match("x", [1])


@pytest.mark.parametrize("text,expected", [
    ("<think> hm </think>\n<answer> Paris </answer>", "Paris"),
    ("<answer>a</answer> then <answer> b </answer>", "b"),
    ("<answer> a <answer> b </answer>", "a <answer> b"),   # nested opening: as Search-R1's regex (first opener)
    ("<answer> a </answer> </answer>", "a"),               # stray extra closer ignored (regex stops at the first)
    ("<answer> a </answer> b </answer>", "a"),
    ("<think> x </answer> </think><answer> y </answer>", "y"),  # stray closer inside <think>
    ("<answer> a </answer><answer> b </answer><answer> c </answer>", "c"),  # duplicated: the last
    ("<answer> a </answer> <answer> unclosed", "a"),       # unclosed trailing block ignored
    ("no tags at all", None),
    ("stray </answer> closer", None),
    ("<answer>unclosed", None),
    ("<answer>\n multi\nline \n</answer>", "multi\nline"),
    ("<answer></answer>", ""),
    ("<ANSWER> x </ANSWER>", None),                        # tags are case-sensitive, as in Search-R1
])
def test_extract_last_answer(text, expected):
    assert extract_last_answer(text) == expected


def test_extract_agrees_with_search_r1_regex_on_any_tag_soup():
    rng = random.Random(1)
    for _ in range(500):
        chunks = []
        for _ in range(rng.randint(0, 6)):
            chunks.append(rng.choice(["<think> t </think>", "text ", "<answer> %d </answer>" % rng.randint(0, 9),
                                      "<answer>", "</answer>", " <answer> %d" % rng.randint(0, 9)]))
        text = "".join(chunks)
        matches = list(re.finditer(r"<answer>(.*?)</answer>", text, re.DOTALL))
        ref = matches[-1].group(1).strip() if matches else None
        assert extract_last_answer(text) == ref
