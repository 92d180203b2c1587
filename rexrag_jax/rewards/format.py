"""Format rating F of a search-agent response (the optional structure bonus of SPEC §2).

The response is scanned for the tags <think>, <search>, <information>, <answer> (and their closers).
A *block* is an opening tag whose very next tag is its own closer (`<t> ... </t>` with no tag inside).
Every other tag occurrence is *broken* (unclosed, stray closer, nested or interleaved).

    F = D + C + T + O                                   F in [0, 1.21]

    D  diversity  0.1 per tag kind with at least one block                       0 .. 0.4
    C  closure    0.3 * (2 * #blocks) / #tag occurrences (0 when no tags)       0 .. 0.3
    T  tidiness   0.3 * (1 - stray / total), over non-whitespace characters;
                  stray = characters outside every block (broken tags included)  0 .. 0.3
    O  order      0.21 if nothing is broken, the block sequence is
                  (think search information)* think answer, and only whitespace
                  follows the answer;
                  0.1  if the last block is an answer followed only by whitespace
                       (but the full order is not met);
                  0    otherwise                                                  0, 0.1, 0.21

Levels (hand-checked in tests/rewards/test_format.py):
    "<think> a </think><answer> b </answer>"                              -> 0.2 + 0.3 + 0.3 + 0.21 = 1.01
    "<think>a</think><search>q</search><information>d</information><think>b</think><answer>c</answer>"
                                                                            -> 0.4 + 0.3 + 0.3 + 0.21 = 1.21
    "<answer> b </answer>"                                                 -> 0.1 + 0.3 + 0.3 + 0.1  = 0.8
    "plain text"                                                           -> 0
"""
from __future__ import annotations

import re

TAGS = ("think", "search", "information", "answer")
_TAG_RE = re.compile(r"<(/?)(think|search|information|answer)>")
_ORDER_RE = re.compile(r"(TSI)*TA")
_LETTER = {"think": "T", "search": "S", "information": "I", "answer": "A"}

W_DIVERSITY = 0.1
W_CLOSURE = 0.3
W_TIDY = 0.3
W_ORDER_FULL = 0.21
W_ORDER_ANSWER_LAST = 0.1
F_MAX = len(TAGS) * W_DIVERSITY + W_CLOSURE + W_TIDY + W_ORDER_FULL


def _nonspace(s: str) -> int:
    return sum(1 for ch in s if not ch.isspace())


def _blocks(text: str):
    """(list of (name, start, end) blocks, number of tag occurrences, number of broken tags)."""
    tags = [(m.group(2), m.group(1) == "/", m.start(), m.end()) for m in _TAG_RE.finditer(text)]
    blocks, i = [], 0
    while i < len(tags):
        name, closing, start, _ = tags[i]
        if not closing and i + 1 < len(tags) and tags[i + 1][0] == name and tags[i + 1][1]:
            blocks.append((name, start, tags[i + 1][3]))
            i += 2
        else:
            i += 1
    return blocks, len(tags), len(tags) - 2 * len(blocks)


def format_components(text: str) -> dict[str, float]:
    """The four terms D, C, T, O of `format_rating` (see the module docstring)."""
    blocks, n_tags, n_broken = _blocks(text)
    diversity = W_DIVERSITY * len({name for name, _, _ in blocks})
    closure = W_CLOSURE * (2 * len(blocks) / n_tags) if n_tags else 0.0
    total = _nonspace(text)
    inside = sum(_nonspace(text[s:e]) for _, s, e in blocks)
    tidy = W_TIDY * (inside / total) if total else 0.0
    letters = "".join(_LETTER[name] for name, _, _ in blocks)
    order = 0.0
    if blocks and blocks[-1][0] == "answer" and not text[blocks[-1][2]:].strip():
        full = n_broken == 0 and _ORDER_RE.fullmatch(letters)
        order = W_ORDER_FULL if full else W_ORDER_ANSWER_LAST
    return {"diversity": diversity, "closure": closure, "tidiness": tidy, "order": order}


def format_rating(text: str) -> float:
    """F = D + C + T + O in [0, F_MAX = 1.21]; see the module docstring for each term's levels."""
    return float(sum(format_components(text).values()))
