"""Read QA files (jsonl / json / csv / parquet) into `QAExample`s, mapping the common field variants.

Field mapping, first present wins:
  id             id, idx, qid, _id, question_id, extra_info.index   (absent -> "{file stem}-{row}")
  question       question, query, problem, or the text after the last "Question:" in a Search-R1
                 `prompt` (list of chat messages)
  golden_answers golden_answers, answers, answer, target, reward_model.ground_truth.target,
                 ground_truth (a string or a list of strings; numbers are turned into strings;
                 in csv a JSON list `["a", "b"]` is decoded)
  data_source    the `data_source` argument, else the row's `data_source`, else inferred from the
                 file name (nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle, synth_Nhop)
A row that cannot be mapped raises `QADataError("{file}:{line}: ...")` or, with skip_bad_rows=True,
is skipped and counted in the returned `ReadStats`.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import os
from typing import Any, Iterator

from rexrag_jax.data.schema import QAExample, canonical_source, infer_data_source
from rexrag_jax.io import paths as iopaths  # local paths and gs:// URLs alike

log = logging.getLogger(__name__)

ID_FIELDS = ("id", "idx", "qid", "_id", "question_id", "extra_info.index")
QUESTION_FIELDS = ("question", "query", "problem")
ANSWER_FIELDS = ("golden_answers", "answers", "answer", "target", "reward_model.ground_truth.target",
                 "ground_truth")
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class QADataError(ValueError):
    """A row or file that cannot be mapped onto the QA schema; the message names file and line."""


@dataclasses.dataclass
class ReadStats:
    rows: int = 0
    skipped: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)  # first few messages of skipped rows


def _get(row: dict, dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _first(row: dict, fields) -> tuple[str | None, Any]:
    for f in fields:
        v = _get(row, f)
        if v is not None:
            return f, v
    return None, None


def _question_from_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, list):  # Search-R1 parquet: [{"role": "user", "content": ...}]
        prompt = " ".join(m.get("content", "") for m in prompt if isinstance(m, dict))
    if isinstance(prompt, str) and "Question:" in prompt:
        return prompt.rsplit("Question:", 1)[1].strip()
    return None


def _answers(value: Any, from_csv: bool) -> list[str]:
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if from_csv and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"answer column looks like a JSON list but does not parse: {e}") from None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"answers must be a string or a list of strings, got {type(value).__name__}")
    out = []
    for a in value:
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise ValueError(f"answer items must be strings, got {type(a).__name__}: {a!r}")
        a = str(a).strip()
        if a:
            out.append(a)
    if not out:
        raise ValueError("no non-empty gold answer")
    return out


def row_to_example(row: Any, *, default_id: str, data_source: str | None, from_csv: bool = False) -> QAExample:
    """Map one decoded row onto QAExample; raises ValueError naming the missing/bad field."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    _, question = _first(row, QUESTION_FIELDS)
    if question is None:
        question = _question_from_prompt(row.get("prompt"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"no question: expected a non-empty string in one of {QUESTION_FIELDS} or a "
                         f"Search-R1 'prompt' with 'Question:'; fields present: {sorted(row)}")
    field, answers = _first(row, ANSWER_FIELDS)
    if field is None:
        raise ValueError(f"no gold answers: expected one of {ANSWER_FIELDS}; fields present: {sorted(row)}")
    try:
        golds = _answers(answers, from_csv)
    except ValueError as e:
        raise ValueError(f"field {field!r}: {e}") from None
    _, ident = _first(row, ID_FIELDS)
    ident = default_id if ident is None or ident == "" else str(ident)
    source = data_source or row.get("data_source")
    if not isinstance(source, str) or not source:
        raise ValueError("no data_source: not given, not in the row, and not inferable from the file name")
    return QAExample(id=ident, question=question.strip(), golden_answers=golds, data_source=canonical_source(source))


def _rows(path: str) -> Iterator[tuple[str, Any, bool]]:
    """(location "file:line", decoded row or an Exception, from_csv) for every row of the file."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        with iopaths.open_file(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line), False
                except json.JSONDecodeError as e:
                    yield f"{path}:{lineno}", ValueError(f"invalid JSON: {e}"), False
    elif suffix == ".json":
        with iopaths.open_file(path, "r", encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise QADataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise QADataError(f"{path}: expected a JSON list of rows (or {{'data': [...]}}), "
                              f"got {type(data).__name__}")
        for i, row in enumerate(data):
            yield f"{path}:row {i}", row, False
    elif suffix == ".csv":
        with iopaths.open_file(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                row = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
                yield f"{path}:{reader.line_num}", row, True
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise QADataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow); "
                              f"or convert the file to jsonl") from None
        with iopaths.open_file(path, "rb") as f:
            table = pq.read_table(f)
        for i, row in enumerate(table.to_pylist()):
            yield f"{path}:row {i}", row, False
    else:
        raise QADataError(f"{path}: unsupported file type {suffix!r}; expected one of {SUFFIXES}")


def read_qa_file_with_stats(path, data_source: str | None = None, *, skip_bad_rows: bool = False,
                            max_errors_kept: int = 20) -> tuple[list[QAExample], ReadStats]:
    """All examples of one file and the row / skipped counts (see the module docstring for the mapping)."""
    path = os.fspath(path)
    if not iopaths.isfile(path):
        raise FileNotFoundError(f"QA file not found: {path}")
    source = canonical_source(data_source) if data_source else infer_data_source(path)
    stem = os.path.splitext(iopaths.basename(path))[0]
    stats, out = ReadStats(), []
    for i, (where, row, from_csv) in enumerate(_rows(path)):
        stats.rows += 1
        try:
            if isinstance(row, Exception):
                raise row
            # An explicit argument beats the row's field, which beats the file name.
            src = source
            if not data_source and isinstance(row, dict) and row.get("data_source"):
                src = row["data_source"]
            out.append(row_to_example(row, default_id=f"{stem}-{i}", data_source=src, from_csv=from_csv))
        except ValueError as e:
            msg = f"{where}: {e}"
            if not skip_bad_rows:
                raise QADataError(msg) from None
            stats.skipped += 1
            if len(stats.errors) < max_errors_kept:
                stats.errors.append(msg)
    if stats.skipped:
        log.warning("%s: skipped %d of %d rows (first: %s)", path, stats.skipped, stats.rows, stats.errors[0])
    return out, stats


def read_qa_file(path, data_source: str | None = None, *, skip_bad_rows: bool = False) -> list[QAExample]:
    """QAExamples of one jsonl/json/csv/parquet file; bad rows raise QADataError("file:line: ...")."""
    return read_qa_file_with_stats(path, data_source, skip_bad_rows=skip_bad_rows)[0]


def list_qa_files(paths) -> list[str]:
    """Files as given, directories expanded to their supported files (sorted); gs:// URLs too."""
    out = []
    for p in paths:
        p = os.fspath(p)
        if iopaths.is_remote(p) and iopaths.isdir(p):
            out.extend(iopaths.join(p, n) for n in iopaths.listdir(p) if n.lower().endswith(SUFFIXES))
        elif os.path.isdir(p):
            out.extend(sorted(os.path.join(p, n) for n in os.listdir(p) if n.lower().endswith(SUFFIXES)))
        else:
            out.append(p)
    return out


def read_qa_files(paths, data_source: str | None = None, *, skip_bad_rows: bool = False) -> list[QAExample]:
    """Concatenation of read_qa_file over `paths` (files or directories of supported files, sorted)."""
    return [e for f in list_qa_files(paths) for e in read_qa_file(f, data_source, skip_bad_rows=skip_bad_rows)]
