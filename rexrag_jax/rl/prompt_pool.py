"""Revision-prompt pool (SPEC §3) and its exact next-token distribution (SPEC §5).

A probe trajectory is an original whose wrong `<answer>` was removed and replaced by one revision
prompt drawn uniformly from the pool. For the policy correction the inserted tokens need a behaviour
probability: the pool seen as a uniform distribution over its *token sequences*,

    P(x_1 .. x_L) = #{pool entries equal to x_1 .. x_L} / |pool|,

factorised into next-token frequencies

    P(x_i | x_<i) = n(x_1 .. x_i) / n(x_1 .. x_{i-1}),   n(s) = #{pool entries with prefix s},

with n(empty prefix) = |pool|, so the first token's probability comes from the pool too. This is
computed exactly with a trie of prefix counts (duplicated entries count twice, as a uniform draw
over the list would).

Never raises (the reference raises KeyError here): an inserted token that is not a child of the
current trie node (a tokenizer merge at the splice boundary, truncation, a pool mismatch), and every
token after it, gets the documented floor probability `floor_prob`:
    floor_prob = 1 / vocab_size   when vocab_size is given ("the pool says nothing, so uniform"),
    floor_prob = DEFAULT_FLOOR_PROB (1e-6) otherwise, or any explicit value in (0, 1].
The floor is a fixed value rather than additive smoothing so that tokens the pool does predict keep
their exact frequencies.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import gin
import numpy as np

DEFAULT_FLOOR_PROB = 1e-6
THINK_OPEN = "<think> "

DEFAULT_REVISION_PROMPTS: tuple[str, ...] = (
    "<think> Wait, I may have misread what the question is actually asking.",
    "<think> Hmm, my previous answer might be wrong, so let me re-examine the evidence.",
    "<think> Perhaps I relied too heavily on a single retrieved passage without checking it.",
    "<think> I should double-check whether the documents really support that answer.",
    "<think> Maybe my search query was too vague to find the right information.",
    "<think> Let me reconsider, since I might have confused two similar entities.",
    "<think> On second thought, my reasoning may have skipped an important step.",
    "<think> I am not fully confident in that answer, so I should verify it with another search.",
    "<think> It is possible that the retrieved information was outdated or incomplete.",
    "<think> Perhaps I jumped to a conclusion before gathering enough evidence.",
    "<think> I might have answered a different question than the one that was asked.",
    "<think> Let me step back and check each part of my reasoning again.",
    "<think> My answer may be inaccurate because I did not confirm the key fact.",
    "<think> Maybe the question has multiple parts and I only addressed one of them.",
    "<think> I could have mixed up names, dates, or places in my reasoning.",
    "<think> Perhaps a more specific search would reveal the information I am missing.",
    "<think> Something in my earlier reasoning does not quite add up, so let me revisit it.",
    "<think> I may have trusted my memory when I should have searched for the facts.",
    "<think> Let me question my assumptions, because one of them might be false.",
    "<think> Perhaps the answer requires connecting information from more than one source.",
    "<think> I should verify that my answer matches the exact entity the question refers to.",
    "<think> Maybe I overlooked a detail in the documents that changes the answer.",
    "<think> It seems my conclusion was hasty, so I will look at the problem from another angle.",
    "<think> I might have misinterpreted the relationship described in the question.",
    "<think> Let me make sure the answer is actually supported and not just a plausible guess.",
    "<think> Perhaps I should break the question into smaller pieces and search for each one.",
    "<think> My previous search results may not have been relevant to the real question.",
    "<think> I wonder whether I missed another reasonable interpretation of the question.",
    "<think> There may be a flaw in how I combined the facts I found.",
    "<think> Before finalizing, I should reconsider whether my answer is really correct.",
)


@gin.configurable
def revision_prompts(prompts: Sequence[str] = DEFAULT_REVISION_PROMPTS) -> list[str]:
    """The revision prompt pool (gin: `revision_prompts.prompts = [...]`), validated.

    Each prompt must start with "<think> " and must not close the think tag, so the policy continues
    the thought. Raises ValueError naming the offending entry.
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("revision_prompts.prompts: expected a non-empty list of prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.startswith(THINK_OPEN):
            raise ValueError(f"revision_prompts.prompts[{i}]={p!r}: expected a string starting with {THINK_OPEN!r}")
        if "</think>" in p:
            raise ValueError(f"revision_prompts.prompts[{i}]={p!r}: must not close the think tag")
    return prompts


class PromptPoolDistribution:
    """The pool as a uniform distribution over token sequences; exact next-token log-probs via a trie.

    Args:
      pool_token_lists: the tokenized pool entries (non-empty lists of ints).
      vocab_size: if given (and floor_prob is None), floor_prob = 1 / vocab_size.
      floor_prob: probability given to any token the pool cannot predict (see module docstring).
    """

    def __init__(self, pool_token_lists: Iterable[Sequence[int]], vocab_size: int | None = None,
                 floor_prob: float | None = None):
        if floor_prob is None:
            floor_prob = 1.0 / vocab_size if vocab_size else DEFAULT_FLOOR_PROB
        if not 0.0 < floor_prob <= 1.0:
            raise ValueError(f"PromptPoolDistribution.floor_prob={floor_prob}: expected a value in (0, 1]")
        self.floor_prob = float(floor_prob)
        self.floor_logprob = math.log(self.floor_prob)
        # Trie node = dict token -> [count, child node]; the root count is the pool size.
        self._root: dict = {}
        self.size = 0
        for i, seq in enumerate(pool_token_lists):
            seq = [int(t) for t in seq]
            if not seq:
                raise ValueError(f"PromptPoolDistribution.pool_token_lists[{i}]: expected a non-empty token list")
            node = self._root
            for tok in seq:
                entry = node.setdefault(tok, [0, {}])
                entry[0] += 1
                node = entry[1]
            self.size += 1
        if self.size == 0:
            raise ValueError("PromptPoolDistribution.pool_token_lists: expected at least one pool entry")

    @classmethod
    def from_texts(cls, texts: Sequence[str], encode: Callable[[str], list[int]], **kwargs):
        """Tokenizes each prompt with `encode` (e.g. Tokenizer.encode) exactly as it is inserted."""
        return cls([encode(t) for t in texts], **kwargs)

    def _walk(self, inserted_tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        out = np.full(len(inserted_tokens), self.floor_logprob, dtype=np.float64)
        node, parent_count = self._root, self.size
        matched = 0
        for i, tok in enumerate(inserted_tokens):
            entry = node.get(int(tok))
            if entry is None:  # left the trie: this and all later tokens get the floor
                break
            out[i] = math.log(entry[0] / parent_count)
            node, parent_count = entry[1], entry[0]
            matched += 1
        return out, matched

    def logprobs(self, inserted_tokens: Sequence[int]) -> np.ndarray:
        """log P(x_i | x_<i) for each inserted token (float32 [len]); floor for unpredictable tokens."""
        return self._walk(inserted_tokens)[0].astype(np.float32)

    def matched_len(self, inserted_tokens: Sequence[int]) -> int:
        """How many leading inserted tokens the pool predicts (the rest got the floor); for logging."""
        return self._walk(inserted_tokens)[1]

    def logprob_matrix(self, tokens: np.ndarray, is_probe: np.ndarray, probe_start: np.ndarray,
                       probe_len: np.ndarray) -> np.ndarray:
        """pool_logp [N, T] for behaviour_logprobs: log pool probability at inserted tokens, 0 elsewhere.

        Row n's inserted tokens are tokens[n, probe_start[n] : probe_start[n] + probe_len[n]] (clipped to T).
        """
        tokens = np.asarray(tokens)
        n_rows, t_len = tokens.shape
        out = np.zeros((n_rows, t_len), dtype=np.float32)
        for n in np.flatnonzero(np.asarray(is_probe)):
            start = int(probe_start[n])
            if start < 0:
                raise ValueError(f"logprob_matrix: row {n} is a probe but probe_start={start}; expected >= 0")
            end = min(start + int(probe_len[n]), t_len)
            out[n, start:end] = self.logprobs(tokens[n, start:end])
        return out
