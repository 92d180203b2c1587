"""QA readers: the real benchmark files, every field variant, every file format, bad rows."""
import builtins
import json

import pytest

from rexrag_jax.data import QADataError, infer_data_source, read_qa_file, read_qa_file_with_stats, read_qa_files

EXPECTED = {  # file -> (rows, data_source) from ../shared/data/MANIFEST.md
    "nq_open_dev.jsonl": (3610, "nq"), "nq_test_1k.jsonl": (1000, "nq"),
    "triviaqa_test_1k.jsonl": (1000, "triviaqa"), "popqa_test_1k.jsonl": (1000, "popqa"),
    "bamboogle_test.jsonl": (125, "bamboogle"), "hotpotqa_dev_500.jsonl": (500, "hotpotqa"),
    "2wiki_dev_500.jsonl": (500, "2wikimultihopqa"), "musique_dev_500.jsonl": (500, "musique"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_benchmark_files(shared_data, name):
    path = shared_data / "benchmarks" / name
    rows, source = EXPECTED[name]
    examples, stats = read_qa_file_with_stats(path)
    assert len(examples) == rows and stats.skipped == 0
    assert {e.data_source for e in examples} == {source}
    first = json.loads(path.open().readline())
    gold = first.get("golden_answers", first.get("answer"))
    assert examples[0].golden_answers == ([gold] if isinstance(gold, str) else gold)
    assert examples[0].question == first["question"].strip()
    assert examples[0].id == str(first.get("id", first.get("idx", "nq_open_dev-0")))
    assert all(e.golden_answers and all(isinstance(a, str) and a for a in e.golden_answers) for e in examples)


def test_read_directory(shared_data):
    examples = read_qa_files([shared_data / "benchmarks"])
    assert len(examples) == sum(n for n, _ in EXPECTED.values())


@pytest.mark.parametrize("name,source", [
    ("nq_test_1k.jsonl", "nq"), ("NQ-open.dev.jsonl", "nq"), ("natural_questions.json", "nq"),
    ("2wiki_dev.jsonl", "2wikimultihopqa"), ("hotpot_train.csv", "hotpotqa"), ("musique.parquet", "musique"),
    ("Bamboogle.jsonl", "bamboogle"), ("popqa.jsonl", "popqa"), ("triviaqa-test.jsonl", "triviaqa"),
    ("synth_2hop_test.jsonl", "synth_2hop"), ("unique.jsonl", None), ("inquiry.jsonl", None),
])
def test_infer_data_source(name, source):
    assert infer_data_source(name) == source


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_field_variants(tmp_path):
    rows = [
        {"id": "a", "question": " q1 ", "golden_answers": ["x", "y"]},
        {"idx": 7, "question": "q2", "answer": "z"},
        {"question": "q3", "answer": ["u", ""]},                          # empty golds dropped
        {"qid": "c", "query": "q4", "answers": [1984]},                  # numbers -> strings
        {"data_source": "nq", "prompt": [{"role": "user", "content": "Answer ... Question: who is x?\n"}],
         "reward_model": {"ground_truth": {"target": ["t"]}}, "extra_info": {"index": 3}},  # Search-R1 parquet row
    ]
    ex = read_qa_file(_write_jsonl(tmp_path / "hotpot_mixed.jsonl", rows))
    assert [e.id for e in ex] == ["a", "7", "hotpot_mixed-2", "c", "3"]
    assert [e.question for e in ex] == ["q1", "q2", "q3", "q4", "who is x?"]
    assert [e.golden_answers for e in ex] == [["x", "y"], ["z"], ["u"], ["1984"], ["t"]]
    # the row's data_source beats the file name; the argument beats both
    assert [e.data_source for e in ex] == ["hotpotqa"] * 4 + ["nq"]
    ex = read_qa_file(tmp_path / "hotpot_mixed.jsonl", data_source="2wiki")
    assert {e.data_source for e in ex} == {"2wikimultihopqa"}


@pytest.mark.parametrize("bad,message", [
    ('{"question": "q"}', "no gold answers"),
    ('{"answer": "a"}', "no question"),
    ('{"question": "q", "answer": []}', "no non-empty gold answer"),
    ('{"question": "q", "answer": {"x": 1}}', "field 'answer'"),
    ('{"question": "q", "answer": [null]}', "answer items must be strings"),
    ('{"question": "q", "answer"', "invalid JSON"),
    ('["q", "a"]', "expected an object"),
])
def test_bad_rows_name_file_and_line(tmp_path, bad, message):
    path = _write_jsonl(tmp_path / "nq_bad.jsonl", [{"question": "ok", "answer": "a"}, "", bad])
    with pytest.raises(QADataError, match=message) as err:
        read_qa_file(path)
    assert f"{path}:3:" in str(err.value)
    examples, stats = read_qa_file_with_stats(path, skip_bad_rows=True)
    assert len(examples) == 1 and stats.skipped == 1 and stats.rows == 2
    assert stats.errors[0].startswith(f"{path}:3:")


def test_unknown_source_is_an_error(tmp_path):
    path = _write_jsonl(tmp_path / "mystery.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(QADataError, match="no data_source"):
        read_qa_file(path)
    assert read_qa_file(path, data_source="custom")[0].data_source == "custom"


def test_json_and_csv(tmp_path):
    (tmp_path / "popqa.json").write_text(json.dumps({"data": [{"id": 1, "question": "q", "answer": "a"}]}))
    assert read_qa_file(tmp_path / "popqa.json")[0].golden_answers == ["a"]
    (tmp_path / "nq_bad.json").write_text(json.dumps([{"question": "q", "answer": "a"}, {"question": "q"}]))
    with pytest.raises(QADataError, match=r"nq_bad.json:row 1: no gold answers"):
        read_qa_file(tmp_path / "nq_bad.json")
    (tmp_path / "nq.json").write_text("{broken")
    with pytest.raises(QADataError, match=r"nq.json:1: invalid JSON"):
        read_qa_file(tmp_path / "nq.json")
    csv_path = tmp_path / "bamboogle.csv"
    csv_path.write_text('id,question,golden_answers\n1,"q, with comma","[""a"", ""b""]"\n2,q2,plain\n3,q3,\n')
    with pytest.raises(QADataError, match=r"bamboogle.csv:4: no gold answers"):
        read_qa_file(csv_path)
    ex = read_qa_file(csv_path, skip_bad_rows=True)
    assert [(e.question, e.golden_answers) for e in ex] == [("q, with comma", ["a", "b"]), ("q2", ["plain"])]


def test_parquet_roundtrip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"id": ["x", "y"], "question": ["q1", "q2"], "golden_answers": [["a"], ["b", "c"]]})
    pq.write_table(table, tmp_path / "musique_dev.parquet")
    ex = read_qa_file(tmp_path / "musique_dev.parquet")
    assert [(e.id, e.golden_answers, e.data_source) for e in ex] == [("x", ["a"], "musique"),
                                                                      ("y", ["b", "c"], "musique")]


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    (tmp_path / "nq.parquet").write_bytes(b"PAR1")
    with pytest.raises(QADataError, match="needs pyarrow"):
        read_qa_file(tmp_path / "nq.parquet")


def test_unsupported_and_missing(tmp_path):
    (tmp_path / "nq.txt").write_text("x")
    with pytest.raises(QADataError, match="unsupported file type"):
        read_qa_file(tmp_path / "nq.txt")
    with pytest.raises(FileNotFoundError):
        read_qa_file(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("name,canonical", [
    ("2wiki", "2wikimultihopqa"), ("NQ", "nq"), ("hotpot", "hotpotqa"), ("TriviaQA", "triviaqa"),
    ("synth_1hop", "synth_1hop"), ("nq_custom", "nq_custom"), ("my-set", "my-set"),
])
def test_canonical_source_is_exact_alias_only(name, canonical):
    from rexrag_jax.data import canonical_source
    assert canonical_source(name) == canonical
