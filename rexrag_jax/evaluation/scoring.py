"""Per-trajectory EM and the per-data_source summary table (SPEC §2 evaluation metric).

    EM_s    = mean over the examples of source s of EM(last <answer> of the response, golds)
    average = mean of EM_s over the sources present (macro average, as in the paper's "Avg." column)

Records that carry the dump's own score ("stored_em", e.g. FlashRAG's metric_score em) also get
"agrees" (our EM == stored EM); the summary then has per source "stored_em" (mean of the stored scores)
and "disagree" (rows where the two differ), and format_table prints them under ours.
"""
from __future__ import annotations

import dataclasses

from rexrag_jax.data.schema import BENCHMARK_SOURCES, SHORT_NAMES
from rexrag_jax.rewards import exact_match, extract_last_answer


def score_response(response: str, golds, raw_fallback: bool = False) -> dict:
    """{"prediction": last <answer> content or None, "em": 0.0 | 1.0}.

    raw_fallback: a response without any `<answer>` block is itself taken as the prediction (for dumps
    that store bare predicted answers).
    """
    prediction = extract_last_answer(response)
    if prediction is None and raw_fallback:
        prediction = response.strip()
    return {"prediction": prediction, "em": exact_match(prediction, golds)}


def score_record(r: dict, raw_fallback: bool = False) -> dict:
    """score_response on r["response"]; a record with response None (an answer-only dump row, e.g. a
    FlashRAG `pred` without the generated text) is scored on its "pred" as the extracted answer."""
    if r.get("response") is None:
        pred = r.get("pred")
        out = {"prediction": pred, "em": exact_match(pred, r["golden_answers"])}
    else:
        out = score_response(r["response"], r["golden_answers"], raw_fallback)
    if r.get("stored_em") is not None:
        out["agrees"] = out["em"] == float(r["stored_em"])
    return out


@dataclasses.dataclass
class Summary:
    per_source: dict[str, dict]  # source -> {"n": int, "em": float in [0, 1]} (+ "stored_em", "disagree")
    average: float               # macro average over present sources (nan if none)
    num_examples: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(records) -> Summary:
    """Per-source mean of record["em"] and their macro average; records need "data_source" and "em"."""
    totals: dict[str, list[float]] = {}
    stored: dict[str, list[float]] = {}
    disagree: dict[str, int] = {}
    for r in records:
        totals.setdefault(r["data_source"], []).append(float(r["em"]))
        if r.get("stored_em") is not None:
            stored.setdefault(r["data_source"], []).append(float(r["stored_em"]))
            disagree[r["data_source"]] = disagree.get(r["data_source"], 0) + (float(r["em"]) != float(r["stored_em"]))
    per_source = {s: {"n": len(v), "em": sum(v) / len(v)} for s, v in totals.items()}
    for s, v in stored.items():
        per_source[s].update(stored_em=sum(v) / len(v), stored_n=len(v), disagree=disagree[s])
    ems = [d["em"] for d in per_source.values()]
    return Summary(per_source=per_source, average=sum(ems) / len(ems) if ems else float("nan"),
                   num_examples=sum(d["n"] for d in per_source.values()))


def score_and_summarize(records, raw_fallback: bool = False) -> tuple[list[dict], Summary]:
    """Add "prediction" and "em" to each record ({"response", "golden_answers", "data_source", ...})."""
    scored = [{**r, **score_record(r, raw_fallback)} for r in records]
    return scored, summarize(scored)


def format_table(summary: Summary) -> str:
    """EM x 100 per source: the 7 benchmarks always (``-`` when absent), other sources after, then avg."""
    sources = list(BENCHMARK_SOURCES) + sorted(s for s in summary.per_source if s not in BENCHMARK_SOURCES)
    names = [SHORT_NAMES.get(s, s) for s in sources] + ["avg"]
    ems, ns = [], []
    for s in sources:
        d = summary.per_source.get(s)
        ems.append(f"{100 * d['em']:.1f}" if d else "-")
        ns.append(str(d["n"]) if d else "-")
    ems.append(f"{100 * summary.average:.1f}" if summary.per_source else "-")
    ns.append(str(summary.num_examples))
    widths = [max(len(a), len(b), len(c)) for a, b, c in zip(names, ems, ns)]
    label = max(len("EM"), len("n"), len("source"))
    rows = [("source", names), ("EM", ems), ("n", ns)]
    if any("stored_em" in d for d in summary.per_source.values()):  # the dump's own score, and disagreements
        st = [summary.per_source.get(s, {}) for s in sources]
        stored = [f"{100 * d['stored_em']:.1f}" if "stored_em" in d else "-" for d in st]
        dis = [(f"{d['disagree']}!" if d["disagree"] else "0") if "stored_em" in d else "-" for d in st]
        vals = [d["stored_em"] for d in st if "stored_em" in d]
        stored.append(f"{100 * sum(vals) / len(vals):.1f}")
        dis.append(str(sum(d.get("disagree", 0) for d in st)))
        rows += [("stored EM", stored), ("disagree", dis)]
        widths = [max(w, len(a), len(b)) for w, a, b in zip(widths, stored, dis)]
        label = max(label, len("stored EM"))
    return "\n".join(f"{head:<{label}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
                     for head, cells in rows)
