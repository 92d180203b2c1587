"""tfds builder from local files: same examples as the plain reader, array_record, no TensorFlow import."""
import builtins
import json
import sys

import pytest

from rexrag_jax.data import read_qa_file

tfds = pytest.importorskip("tensorflow_datasets")
from rexrag_jax.data import tfds_qa  # noqa: E402


def test_builder_matches_plain_reader(shared_data, tmp_path):
    bench = shared_data / "benchmarks"
    test_files = [str(bench / "bamboogle_test.jsonl"), str(bench / "musique_dev_500.jsonl")]
    train = tmp_path / "nq_train.jsonl"
    train.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": ["a", f"b{i}"]}) for i in range(30)))
    builder = tfds_qa.prepare_tfds({"test": test_files, "train": [str(train)]}, tmp_path / "tfds")
    assert tfds_qa.read_tfds(builder, "test") == read_qa_file(test_files[0]) + read_qa_file(test_files[1])
    assert tfds_qa.read_tfds(builder, "train") == read_qa_file(train)
    assert any(p.name.startswith("search_r1_qa-test.array_record") for p in builder.data_path.iterdir())
    assert "tensorflow" not in sys.modules  # tfds without TensorFlow

    # same inputs -> same directory (reused); a changed file -> a new config directory
    again = tfds_qa.prepare_tfds({"test": test_files, "train": [str(train)]}, tmp_path / "tfds")
    assert again.data_dir == builder.data_dir
    train.write_text(json.dumps({"question": "new", "answer": "x"}) + "\n")
    changed = tfds_qa.prepare_tfds({"test": test_files, "train": [str(train)]}, tmp_path / "tfds")
    assert changed.data_dir != builder.data_dir
    assert [e.question for e in tfds_qa.read_tfds(changed, "train")] == ["new"]


def test_missing_file_and_bad_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match="split 'test'"):
        tfds_qa.prepare_tfds({"test": [str(tmp_path / "absent.jsonl")]}, tmp_path / "tfds")
    bad = tmp_path / "nq_bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": "q"}\n')
    with pytest.raises(Exception, match=r"nq_bad.jsonl:2: no gold answers"):
        tfds_qa.prepare_tfds({"test": [str(bad)]}, tmp_path / "tfds")
    ok = tfds_qa.prepare_tfds({"test": [str(bad)]}, tmp_path / "tfds", skip_bad_rows=True)
    assert len(tfds_qa.read_tfds(ok, "test")) == 1


def test_clear_error_without_tfds(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("tensorflow_datasets"):
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(tfds_qa, "_BUILDER", None)
    with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
        tfds_qa.builder_class()
