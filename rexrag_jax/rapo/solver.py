"""The synthetic world's solver with noise: a stand-in "stronger agent" for building a static trace buffer
in the miniature (`rexrag build-trace-buffer --policy solver --noise 0.3`), in seconds, without a model.

It solves a synthetic-world question ("What is the birthplace of the founder of Zelko?", data/
synthetic_world.py) through the retriever it is given, as an agent would: one search per hop
(`Zelko founder`), the next entity read from the observation ("The founder of Zelko is Marvo."), and
the answer after the last hop. Its text is the warm start's format (data/warmstart.py):

    <think> I need the founder of Zelko. </think><search> Zelko founder </search>
    \\n\\n<information>Doc 1(Title: "Zelko") ...</information>\\n\\n
    <think> The founder of Zelko is Marvo. I need the birthplace of Marvo. </think><search> Marvo birthplace </search>
    ...
    <think> The birthplace of Marvo is Tavik. </think><answer> Tavik </answer>

Noise: before each hop's search, with probability `noise` (own RNG per (seed, question index, sample)),
the solver stops and answers: with the entity found so far (a dead end, as the warm start's traps), or,
before the first search, with the question's head entity. So a k-hop question is solved with
probability (1 - noise)^k, and the N samples of a question differ. When the fact is not in the
observation (the retriever missed the passage) it answers with what it has, which is then wrong.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from rexrag_jax.rapo.static_buffer import Candidate, TraceBufferError
from rexrag_jax.rapo.trace_buffer import history_key

_HEAD = re.compile(r"^(?:Who|What) is ((?:the [a-z]+ of )+)(.+?)\?$")
_REL = re.compile(r"the ([a-z]+) of ")


def parse_question(text: str) -> tuple[str, list[str]]:
    """(head entity name, relations in search order) of a synthetic-world question, else ValueError."""
    m = _HEAD.match(text.strip())
    if not m:
        raise ValueError(f"not a synthetic-world question: {text!r}")
    return m.group(2), _REL.findall(m.group(1))[::-1]


def _observation(hits) -> str:
    from rexrag_jax.retrieval.format import format_passages

    return f"\n\n<information>{format_passages(hits)}</information>\n\n"


def _fact(hits, subj: str, rel: str) -> str | None:
    pat = re.compile(rf"The {re.escape(rel)} of {re.escape(subj)} is ([^\s.]+)\.")
    for h in hits:
        m = pat.search((h["document"] if "document" in h else h)["contents"])
        if m:
            return m.group(1)
    return None


class NoisySolver:
    """Sampler for build_trace_buffer: (examples, n, seed, start_index) -> n Candidates per example."""

    def __init__(self, retriever, noise: float = 0.3, topk: int = 3, history_chars: int = 1000):
        if not 0.0 <= noise <= 1.0:
            raise TraceBufferError(f"--noise {noise}: expected a probability in [0, 1]")
        self.retriever, self.noise, self.topk, self.history_chars = retriever, float(noise), int(topk), history_chars
        self.info = {"kind": "solver", "noise": self.noise, "topk": self.topk}
        self._cache: dict[str, list] = {}

    def _search(self, queries: Sequence[str]) -> dict[str, list]:
        new = sorted({q for q in queries if q not in self._cache})
        if new:
            for q, hits in zip(new, self.retriever.search(new, self.topk)):
                self._cache[q] = hits
        return {q: self._cache[q] for q in queries}

    def __call__(self, examples, n: int, seed: int, start_index: int) -> list[list[Candidate]]:
        parsed = []
        for ex in examples:
            try:
                parsed.append(parse_question(ex.question))
            except ValueError as e:
                raise TraceBufferError(f"--policy solver: question {ex.id}: {e} (the solver needs the synthetic "
                                       "world's questions; use --checkpoint for other data)") from None
        # one state per (question, sample): segments so far, current entity, last fact, done
        states = []
        for qi, (ex, (head, rels)) in enumerate(zip(examples, parsed)):
            for j in range(n):
                states.append({"ex": ex, "rels": rels, "cur": head, "known": None, "segs": [], "hop": 0,
                               "done": False, "rng": np.random.default_rng([int(seed), start_index + qi, j])})
        while True:
            active = [s for s in states if not s["done"]]
            if not active:
                break
            searching = []
            for s in active:
                if s["hop"] == len(s["rels"]):
                    self._answer(s, s["known"][2] if s["known"] else s["cur"])
                elif s["rng"].random() < self.noise:  # an early answer: a dead end
                    self._answer(s, s["known"][2] if s["known"] else s["cur"])
                else:
                    searching.append(s)
            hits = self._search([f"{s['cur']} {s['rels'][s['hop']]}" for s in searching])
            for s in searching:
                rel, subj = s["rels"][s["hop"]], s["cur"]
                lead = f"The {s['known'][1]} of {s['known'][0]} is {s['known'][2]}. " if s["known"] else ""
                query = f"{subj} {rel}"
                s["segs"].append(("response", f"<think> {lead}I need the {rel} of {subj}. </think>"
                                              f"<search> {query} </search>"))
                s["segs"].append(("information", _observation(hits[query])))
                obj = _fact(hits[query], subj, rel)
                if obj is None:  # the retriever missed the passage: answer with what it has
                    self._answer(s, subj)
                    continue
                s["known"], s["cur"], s["hop"] = (subj, rel, obj), obj, s["hop"] + 1
        out = []
        for qi in range(len(examples)):
            out.append([self._candidate(s) for s in states[qi * n:(qi + 1) * n]])
        return out

    @staticmethod
    def _answer(s, answer: str) -> None:
        think = f"The {s['known'][1]} of {s['known'][0]} is {s['known'][2]}." if s["known"] else \
            f"I think the answer is {answer}."
        s["segs"].append(("response", f"<think> {think} </think><answer> {answer} </answer>"))
        s["done"] = True

    def _candidate(self, s) -> Candidate:
        """Steps: each response segment plus the observation right after it; key = history before it."""
        segs, steps, text = s["segs"], [], ""
        for i, (kind, t) in enumerate(segs):
            if kind == "response":
                obs = segs[i + 1][1] if i + 1 < len(segs) and segs[i + 1][0] == "information" else ""
                steps.append((history_key(s["ex"].question, text, self.history_chars), t + obs))
            text += t
        return Candidate(text, steps, sum(k == "information" for k, _ in segs))
