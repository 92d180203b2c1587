"""Evaluation: scoring and summary by hand, the evaluate loop with a fake generate_fn, `rexrag eval` CLI
(re-scoring dumps with various field names; --data with a stand-in generate_fn) on the real benchmarks."""
import json
import math

import pytest

from rexrag_jax.data import QAExample, read_qa_file
from rexrag_jax.evaluation import (evaluate, format_table, read_trajectory_dump, score_and_summarize,
                                   score_response, strip_prompt, summarize)
from rexrag_jax.evaluation import main as eval_main
from rexrag_jax.data.prompts import build_prompt_text


def test_score_response():
    assert score_response("<think> x </think><answer> The Beatles </answer>", ["beatles"]) == \
        {"prediction": "The Beatles", "em": 1.0}
    assert score_response("no answer", ["x"]) == {"prediction": None, "em": 0.0}
    assert score_response(" X ", ["x"], raw_fallback=True) == {"prediction": "X", "em": 1.0}


def test_summary_is_macro_average_by_hand():
    recs = [{"data_source": "nq", "em": 1.0}, {"data_source": "nq", "em": 0.0}, {"data_source": "nq", "em": 0.0},
            {"data_source": "hotpotqa", "em": 1.0}, {"data_source": "synth_1hop", "em": 0.0}]
    s = summarize(recs)
    assert s.per_source == {"nq": {"n": 3, "em": pytest.approx(1 / 3)}, "hotpotqa": {"n": 1, "em": 1.0},
                            "synth_1hop": {"n": 1, "em": 0.0}}
    assert s.average == pytest.approx((1 / 3 + 1 + 0) / 3) and s.num_examples == 5
    assert math.isnan(summarize([]).average)


def test_table_lists_the_seven_sources_and_average():
    s = summarize([{"data_source": "2wikimultihopqa", "em": 1.0}, {"data_source": "musique", "em": 0.0}])
    lines = format_table(s).splitlines()
    assert lines[0].split() == ["source", "nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle",
                                "avg"]
    assert lines[1].split() == ["EM", "-", "-", "-", "-", "100.0", "0.0", "-", "50.0"]
    assert lines[2].split() == ["n", "-", "-", "-", "-", "1", "1", "-", "2"]


def _fake_generate(calls, batch_limit):
    def generate_fn(batch):
        calls.append(len(batch))
        assert len(batch) <= batch_limit
        return [f"<think> t </think><answer> {ex.golden_answers[0] if i % 2 == 0 else 'wrong'} </answer>"
                for i, ex in enumerate(batch)]
    return generate_fn


def test_evaluate_scores_and_dumps(tmp_path):
    examples = [QAExample(f"q{i}", f"question {i}", [f"ans {i}", "alt"], "nq" if i < 4 else "popqa")
                for i in range(7)]
    calls = []
    out = tmp_path / "traj.jsonl"
    records, summary = evaluate(examples, _fake_generate(calls, 2), batch_size=2, out_path=out, progress=False)
    assert calls == [2, 2, 2, 1]
    assert [r["em"] for r in records] == [1.0, 0.0] * 3 + [1.0]
    assert summary.per_source["nq"]["em"] == 0.5 and summary.per_source["popqa"]["em"] == pytest.approx(2 / 3)
    dumped = [json.loads(line) for line in out.read_text().splitlines()]
    assert dumped == records and set(dumped[0]) == {"id", "data_source", "question", "golden_answers", "response",
                                                    "prediction", "em"}
    # the dump re-scores to the same numbers
    rescored, summary2 = score_and_summarize(read_trajectory_dump(out))
    assert [r["em"] for r in rescored] == [r["em"] for r in records] and summary2 == summary


def test_evaluate_rejects_bad_generate_fn(tmp_path):
    ex = [QAExample("a", "q", ["x"], "nq")]
    with pytest.raises(ValueError, match="returned 0 responses"):
        evaluate(ex, lambda b: [], progress=False)
    with pytest.raises(TypeError, match="must return strings"):
        evaluate(ex, lambda b: [[1, 2]], progress=False)


def test_strip_prompt():
    prompt = build_prompt_text("who?")
    assert strip_prompt(prompt + "<answer> Paris </answer>") == "<answer> Paris </answer>"
    chat = "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n<think> a </think>"
    assert strip_prompt(chat) == "\n<think> a </think>"
    # the prompt's example answer is never scored as the model's answer
    assert score_response(strip_prompt(prompt + "<think> no idea </think>"), ["Beijing"])["em"] == 0.0


def test_rescore_cli_with_various_field_names(tmp_path, capsys):
    dump = tmp_path / "run.jsonl"
    rows = [
        {"id": 1, "question": "q1", "golden_answers": ["Paris"], "data_source": "nq",
         "response": "<think>a</think><answer> paris </answer>"},
        {"idx": 2, "query": "q2", "answer": "Rome", "source": "2wiki", "output": "<answer> Milan </answer>"},
        {"question": "q3", "reward_model": {"ground_truth": {"target": ["Oslo"]}}, "data_source": "bamboogle",
         "sequences_str": "<|im_start|>user\n" + build_prompt_text("q3") + "<|im_end|>\n<|im_start|>assistant\n"
                          "<answer> Oslo </answer><|im_end|>"},
        {"question": "q4", "golds": ["Bern"], "dataset": "bamboogle", "completion": " Bern "},
    ]
    dump.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, summary_path = tmp_path / "scored.jsonl", tmp_path / "summary.json"
    rc = eval_main.main(["--rescore", str(dump), "--out", str(out), "--summary-json", str(summary_path),
                         "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "2wiki" in table and "avg" in table
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["em"] for r in scored] == [1.0, 0.0, 1.0, 0.0]
    assert [r["data_source"] for r in scored] == ["nq", "2wikimultihopqa", "bamboogle", "bamboogle"]
    assert [r["id"] for r in scored] == ["1", "2", "run-2", "run-3"]
    summary = json.loads(summary_path.read_text())
    assert summary["per_source"]["bamboogle"] == {"n": 2, "em": 0.5}
    assert summary["average"] == pytest.approx((1 + 0 + 0.5) / 3)
    # bare predictions with --raw-fallback
    assert eval_main.main(["--rescore", str(dump), "--raw-fallback", "--summary-json", str(summary_path)]) == 0
    assert json.loads(summary_path.read_text())["per_source"]["bamboogle"]["em"] == 1.0


def test_rescore_json_list_and_file_name_source(tmp_path):
    dump = tmp_path / "musique_preds.json"
    dump.write_text(json.dumps([{"question": "q", "answer": ["A"], "response": "<answer> a </answer>"}]))
    [rec] = read_trajectory_dump(dump)
    assert rec["data_source"] == "musique" and rec["golden_answers"] == ["A"]
    (tmp_path / "x.json").write_text(json.dumps([{"question": "q", "answer": "A", "response": "r"}]))
    assert read_trajectory_dump(tmp_path / "x.json")[0]["data_source"] == "unknown"


def test_rescore_bad_dump_is_a_clear_error(tmp_path, capsys):
    dump = tmp_path / "bad.jsonl"
    dump.write_text(json.dumps({"question": "q", "response": "r"}) + "\n")
    assert eval_main.main(["--rescore", str(dump)]) == 2
    assert f"{dump}:1: no gold answers" in capsys.readouterr().err
    dump.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    assert eval_main.main(["--rescore", str(dump)]) == 2
    assert "no response text" in capsys.readouterr().err
    assert eval_main.main(["--rescore", str(tmp_path / "absent.jsonl")]) == 2


def test_rescore_real_benchmark_golds(shared_data, tmp_path):
    """Gold answers of the real files, written back as responses, score EM = 1 (and a wrong one 0)."""
    rows = []
    for name in ["bamboogle_test.jsonl", "triviaqa_test_1k.jsonl", "hotpotqa_dev_500.jsonl"]:
        for i, ex in enumerate(read_qa_file(shared_data / "benchmarks" / name)[:50]):
            answer = ex.golden_answers[-1] if i % 5 else "zzz not an answer"
            rows.append({**ex.to_dict(), "response": f"<think> x </think>\n<answer> {answer} </answer>"})
    dump = tmp_path / "dump.jsonl"
    dump.write_text("\n".join(json.dumps(r) for r in rows))
    _, summary = score_and_summarize(read_trajectory_dump(dump))
    assert {s: d["em"] for s, d in summary.per_source.items()} == {"bamboogle": 0.8, "triviaqa": 0.8,
                                                                    "hotpotqa": 0.8}


def test_data_mode_with_stand_in_generate_fn(shared_data, tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_build(**kwargs):
        seen.update(kwargs)
        return lambda batch: [f"<answer> {ex.golden_answers[0]} </answer>" for ex in batch]

    monkeypatch.setattr(eval_main, "build_generate_fn", fake_build)
    out = tmp_path / "traj.jsonl"
    files = [str(shared_data / "benchmarks" / n) for n in ("nq_test_1k.jsonl", "musique_dev_500.jsonl")]
    rc = eval_main.main(["--data", *files, "--limit", "5", "--out", str(out), "--checkpoint", "ck",
                         "--no-progress"])
    # rollout flags not given: None, resolved by make_eval_generate_fn (the run's values, else 3/5/500/4096)
    assert rc == 0 and seen["checkpoint"] == "ck" and seen["topk"] is None and seen["max_context"] is None
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 10 and all(r["em"] == 1.0 for r in records)
    assert "100.0" in capsys.readouterr().out


def test_data_mode_reports_missing_wiring(shared_data, monkeypatch, capsys):
    def not_wired(**kwargs):
        raise NotImplementedError("rexrag_jax.rollout.make_eval_generate_fn is not wired yet")

    monkeypatch.setattr(eval_main, "build_generate_fn", not_wired)
    assert eval_main.main(["--data", str(shared_data / "benchmarks" / "bamboogle_test.jsonl")]) == 2
    assert "not wired" in capsys.readouterr().err


def _flashrag_row(i, question, golds, final_response, pred, em, **extra):
    return {"id": f"test_{i}", "question": question, "golden_answers": golds, "metadata": {},
            "output": {"final_response": final_response, "pred": pred, "stop_reason": "answer",
                       "metric_score": {"em": em, "f1": em, "acc": em}, **extra}}


def test_rescore_flashrag_search_r1_files(tmp_path, capsys):
    """FlashRAG-format output files as published: `output` dict with final_response / pred / metric_score;
    a JSON list under a `{dataset}_{date}_{method}/` dir and a jsonl with data_source per row."""
    run = tmp_path / "nq_2025_01_01_search-r1"
    run.mkdir()
    rows = [
        _flashrag_row(0, "capital of france?", ["Paris"],
                      "<think> easy </think>\n<answer> Paris </answer>", "Paris", 1.0),
        # the file's stored score disagrees with our EM (the stored metric counted a near miss)
        _flashrag_row(1, "who wrote hamlet?", ["William Shakespeare"],
                      "<search> hamlet author </search>\n\n<information>Doc 1(Title: Hamlet) ...</information>\n\n"
                      "<answer> Shakespeare </answer>", "Shakespeare", 1.0),
        # no generated text kept: `pred` is the extracted answer
        {"id": "test_2", "question": "largest planet?", "golden_answers": ["Jupiter"],
         "output": {"pred": "jupiter", "metric_score": {"em": 1.0}}},
    ]
    (run / "intermediate_data.json").write_text(json.dumps(rows))
    hotpot = tmp_path / "preds.jsonl"
    hotpot.write_text("\n".join(json.dumps({**r, "data_source": "hotpotqa"}) for r in [
        _flashrag_row(0, "q", ["Oslo"], "<answer> Oslo </answer>", "Oslo", 1.0),
        _flashrag_row(1, "q", ["Bern"], "<answer> Zurich </answer>", "Zurich", 0.0)]) + "\n")
    recs = read_trajectory_dump(run / "intermediate_data.json")
    assert [r["data_source"] for r in recs] == ["nq"] * 3
    assert recs[0]["response"].endswith("<answer> Paris </answer>") and recs[0]["stored_em"] == 1.0
    assert recs[2]["response"] is None and recs[2]["pred"] == "jupiter"
    out, summary_path = tmp_path / "scored.jsonl", tmp_path / "summary.json"
    rc = eval_main.main(["--rescore", str(run / "intermediate_data.json"), str(hotpot), "--out", str(out),
                         "--summary-json", str(summary_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["em"] for r in scored] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert [r["agrees"] for r in scored] == [True, False, True, True, True]
    summary = json.loads(summary_path.read_text())["per_source"]
    assert summary["nq"] == {"n": 3, "em": pytest.approx(2 / 3), "stored_em": 1.0, "stored_n": 3, "disagree": 1}
    assert summary["hotpotqa"]["stored_em"] == 0.5 and summary["hotpotqa"]["disagree"] == 0
    lines = {line.split()[0] if line.split()[0] != "stored" else "stored": line for line in printed.splitlines()
             if line.strip()}
    assert lines["EM"].split()[1] == "66.7" and lines["stored"].split()[2] == "100.0"   # nq: ours vs file's
    assert lines["disagree"].split()[1] == "1!"
    assert "test_1 (nq): ours 0 pred 'Shakespeare'; stored 1 pred 'Shakespeare'" in printed
    assert "1 row(s) where our EM differs" in printed


def test_rescore_flashrag_row_without_text_or_pred_is_a_clear_error(tmp_path, capsys):
    dump = tmp_path / "nq.json"
    dump.write_text(json.dumps([{"question": "q", "golden_answers": ["a"], "output": {"metric_score": {"em": 0}}}]))
    assert eval_main.main(["--rescore", str(dump)]) == 2
    err = capsys.readouterr().err
    assert "row 0: no response text" in err and "final_response" in err
