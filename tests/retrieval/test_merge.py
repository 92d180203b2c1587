"""Merging per-host part indexes: the merge equals a build over the whole corpus; bad parts are refused
and never clobber an existing index."""
import json
import os

import gin
import numpy as np
import pytest

from rexrag_jax.retrieval.cli import merge_index_main
from rexrag_jax.retrieval.index import EMB, MANIFEST, Index, IndexLoadError, build_index
from rexrag_jax.retrieval.merge import merge_indexes

ROWS, SPLIT = 120, 50  # part 0 = lines [0, 50), part 1 = lines [50, 120), as `split -n l/2` would cut


@pytest.fixture(scope="module")
def parts(shared_data, tmp_path_factory, tiny_encoder):
    d = tmp_path_factory.mktemp("merge")
    lines = open(shared_data / "corpus" / "wiki18_sample_1000.jsonl", encoding="utf-8").readlines()[:ROWS]
    whole, p0, p1 = d / "whole.jsonl", d / "part0.jsonl", d / "part1.jsonl"
    whole.write_text("".join(lines), encoding="utf-8")
    p0.write_text("".join(lines[:SPLIT]), encoding="utf-8")
    p1.write_text("".join(lines[SPLIT:]), encoding="utf-8")
    kw = dict(searcher="exact", shard_size=32, progress=False)
    dirs = [build_index(str(p), str(d / f"idx.part{i}"), tiny_encoder, extra_files={"config.gin": f"# part {i}\n"},
                        **kw) for i, p in enumerate((p0, p1))]
    whole_dir = build_index(str(whole), str(d / "idx.whole"), tiny_encoder, **kw)
    return {"dir": d, "whole": str(whole), "corpora": [str(p0), str(p1)], "parts": dirs, "whole_dir": whole_dir}


def test_merge_equals_whole_build(parts, tiny_encoder):
    out = merge_indexes(parts["parts"], str(parts["dir"] / "idx.merged"), searcher="exact", progress=False)
    # the merged corpus checksum is the original file's: loading with it verifies the merge
    merged = Index.load(out, encoder=tiny_encoder, corpus_path=parts["whole"])
    whole = Index.load(parts["whole_dir"], encoder=tiny_encoder)
    assert len(merged) == len(whole) == ROWS
    assert merged.manifest["corpus"]["sha256"] == whole.manifest["corpus"]["sha256"]
    assert [p["count"] for p in merged.manifest["corpus"]["parts"]] == [SPLIT, ROWS - SPLIT]
    assert [merged.docs.get(i) for i in range(ROWS)] == [whole.docs.get(i) for i in range(ROWS)]
    em = np.memmap(os.path.join(out, EMB), np.float32, "r", shape=(ROWS, tiny_encoder.dim))
    ew = np.memmap(os.path.join(parts["whole_dir"], EMB), np.float32, "r", shape=(ROWS, tiny_encoder.dim))
    np.testing.assert_allclose(em, ew, atol=1e-5)  # batch composition differs between the builds
    q = tiny_encoder.encode([whole.docs.get(i)["contents"][:60] for i in (3, 60, 119)], kind="query")
    got, want = merged.search_embeddings(q, 5), whole.search_embeddings(q, 5)
    assert [[h["document"]["id"] for h in r] for r in got] == [[h["document"]["id"] for h in r] for r in want]


def test_merge_builds_scann_over_all_parts(parts, tiny_encoder):
    out = merge_indexes(parts["parts"], str(parts["dir"] / "idx.scann"), searcher="scann", progress=False,
                        scann_params={"num_leaves": 0, "reorder_k": ROWS})  # reorder all: equals exact
    idx = Index.load(out, encoder=tiny_encoder)
    assert idx.manifest["searcher"] == "scann" and idx.manifest["scann_params"]["num_leaves"] == 0
    ex = Index.load(out, encoder=tiny_encoder, searcher="exact")
    q = tiny_encoder.encode(["Swiss artist", "a river in Europe"], kind="query")
    assert ([[h["document"]["id"] for h in r] for r in idx.search_embeddings(q, 5)]
            == [[h["document"]["id"] for h in r] for r in ex.search_embeddings(q, 5)])


def _snapshot(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_bad_parts_are_refused_and_existing_index_survives(parts, tmp_path, make_encoder):
    out = str(tmp_path / "idx")
    merge_indexes(parts["parts"], out, searcher="exact", progress=False)
    before = _snapshot(out)
    # overlapping parts: the same part twice
    with pytest.raises(IndexLoadError, match="already in an earlier part"):
        merge_indexes([parts["parts"][0], parts["parts"][0]], out, progress=False)
    # a part built with another encoder
    other = build_index(parts["corpora"][1], str(tmp_path / "other"), make_encoder(name="other-bert", seed=1),
                        searcher="exact", progress=False)
    with pytest.raises(IndexLoadError, match="encoder differs.*name"):
        merge_indexes([parts["parts"][0], other], out, progress=False)
    # a part corpus file edited after its build
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(open(parts["corpora"][1], "rb").read() + b"\n")
    with pytest.raises(IndexLoadError, match="part 1: corpus file .*edited.jsonl has sha256"):
        merge_indexes(parts["parts"], out, corpus_paths=[parts["corpora"][0], str(edited)], progress=False)
    with pytest.raises(IndexLoadError, match="not found"):
        merge_indexes(parts["parts"], out, corpus_paths=[parts["corpora"][0], str(tmp_path / "gone.jsonl")],
                      progress=False)
    # an unfinished part (no manifest)
    os.makedirs(tmp_path / "half")
    with pytest.raises(IndexLoadError, match="manifest.json missing"):
        merge_indexes([parts["parts"][0], str(tmp_path / "half")], out, progress=False)
    with pytest.raises(ValueError, match="searcher must be"):
        merge_indexes(parts["parts"], out, searcher="faiss", progress=False)
    assert _snapshot(out) == before
    assert json.load(open(os.path.join(out, MANIFEST)))["count"] == ROWS


def test_merge_index_cli(parts, tmp_path, capsys):
    out = str(tmp_path / "cli_idx")
    gin.clear_config()
    rc = merge_index_main(["--parts", *parts["parts"], "--index_dir", out, "--quiet",
                           "--gin_bindings", 'retrieval.build.searcher = "exact"'])
    gin.clear_config()
    assert rc == 0
    assert f"merged 2 parts into {out}: {ROWS} passages" in capsys.readouterr().out
    assert open(os.path.join(out, "config.gin")).read() == "# part 0\n"  # the parts' encoder config
    Index.load(out, corpus_path=parts["whole"])
