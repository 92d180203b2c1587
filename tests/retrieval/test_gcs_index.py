"""Retriever index dirs on gs://, against a GCS emulator on 127.0.0.1 started here (tests/gcs_emulator.py).

build_index / merge-index write to gs://BUCKET/..., Index.load reads them back through a local cache dir
(ScaNN and the memmaps need local files), and searches give what the same index built locally gives.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gcs_emulator import emulator, skip_without_emulator, subprocess_env  # noqa: E402

skip_without_emulator()

from rexrag_jax.retrieval.cli import build_index_main, make_encoder, merge_index_main  # noqa: E402
from rexrag_jax.retrieval.index import Index, IndexLoadError, build_index  # noqa: E402
from rexrag_jax.retrieval.retriever import HttpRetriever, LocalRetriever  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BUCKET = "rexrag-index-test"
N = 64
SCANN = {"num_leaves": 4, "num_leaves_to_search": 4, "reorder_k": N}
QUERIES = ["who wrote the declaration of independence", "largest river in europe", "a film about a ship",
           "capital city", "football club founded"]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with emulator(tmp_path_factory.mktemp("fake-gcs"), BUCKET) as (url, fs):
        yield url, fs


@pytest.fixture(autouse=True)
def _cache_and_cwd(tmp_path, monkeypatch):
    """A fresh local cache dir per test, and cwd in tmp_path (a stray local `gs:` folder would land there)."""
    monkeypatch.setenv("REXRAG_REMOTE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    yield
    for d in (tmp_path, REPO):
        assert not (d / "gs:").exists(), f"a local 'gs:' folder was written in {d}"


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    p.write_text("".join(open(shared_data / "corpus" / "wiki18_sample_1000.jsonl").readlines()[:N]))
    return str(p)


def _hits(index, encoder, queries=QUERIES, k=5):
    res = LocalRetriever(index, encoder).search(queries, k)
    return [[h["document"]["id"] for h in r] for r in res], np.array([[h["score"] for h in r] for r in res])


def _objects(fs, key):
    fs.invalidate_cache()
    return sorted(p[len(f"{BUCKET}/{key}/"):] for p in fs.find(f"{BUCKET}/{key}"))


@pytest.mark.parametrize("searcher", ["exact", "scann"])
def test_index_built_to_gcs_loads_back_with_the_local_results(gcs, corpus, tiny_encoder, tmp_path, searcher):
    url, fs = gcs
    kw = dict(searcher=searcher, shard_size=16, progress=False, scann_params=SCANN if searcher == "scann" else None)
    local = build_index(corpus, str(tmp_path / "local_idx"), tiny_encoder, **kw)
    remote = f"gs://{BUCKET}/index-{searcher}"
    assert build_index(corpus, remote + "/", tiny_encoder, extra_files={"config.gin": "x = 1\n"}, **kw) == remote

    objs = _objects(fs, f"index-{searcher}")
    assert {"manifest.json", "docs.jsonl", "doc_offsets.npy", "embeddings.f32", "config.gin"} <= set(objs), objs
    assert any(o.startswith("scann/") for o in objs) == (searcher == "scann"), objs
    assert not any(o.endswith((".partial", "build_state.json")) or ".tmp" in o for o in objs), objs

    shutil.rmtree(tmp_path / "cache")  # the build's local copy: loading must download the index
    idx = Index.load(remote, encoder=tiny_encoder, corpus_path=corpus)
    assert idx.dir == remote and idx.local_dir.startswith(str(tmp_path / "cache"))
    assert idx.manifest["searcher"] == searcher and idx.manifest["count"] == N
    want_ids, want_scores = _hits(Index.load(local, encoder=tiny_encoder), tiny_encoder)
    got_ids, got_scores = _hits(idx, tiny_encoder)
    assert got_ids == want_ids
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-6, atol=1e-6)

    # A second load finds its cache current (nothing downloaded: the cached files are the same inodes).
    emb = os.path.join(idx.local_dir, "embeddings.f32")
    ino = os.stat(emb).st_ino
    assert Index.load(remote).local_dir == idx.local_dir and os.stat(emb).st_ino == ino


def test_rebuild_over_gcs_index_drops_stale_objects_and_reads_a_gcs_corpus(gcs, corpus, tiny_encoder):
    url, fs = gcs
    remote = f"gs://{BUCKET}/rebuilt"
    build_index(corpus, remote, tiny_encoder, searcher="scann", scann_params=SCANN, progress=False)
    assert any(o.startswith("scann/") for o in _objects(fs, "rebuilt"))
    fs.put(corpus, f"{BUCKET}/corpora/c.jsonl")
    build_index(f"gs://{BUCKET}/corpora/c.jsonl", remote, tiny_encoder, searcher="exact", progress=False)
    assert not any(o.startswith("scann/") for o in _objects(fs, "rebuilt"))  # the old ScaNN files are gone
    idx = Index.load(remote, corpus_path=corpus)  # same bytes as the local corpus: the checksum matches
    assert idx.manifest["searcher"] == "exact"
    assert idx.manifest["corpus"]["path"] == f"gs://{BUCKET}/corpora/c.jsonl"
    with pytest.raises(IndexLoadError, match="not an index directory"):
        Index.load(f"gs://{BUCKET}/no-index-here")


def test_merge_index_cli_gcs_parts_to_gcs_matches_the_local_index(gcs, corpus, tiny_encoder, tmp_path):
    url, fs = gcs
    lines = open(corpus).readlines()
    parts = []
    for i, chunk in enumerate((lines[:N // 2], lines[N // 2:])):
        key = f"corpora/part{i}.jsonl"
        fs.pipe_file(f"{BUCKET}/{key}", "".join(chunk).encode())
        parts.append(build_index(f"gs://{BUCKET}/{key}", f"gs://{BUCKET}/parts/p{i}", tiny_encoder,
                                 searcher="exact", progress=False))
    shutil.rmtree(tmp_path / "cache")  # parts are read from the bucket
    out = f"gs://{BUCKET}/merged"
    assert merge_index_main(["--parts", *parts, "--index_dir", out, "--quiet"]) == 0
    merged = Index.load(out, encoder=tiny_encoder, corpus_path=corpus)  # checksum of the concatenated parts
    assert merged.manifest["count"] == N and [p["index_dir"] for p in merged.manifest["corpus"]["parts"]] == parts
    local = Index.load(build_index(corpus, str(tmp_path / "whole"), tiny_encoder, searcher="exact", progress=False),
                       encoder=tiny_encoder)
    want_ids, want_scores = _hits(local, tiny_encoder)
    got_ids, got_scores = _hits(merged, tiny_encoder)
    assert got_ids == want_ids
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-5, atol=1e-5)


def _cli(env, tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "rexrag_jax.cli", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("index_dir, emulator_up, message", [
    (f"gs://no-such-bucket-{os.getpid()}/idx", True, "does not exist or is not accessible"),
    ("gs://Bad_Bucket!/idx", True, "malformed gs:// URL"),
    (f"gs://{BUCKET}/idx", False, "storage not reachable"),
])
def test_bad_gcs_index_dir_is_one_line_exit_2(gcs, corpus, tmp_path, index_dir, emulator_up, message):
    url, fs = gcs
    env = subprocess_env(url if emulator_up else "http://127.0.0.1:9", REXRAG_REMOTE_CHECK_TIMEOUT_S="2",
                         PYTHONPATH=str(REPO), REXRAG_REMOTE_CACHE=str(tmp_path / "cache"))
    for prog, args in (("build-index", ["--corpus", corpus, "--index_dir", index_dir, "--quiet",
                                        "--gin_file", str(REPO / "gin/retriever/minilm_exact.gin")]),
                       ("merge-index", ["--parts", f"gs://{BUCKET}/parts/p0", "--index_dir", index_dir, "--quiet"])):
        p = _cli(env, tmp_path, prog, *args)
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
        err = p.stderr.strip()
        assert err.count("\n") == 0 and err.startswith(f"rexrag {prog}: ") and index_dir in err and message in err, err
    assert [c.name for c in tmp_path.iterdir()] in ([], ["cache"])  # nothing else local
    if emulator_up:
        fs.invalidate_cache()
        assert not fs.exists(f"no-such-bucket-{os.getpid()}")  # and no bucket was created


def test_build_index_and_serve_retriever_clis_on_gcs(gcs, corpus, tiny_hf_dir, tmp_path):
    """`rexrag build-index --index_dir gs://...` in one process, `rexrag serve-retriever --index_dir gs://...`
    in another (fresh cache: it downloads), answers equal to the same index built locally."""
    url, fs = gcs
    flags = ["--gin_file", str(REPO / "gin/retriever/minilm_exact.gin"),
             "--gin_bindings", 'retrieval.encoder.kind = "bert"',
             "--gin_bindings", f'retrieval.encoder.model_dir = "{tiny_hf_dir}"',
             "--gin_bindings", 'retrieval.encoder.name = "tiny"', "--gin_bindings", "retrieval.encoder.max_length = 64",
             "--corpus", corpus, "--quiet"]
    remote = f"gs://{BUCKET}/cli-index"
    env = subprocess_env(url, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS="",
                         REXRAG_REMOTE_CACHE=str(tmp_path / "build-cache"))
    p = _cli(env, tmp_path, "build-index", *flags, "--index_dir", remote)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"index written to {remote}: {N} passages" in p.stdout
    assert "config.gin" in _objects(fs, "cli-index")

    import gin
    gin.clear_config()
    assert build_index_main([*flags, "--index_dir", str(tmp_path / "local")]) == 0
    gin.clear_config()
    gin.parse_config_file(str(tmp_path / "local" / "config.gin"))
    enc = make_encoder()
    gin.clear_config()
    local = LocalRetriever(Index.load(str(tmp_path / "local"), encoder=enc), enc)

    env["REXRAG_REMOTE_CACHE"] = str(tmp_path / "serve-cache")
    proc = subprocess.Popen([sys.executable, "-m", "rexrag_jax.cli", "serve-retriever", "--index_dir", remote,
                             "--port", "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        server, lines = None, []
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving POST (http://127\.0\.0\.1:\d+)/retrieve", line):
                server = m.group(1)
                break
        assert server, "".join(lines)
        got = HttpRetriever(server).search(QUERIES, 3)
        want = local.search(QUERIES, 3)
        assert [[h["document"] for h in r] for r in got] == [[h["document"] for h in r] for r in want]
        assert [h["score"] for r in got for h in r] == pytest.approx([h["score"] for r in want for h in r], abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert os.path.isfile(tmp_path / "serve-cache" / "gs" / BUCKET / "cli-index" / "embeddings.f32")
