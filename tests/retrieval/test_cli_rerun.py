"""build-index / merge-index on an existing output: an interrupted build resumes, a finished index or a
stale partial build is refused (one line naming --overwrite, exit 2), --overwrite rebuilds and swaps the
new index in whole, a directory that is not an index is never replaced."""
import json
import os

import gin
import numpy as np
import pytest

from rexrag_jax.retrieval import encoder as E
from rexrag_jax.retrieval.cli import build_index_main, merge_index_main
from rexrag_jax.retrieval.index import EMB, MANIFEST, Index

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpora(shared_data, tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    lines = open(shared_data / "corpus" / "wiki18_sample_1000.jsonl", encoding="utf-8").readlines()
    a, b = d / "a.jsonl", d / "b.jsonl"
    a.write_text("".join(lines[:40]), encoding="utf-8")
    b.write_text("".join(lines[40:64]), encoding="utf-8")
    return str(a), str(b)


def _build(tiny_hf_dir, corpus, index_dir, *extra):
    gin.clear_config()  # the CLIs finalize (lock) the gin config; each call here is a fresh command
    return build_index_main(["--gin_file", os.path.join(REPO, "gin/retriever/minilm_exact.gin"),
                             "--gin_bindings", 'retrieval.encoder.kind = "bert"',
                             "--gin_bindings", f'retrieval.encoder.model_dir = "{tiny_hf_dir}"',
                             "--gin_bindings", 'retrieval.encoder.name = "tiny"',
                             "--gin_bindings", "retrieval.encoder.max_length = 64",
                             "--corpus", corpus, "--index_dir", str(index_dir), "--quiet", *extra])


def _one_line_err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err, err
    return err


def _emb(index_dir):
    m = json.load(open(os.path.join(index_dir, MANIFEST)))
    return np.fromfile(os.path.join(index_dir, EMB), np.float32).reshape(m["count"], m["dim"])


def test_finished_index_is_refused_then_overwritten_whole(tiny_hf_dir, corpora, tmp_path, capsys):
    a, b = corpora
    idx = tmp_path / "idx"
    assert _build(tiny_hf_dir, a, idx) == 0
    manifest = (idx / MANIFEST).read_text()
    assert _build(tiny_hf_dir, a, idx) == 2
    err = _one_line_err(capsys)
    assert "a finished index is already there" in err and "--overwrite" in err and str(idx) in err
    assert (idx / MANIFEST).read_text() == manifest  # untouched
    (idx / "stray.txt").write_text("old")  # a file only the old index dir has
    assert _build(tiny_hf_dir, b, idx, "--overwrite") == 0
    assert not (idx / "stray.txt").exists()  # replaced whole, not written over
    assert Index.load(str(idx), corpus_path=b).manifest["count"] == 24
    assert sorted(os.listdir(tmp_path)) == ["idx"]  # no .partial / .old-* left beside it


def test_interrupted_build_resumes_and_stale_partial_is_refused(tiny_hf_dir, corpora, tmp_path, capsys,
                                                                 monkeypatch):
    a, _ = corpora
    shard = ["--gin_bindings", "retrieval.build.shard_size = 16"]
    ref = tmp_path / "ref"
    assert _build(tiny_hf_dir, a, ref, *shard) == 0

    calls = {"n": 0}
    real = E.TextEncoder.encode

    def dies_on_second_shard(self, texts, kind="passage", **kw):
        if kind == "passage":
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("killed")
        return real(self, texts, kind=kind, **kw)

    idx = tmp_path / "idx"
    monkeypatch.setattr(E.TextEncoder, "encode", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        _build(tiny_hf_dir, a, idx, *shard)
    monkeypatch.setattr(E.TextEncoder, "encode", real)
    state = json.load(open(str(idx) + ".partial/build_state.json"))
    assert state["shards_done"] == 1 and not idx.exists()

    # other settings: refused, the partial build kept
    assert _build(tiny_hf_dir, a, idx, "--gin_bindings", "retrieval.build.shard_size = 8") == 2
    err = _one_line_err(capsys)
    assert "unfinished build with other settings (shard_size differ)" in err and "--overwrite" in err
    assert json.load(open(str(idx) + ".partial/build_state.json"))["shards_done"] == 1

    # same settings: resumes at shard 2 and equals the uninterrupted build
    gin.clear_config()
    assert build_index_main(["--gin_file", os.path.join(REPO, "gin/retriever/minilm_exact.gin"),
                             "--gin_bindings", 'retrieval.encoder.kind = "bert"',
                             "--gin_bindings", f'retrieval.encoder.model_dir = "{tiny_hf_dir}"',
                             "--gin_bindings", 'retrieval.encoder.name = "tiny"',
                             "--gin_bindings", "retrieval.encoder.max_length = 64", *shard,
                             "--corpus", a, "--index_dir", str(idx)]) == 0
    assert "resuming partial build" in capsys.readouterr().out
    np.testing.assert_allclose(_emb(idx), _emb(ref), rtol=1e-6, atol=1e-6)


def test_overwrite_discards_a_stale_partial_build(tiny_hf_dir, corpora, tmp_path):
    a, _ = corpora
    idx = tmp_path / "idx"
    partial = tmp_path / "idx.partial"
    partial.mkdir()
    (partial / "build_state.json").write_text(json.dumps({"key": {"corpus_sha256": "other"}, "count": 3,
                                                          "shards_done": 1}))
    assert _build(tiny_hf_dir, a, idx) == 2
    assert _build(tiny_hf_dir, a, idx, "--overwrite") == 0
    assert Index.load(str(idx), corpus_path=a).manifest["count"] == 40 and not partial.exists()


def test_a_directory_that_is_not_an_index_is_never_replaced(tiny_hf_dir, corpora, tmp_path, capsys):
    a, _ = corpora
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for extra in ((), ("--overwrite",)):
        assert _build(tiny_hf_dir, a, mine, *extra) == 2
        assert "not empty and not an index" in _one_line_err(capsys)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_merge_index_refuses_a_finished_output_unless_overwrite(tiny_hf_dir, corpora, tmp_path, capsys):
    a, b = corpora
    parts = [tmp_path / "p0", tmp_path / "p1"]
    assert _build(tiny_hf_dir, a, parts[0]) == 0 and _build(tiny_hf_dir, b, parts[1]) == 0
    out = tmp_path / "merged"
    args = ["--parts", *map(str, parts), "--index_dir", str(out), "--quiet"]
    gin.clear_config()
    assert merge_index_main(args) == 0
    capsys.readouterr()
    (out / "stray.txt").write_text("old")
    gin.clear_config()
    assert merge_index_main(args) == 2
    err = _one_line_err(capsys)
    assert "a finished index is already there" in err and "--overwrite" in err
    assert (out / "stray.txt").exists()
    gin.clear_config()
    assert merge_index_main(args + ["--overwrite"]) == 0
    assert not (out / "stray.txt").exists() and Index.load(str(out)).manifest["count"] == 64


def test_gin_flag_spellings_are_aliases(tiny_hf_dir, corpora, tmp_path):
    """--gin_bindings (the train/build-index spelling) also answers to --gin_param / --gin-param /
    --gin-bindings, and --gin_file to --gin-file, so one command line style works for every sub-command."""
    a, _ = corpora
    gin.clear_config()
    assert build_index_main(["--gin-file", os.path.join(REPO, "gin/retriever/minilm_exact.gin"),
                             "--gin_param", 'retrieval.encoder.kind = "bert"',
                             "--gin-param", f'retrieval.encoder.model_dir = "{tiny_hf_dir}"',
                             "--gin-bindings", 'retrieval.encoder.name = "tiny"',
                             "--gin_bindings", "retrieval.encoder.max_length = 64",
                             "--corpus", a, "--index_dir", str(tmp_path / "idx"), "--quiet"]) == 0
    assert Index.load(str(tmp_path / "idx")).manifest["encoder"]["name"] == "tiny"
    from rexrag_jax.evaluation.main import _parser
    for flag in ("--gin-param", "--gin_param", "--gin_bindings", "--gin-bindings"):
        assert _parser().parse_args(["--rescore", "x", flag, "A = 1"]).gin_param == ["A = 1"]


@pytest.mark.parametrize("extra, expect", [
    (["--gin_file", "nope.gin"], "bad gin config: Unable to open file: nope.gin"),
    (["--gin_bindings", "retrieval.encodr.kind = 'bert'"], "bad gin config: No configurable matching"),
])
def test_gin_errors_are_one_line_exit_2(corpora, tmp_path, capsys, extra, expect):
    gin.clear_config()
    assert build_index_main(["--corpus", corpora[0], "--index_dir", str(tmp_path / "i"), *extra]) == 2
    err = _one_line_err(capsys)
    assert err.startswith("rexrag build-index: ") and expect in err and not (tmp_path / "i").exists()
    gin.clear_config()
    assert merge_index_main(["--parts", "p0", "--index_dir", str(tmp_path / "m"), *extra]) == 2
    assert expect in _one_line_err(capsys)
