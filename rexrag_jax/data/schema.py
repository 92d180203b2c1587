"""The QA example schema (Search-R1 form) and data_source names."""
from __future__ import annotations

import dataclasses
import os
import re

# The seven evaluation benchmarks of the paper, in table order.
BENCHMARK_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SHORT_NAMES = {"2wikimultihopqa": "2wiki"}  # table headers

# File-name patterns -> data_source, first match wins (checked on the lower-cased file name).
_NAME_PATTERNS = (
    (re.compile(r"synth_?(\d)hop"), None),  # synth_1hop / synth1hop -> "synth_1hop"
    (re.compile(r"2wiki"), "2wikimultihopqa"),
    (re.compile(r"hotpot"), "hotpotqa"),
    (re.compile(r"musique"), "musique"),
    (re.compile(r"bamboogle"), "bamboogle"),
    (re.compile(r"popqa"), "popqa"),
    (re.compile(r"trivia"), "triviaqa"),
    (re.compile(r"(^|[^a-z])(nq|natural_?questions)([^a-z]|$)"), "nq"),
)


@dataclasses.dataclass(frozen=True)
class QAExample:
    """One question: `golden_answers` is a non-empty list; `data_source` names the benchmark."""
    id: str
    question: str
    golden_answers: list[str]
    data_source: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_ALIASES = {"2wiki": "2wikimultihopqa", "2wikimqa": "2wikimultihopqa", "hotpot": "hotpotqa",
            "natural_questions": "nq", "naturalquestions": "nq", "nq_open": "nq", "trivia": "triviaqa",
            "trivia_qa": "triviaqa", "pop_qa": "popqa"}


def canonical_source(name: str) -> str:
    """Exact aliases ("2wiki", "NQ", "hotpot") -> canonical data_source; any other name passes unchanged."""
    key = name.strip().lower()
    if key in BENCHMARK_SOURCES:
        return key
    return _ALIASES.get(key, name)


def infer_data_source(path: str | os.PathLike) -> str | None:
    """data_source from a file name (e.g. `2wiki_dev_500.jsonl` -> `2wikimultihopqa`), None if unknown."""
    name = os.path.basename(os.fspath(path)).lower()
    for pattern, source in _NAME_PATTERNS:
        m = pattern.search(name)
        if m:
            return source if source is not None else f"synth_{m.group(1)}hop"
    return None
