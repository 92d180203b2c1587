"""build-index / serve-retriever CLIs with gin configs, end to end on a tiny HF BERT directory."""
import os
import re
import subprocess
import sys

import gin
import pytest

from rexrag_jax.retrieval.cli import build_index_main, make_encoder
from rexrag_jax.retrieval.index import Index
from rexrag_jax.retrieval.retriever import HttpRetriever, LocalRetriever

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def built(tiny_hf_dir, shared_data, tmp_path_factory):
    corpus = tmp_path_factory.mktemp("c") / "c.jsonl"
    corpus.write_text("".join(open(shared_data / "corpus" / "wiki18_sample_1000.jsonl").readlines()[:64]))
    index_dir = str(tmp_path_factory.mktemp("i") / "idx")
    gin.clear_config()
    rc = build_index_main(["--gin_file", os.path.join(REPO, "gin/retriever/minilm_exact.gin"),
                           "--gin_bindings", 'retrieval.encoder.kind = "bert"',
                           "--gin_bindings", f'retrieval.encoder.model_dir = "{tiny_hf_dir}"',
                           "--gin_bindings", 'retrieval.encoder.name = "tiny"',
                           "--gin_bindings", "retrieval.encoder.max_length = 64",
                           "--corpus", str(corpus), "--index_dir", index_dir, "--quiet"])
    assert rc == 0
    gin.clear_config()
    return str(corpus), index_dir


def test_build_index_cli_writes_index_and_resolved_config(built, tiny_hf_dir):
    corpus, index_dir = built
    m = Index.load(index_dir, corpus_path=corpus).manifest
    assert m["count"] == 64 and m["dim"] == 32 and m["searcher"] == "exact" and m["encoder"]["name"] == "tiny"
    cfg = open(os.path.join(index_dir, "config.gin")).read()
    assert re.search(r"(retrieval\.)?encoder\.kind = 'bert'", cfg) and tiny_hf_dir in cfg
    assert re.search(r"(retrieval\.)?build\.corpus_path = '.*c\.jsonl'", cfg)


def test_serve_cli_answers_like_the_local_retriever(built):
    corpus, index_dir = built
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from rexrag_jax.retrieval.cli import serve_main; "
                             "sys.exit(serve_main(sys.argv[1:]))", "--index_dir", index_dir, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, lines = None, []
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving POST (http://127\.0\.0\.1:\d+)/retrieve", line):
                url = m.group(1)
                break
        assert url, "".join(lines)
        gin.clear_config()
        gin.parse_config_file(os.path.join(index_dir, "config.gin"))
        enc = make_encoder()
        gin.clear_config()
        local = LocalRetriever(Index.load(index_dir, encoder=enc), enc)
        queries = ["Evan Morris lobbyist", "a river in europe"]
        remote = HttpRetriever(url).search(queries, 3)
        want = local.search(queries, 3)
        assert [[h["document"] for h in r] for r in remote] == [[h["document"] for h in r] for r in want]
        assert [h["score"] for r in remote for h in r] == pytest.approx([h["score"] for r in want for h in r], abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
