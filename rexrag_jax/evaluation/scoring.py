"""Per-trajectory EM and the per-data_source summary table (SPEC §2 evaluation metric).

    EM_s    = mean over the examples of source s of EM(last <answer> of the response, golds)
    average = mean of EM_s over the sources present (macro average, as in the paper's "Avg." column)
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


@dataclasses.dataclass
class Summary:
    per_source: dict[str, dict]  # source -> {"n": int, "em": float in [0, 1]}
    average: float               # macro average over present sources (nan if none)
    num_examples: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(records) -> Summary:
    """Per-source mean of record["em"] and their macro average; records need "data_source" and "em"."""
    totals: dict[str, list[float]] = {}
    for r in records:
        totals.setdefault(r["data_source"], []).append(float(r["em"]))
    per_source = {s: {"n": len(v), "em": sum(v) / len(v)} for s, v in totals.items()}
    ems = [d["em"] for d in per_source.values()]
    return Summary(per_source=per_source, average=sum(ems) / len(ems) if ems else float("nan"),
                   num_examples=sum(d["n"] for d in per_source.values()))


def score_and_summarize(records, raw_fallback: bool = False) -> tuple[list[dict], Summary]:
    """Add "prediction" and "em" to each record ({"response", "golden_answers", "data_source", ...})."""
    scored = [{**r, **score_response(r["response"], r["golden_answers"], raw_fallback)} for r in records]
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
    return "\n".join(f"{head:<{label}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
                     for head, cells in rows)
