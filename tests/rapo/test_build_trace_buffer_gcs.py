"""The static trace buffer on gs:// (GCS emulator on 127.0.0.1, tests/gcs_emulator.py): an interrupted build
resumes from the bucket's finished shards, the result equals a local build, and it loads back checked."""
import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gcs_emulator import emulator, skip_without_emulator  # noqa: E402

skip_without_emulator()

from rexrag_jax.data.schema import QAExample  # noqa: E402
from rexrag_jax.rapo.static_buffer import (TraceBufferError, build_trace_buffer, load_static_buffer,  # noqa: E402
                                           questions_fingerprint)
from test_build_trace_buffer import BOW, answers  # noqa: E402

BUCKET = "rexrag-trace-buffer-test"


def test_build_resume_and_load_on_gcs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ex = [QAExample(str(i), f"question {i}", ["A"], "nq") for i in range(5)]
    base = answers("B", "A", "A")
    ref = build_trace_buffer(str(tmp_path / "local"), ex, base, BOW, n=3, k=2, shard_size=2, progress=False)
    with emulator(tmp_path, BUCKET) as (url, fs):
        out = f"gs://{BUCKET}/buffers/b0"

        def dies(examples, n, seed, start):
            if start == 4:
                raise KeyboardInterrupt
            return base(examples, n, seed, start)
        with pytest.raises(KeyboardInterrupt):
            build_trace_buffer(out, ex, dies, BOW, n=3, k=2, shard_size=2, progress=False)
        fs.invalidate_cache()
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/buffers/b0/shards")) == [
            "shard-00000.jsonl", "shard-00000.npy", "shard-00001.jsonl", "shard-00001.npy"]
        with pytest.raises(TraceBufferError, match="interrupted"):
            load_static_buffer(out, BOW)
        calls = []
        got = build_trace_buffer(out, ex, lambda *a: (calls.append(a[3]), base(*a))[1], BOW, n=3, k=2,
                                 shard_size=2, progress=False)
        assert calls == [4]
        fs.invalidate_cache()
        assert fs.cat_file(f"{BUCKET}/buffers/b0/steps.jsonl").decode() == (tmp_path / "local" / "steps.jsonl").read_text()
        assert got["count"] == ref["count"] == 20 and not fs.exists(f"{BUCKET}/buffers/b0/shards")
        buf, m = load_static_buffer(out, BOW, world_id=questions_fingerprint(ex))
        assert buf.keys == [json.loads(r)["key"] for r in (tmp_path / "local" / "steps.jsonl").read_text().splitlines()]
        assert np.array_equal(buf.emb, np.load(tmp_path / "local" / "embeddings.npy"))
        with pytest.raises(TraceBufferError, match="pass --overwrite"):
            build_trace_buffer(out, ex, base, BOW, n=3, k=2, shard_size=2, progress=False)
    assert not (tmp_path / "gs:").exists()
