"""Answer normalisation, exact match and answer extraction (SPEC §2, Search-R1 / SQuAD convention)."""
from __future__ import annotations

import re
import string
from typing import Iterable

_PUNCT = frozenset(string.punctuation)  # ASCII punctuation only, as in SQuAD / Search-R1
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"


def normalize_answer(s: str) -> str:
    """normalize(s) = collapse_ws(drop_articles(drop_punct(lower(s)))).

    lower-case; delete every ASCII punctuation character; replace the whole words a/an/the by a
    space; split on whitespace and re-join with single spaces (which also strips the ends).
    Example: "The  Eiffel-Tower!" -> "eiffeltower".
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _as_gold_list(golds) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    if isinstance(golds, Iterable):
        out = list(golds)
        for g in out:
            if not isinstance(g, str):
                raise TypeError(f"gold answers must be strings, got {type(g).__name__}: {g!r}")
        return out
    raise TypeError(f"gold answers must be a string or a list of strings, got {type(golds).__name__}")


def exact_match(prediction: str | None, golds) -> float:
    """EM = 1.0 if normalize(prediction) == normalize(g) for some gold g, else 0.0 (None -> 0.0).

    `golds` is one string or a list of strings (any match counts).
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in _as_gold_list(golds)) else 0.0


def extract_last_answer(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>` in `text`, stripped; None if there is none.

    "Last" is anchored on the last `</answer>`: the answer starts after the nearest `<answer>` before
    it. So for a nested/duplicated opening `<answer> a <answer> b </answer>` the answer is "b", an
    unclosed trailing `<answer> c` is ignored, and a closing tag with no opening before it gives None.
    For well-formed text this equals the last match of Search-R1's `<answer>(.*?)</answer>`.
    Pass the response only: the SPEC prompt itself contains the example `<answer> Beijing </answer>`.
    """
    end = text.rfind(_ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(_ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(_ANSWER_OPEN):end].strip()
