"""Stop strings: host-side exact cut on detokenized text, and token sequences for in-jit early stop.

Stop strings are text, and a tokenizer can spell "</search>" many ways (" </", "search", ">" or
"</", "search", ">\n" ...). The engine therefore (1) stops early on device when the generated tokens
end with one of a few precomputed token sequences whose text is known to contain a stop string, and
(2) always confirms on the host by detokenizing and cutting at the first token that completes one.

Action blocks (`blocks=True`, the engine's default): a stop string that is a closing tag `</X>` counts
only where it closes a complete `<X>…</X>` block, so the turn ends at the first complete action block,
the first match of Search-R1's `<(search|answer)>(.*?)</\1>` (DOTALL). A stray closer (a `</answer>`
inside `<think>` with no `<answer>` before it) does not end the turn; generation goes on to the first
complete block, EOS or the token budget. See rollout.loop.parse_action for how this compares with
Search-R1's own cut.
"""
from __future__ import annotations

from typing import Callable, Sequence


def _is_closing_tag(s: str) -> bool:
    return len(s) > 3 and s.startswith("</") and s.endswith(">") and "<" not in s[2:]


def _first_stop_end(text: str, stop_strings: Sequence[str], blocks: bool = False) -> int:
    """Character index right after the earliest-ending complete stop string in text, or -1.
    blocks: a closing tag `</X>` counts only after an opening `<X>` (it then ends the first `<X>…</X>`)."""
    ends = []
    for s in stop_strings:
        if not s:
            continue
        start = 0
        if blocks and _is_closing_tag(s):
            opener = "<" + s[2:]
            o = text.find(opener)
            if o < 0:
                continue
            start = o + len(opener)
        i = text.find(s, start)
        if i >= 0:
            ends.append(i + len(s))
    return min(ends) if ends else -1


def find_stop_cut(tokens: Sequence[int], detokenize: Callable[[list[int]], str],
                  stop_strings: Sequence[str], blocks: bool = False) -> tuple[int, str] | None:
    """Cut generated tokens right after the first complete stop string (with blocks: the first stop
    string that closes a complete `<X>…</X>` block, see the module docstring).

    Returns (n, text): n = the smallest count such that detokenize(tokens[:n]) contains a stop string
    (so tokens[n-1] is the token that completes it) and text = detokenize(tokens[:n]) cut right after
    the earliest-ending stop string in it (text drops any characters of tokens[n-1] beyond the stop
    string; the tokens keep them). None when no stop string occurs.

    Binary search over prefixes (detokenizing a longer prefix never removes a stop string already
    present), so cost is O(log n) detokenize calls.
    """
    tokens = list(tokens)
    if not stop_strings or _first_stop_end(detokenize(tokens), stop_strings, blocks) < 0:
        return None
    lo, hi = 1, len(tokens)  # invariant: prefix hi contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_stop_end(detokenize(tokens[:mid]), stop_strings, blocks) >= 0:
            hi = mid
        else:
            lo = mid + 1
    text = detokenize(tokens[:hi])
    return hi, text[:_first_stop_end(text, stop_strings, blocks)]


def stop_token_sequences(encode: Callable[[str], list[int]], detokenize: Callable[[list[int]], str],
                         stop_strings: Sequence[str],
                         contexts: Sequence[str] = ("", " ", "\n", "x", ". ", "\n\n")) -> tuple[tuple[int, ...], ...]:
    """Token sequences that, when the generated tokens end with them, certainly complete a stop string.

    For every context c and stop string s, encode(c + s) and keep the shortest token suffix whose
    detokenization contains s. Any such suffix is a sound in-jit stop trigger (its text contains s);
    spellings not listed here are still caught by the host-side check after each decode chunk.
    """
    seqs: list[tuple[int, ...]] = []
    for s in stop_strings:
        for c in contexts:
            ids = list(encode(c + s))
            for start in range(len(ids) - 1, -1, -1):
                if s in detokenize(ids[start:]):
                    seq = tuple(int(t) for t in ids[start:])
                    if seq not in seqs:
                        seqs.append(seq)
                    break
    return tuple(seqs)
