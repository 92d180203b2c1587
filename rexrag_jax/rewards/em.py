"""Answer normalisation, exact match and answer extraction (SPEC §2, Search-R1 / SQuAD convention)."""
from __future__ import annotations

import re
import string
from typing import Iterable

_PUNCT = frozenset(string.punctuation)  # ASCII punctuation only, as in SQuAD / Search-R1
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # Search-R1 qa_em.extract_solution


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
    """Content of the last match of Search-R1's `<answer>(.*?)</answer>` (DOTALL) in `text`, stripped;
    None if there is none. Exactly the reference's `re.finditer(...)` + last match, so:
      `<answer> a </answer> <answer> b </answer>` -> "b"      (duplicated blocks: the last)
      `<answer> a <answer> b </answer>`          -> "a <answer> b" (nested opening: the regex starts at
                                                    the first `<answer>`; EM then normalises it to "a answer b")
      `<answer> a </answer> </answer>`           -> "a"      (a stray extra closer is ignored)
      `<answer> a </answer> <answer> c`          -> "a"      (an unclosed trailing block is ignored)
    Tags are case-sensitive. Pass the response only: the reference's qa_em.extract_solution runs on
    prompt + response and so returns None unless there are >= 2 matches (the SPEC prompt's example
    `<answer> Beijing </answer>` is always the first); on the response alone that is ">= 1 match".
    """
    last = None
    for last in _ANSWER_RE.finditer(text):
        pass
    return None if last is None else last.group(1).strip()
