"""Read trajectory dumps (jsonl / json list) for re-scoring, accepting the common field names.

Field mapping, first present wins:
  question       question, query, problem, or the text after "Question:" in prompt
  golden_answers golden_answers, answers, answer, golds, gold, target, ground_truth,
                 reward_model.ground_truth.target (string or list)
  response       response, response_text, output, generated_text, completion, solution_str,
                 sequences_str, trajectory, text, prediction, pred
  data_source    data_source, source, dataset; else inferred from the dump's file name; else "unknown"
  id             id, idx, qid, uid, _id (absent -> "{file stem}-{row}")
FlashRAG / Search-R1 output files (`intermediate_data.json`, a JSON list, or jsonl) keep the model's
output in a dict `output`: {"final_response" | "raw_pred" | "response": text, "pred": extracted answer,
"metric_score": {"em": ..., ...}, "stop_reason": ...}. The response is the first text field of that
dict; with none, `pred` is taken as the already extracted answer (record "response" None, "pred" set).
The file's own score is kept as "stored_em" (metric_score em, else acc) and its answer as "stored_pred",
so `rexrag eval --rescore` can print both EMs and flag disagreements. data_source for such files, when
the rows carry none, also comes from the parent directory name (FlashRAG's `{dataset}_{date}_{method}/`).
A response holding the whole rendered prompt is cut to the model's part: after the first
"<|im_start|>assistant", or after the line "... For example, <answer> Beijing </answer>. Question: {q}"
of a bare SPEC prompt, so that example is never taken for the model's answer.
"""
from __future__ import annotations

import json
import os

from rexrag_jax.data.readers import ANSWER_FIELDS, QADataError, _answers, _first, _question_from_prompt
from rexrag_jax.data.schema import canonical_source, infer_data_source
from rexrag_jax.io import paths

RESPONSE_FIELDS = ("response", "response_text", "output", "generated_text", "completion", "solution_str",
                   "sequences_str", "trajectory", "text", "prediction", "pred")
DUMP_ANSWER_FIELDS = ANSWER_FIELDS[:3] + ("golds", "gold") + ANSWER_FIELDS[3:]
SOURCE_FIELDS = ("data_source", "source", "dataset")
ID_FIELDS = ("id", "idx", "qid", "uid", "_id")
FLASHRAG_RESPONSE_FIELDS = ("final_response", "raw_pred", "response", "generated_text")
FLASHRAG_SCORE_FIELDS = ("em", "acc")
_ASSISTANT = "<|im_start|>assistant"
_PROMPT_EXAMPLE = "For example, <answer> Beijing </answer>."


def strip_prompt(text: str) -> str:
    """The model's part of a dump text that may include the rendered prompt (see module docstring)."""
    if _ASSISTANT in text:
        text = text.split(_ASSISTANT, 1)[1]
    if _PROMPT_EXAMPLE in text:  # a bare SPEC prompt: drop it up to the end of its "Question: ...\n" line
        rest = text.split(_PROMPT_EXAMPLE, 1)[1]
        q = rest.find("Question:")
        nl = rest.find("\n", q) if q >= 0 else -1
        text = rest[nl + 1:] if nl >= 0 else rest
    return text


def _dump_rows(path: str):
    if path.lower().endswith(".jsonl"):
        with paths.open_file(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{lineno}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise QADataError(f"{path}:{lineno}: invalid JSON: {e}") from None
    elif path.lower().endswith(".json"):
        with paths.open_file(path, "r", encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise QADataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if isinstance(data, dict):
            data = data.get("data", data.get("trajectories"))
        if not isinstance(data, list):
            raise QADataError(f"{path}: expected a JSON list of trajectories (or {{'data': [...]}})")
        for i, row in enumerate(data):
            yield f"{path}:row {i}", row
    else:
        raise QADataError(f"{path}: unsupported dump type; expected .jsonl or .json")


def read_trajectory_dump(path, data_source: str | None = None) -> list[dict]:
    """Records {"id", "question", "golden_answers", "data_source", "response"} (+ the row's other fields)."""
    path = os.fspath(path)  # a local path or a gs:// URL (rexrag_jax.io.paths)
    if not paths.isfile(path):
        raise FileNotFoundError(f"trajectory dump not found: {path}")
    file_source = canonical_source(data_source) if data_source else (
        infer_data_source(path) or infer_data_source(paths.basename(paths.dirname(path))))
    stem = os.path.splitext(paths.basename(path))[0]
    out = []
    for i, (where, row) in enumerate(_dump_rows(path)):
        if not isinstance(row, dict):
            raise QADataError(f"{where}: expected an object, got {type(row).__name__}")
        stored = _flashrag_output(row["output"], where) if isinstance(row.get("output"), dict) else {}
        if stored:
            response = stored.pop("response")
        else:
            _, response = _first(row, RESPONSE_FIELDS)
            if not isinstance(response, str):
                raise QADataError(f"{where}: no response text: expected a string in one of {RESPONSE_FIELDS} "
                                  f"(or a FlashRAG `output` dict with one of {FLASHRAG_RESPONSE_FIELDS} or "
                                  f"'pred'); fields present: {sorted(row)}")
        gfield, golds = _first(row, DUMP_ANSWER_FIELDS)
        if gfield is None:
            raise QADataError(f"{where}: no gold answers: expected one of {DUMP_ANSWER_FIELDS}; "
                              f"fields present: {sorted(row)}")
        try:
            golds = _answers(golds, from_csv=False)
        except ValueError as e:
            raise QADataError(f"{where}: field {gfield!r}: {e}") from None
        _, question = _first(row, ("question", "query", "problem"))
        if question is None:
            question = _question_from_prompt(row.get("prompt")) or ""
        _, source = _first(row, SOURCE_FIELDS)
        source = canonical_source(data_source) if data_source else (
            canonical_source(source) if isinstance(source, str) and source else file_source or "unknown")
        _, ident = _first(row, ID_FIELDS)
        extra = {k: v for k, v in row.items() if k not in ("prediction", "em")}
        out.append({**extra, **stored, "id": f"{stem}-{i}" if ident in (None, "") else str(ident),
                    "question": question, "golden_answers": golds, "data_source": source,
                    "response": None if response is None else strip_prompt(response)})
    return out


def _flashrag_output(output: dict, where: str) -> dict:
    """{"response": text or None, "pred": str (when no text), "stored_em": float | None, "stored_pred": ...}
    from a FlashRAG `output` dict (see module docstring)."""
    _, response = _first(output, FLASHRAG_RESPONSE_FIELDS)
    pred = output.get("pred")
    if not isinstance(response, str) and not isinstance(pred, str):
        raise QADataError(f"{where}: no response text: the FlashRAG `output` dict has no string in "
                          f"{FLASHRAG_RESPONSE_FIELDS} and no string 'pred'; its fields: {sorted(output)}")
    scores = output.get("metric_score")
    stored_em = None
    if isinstance(scores, dict):
        _, stored_em = _first(scores, FLASHRAG_SCORE_FIELDS)
    rec = {"response": response if isinstance(response, str) else None,
           "stored_em": float(stored_em) if isinstance(stored_em, (int, float)) else None,
           "stored_pred": pred if isinstance(pred, str) else None}
    if rec["response"] is None:
        rec["pred"] = pred
    return rec
