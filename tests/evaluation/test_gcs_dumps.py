"""Trajectory dumps and the RAPO trace buffer on gs://, against a GCS emulator on 127.0.0.1 started here
(tests/gcs_emulator.py): `rexrag eval --rescore gs://... --out gs://... --summary-json gs://...`, a bad
output bucket is one line and exit 2, TraceBuffer.save/load round trips through the bucket, and
RapoTrainer keeps its per-step buffers under a gs:// run dir and restores them on resume."""
import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gcs_emulator import emulator, skip_without_emulator  # noqa: E402

skip_without_emulator()

from rexrag_jax.evaluation import main as eval_main  # noqa: E402
from rexrag_jax.evaluation import read_trajectory_dump  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BUCKET = "rexrag-dump-test"
ROWS = [{"question": "capital of france?", "golden_answers": ["Paris"], "response": "<answer> Paris </answer>"},
        {"query": "who wrote hamlet", "answers": ["Shakespeare"], "output": "<answer> Marlowe </answer>"},
        {"question": "2+2", "answer": "4", "response": "<answer>4</answer>", "data_source": "bamboogle"}]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with emulator(tmp_path_factory.mktemp("fake-gcs"), BUCKET) as (url, fs):
        yield url, fs


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield
    for d in (tmp_path, REPO):
        assert not (d / "gs:").exists(), f"a local 'gs:' folder was written in {d}"


def _jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_rescore_reads_and_writes_gcs_like_local(gcs, tmp_path, capsys):
    url, fs = gcs
    (tmp_path / "nq_dump.jsonl").write_text(_jsonl(ROWS))
    fs.pipe_file(f"{BUCKET}/dumps/nq_dump.jsonl", _jsonl(ROWS).encode())
    assert eval_main.main(["--rescore", str(tmp_path / "nq_dump.jsonl"), "--out", str(tmp_path / "scored.jsonl"),
                           "--summary-json", str(tmp_path / "summary.json")]) == 0
    local_out = capsys.readouterr().out
    out, summary = f"gs://{BUCKET}/eval/scored.jsonl", f"gs://{BUCKET}/eval/summary.json"
    assert eval_main.main(["--rescore", f"gs://{BUCKET}/dumps/nq_dump.jsonl", "--out", out,
                           "--summary-json", summary]) == 0
    remote_out = capsys.readouterr().out
    assert remote_out.replace(out, "OUT") == local_out.replace(str(tmp_path / "scored.jsonl"), "OUT")
    fs.invalidate_cache()
    got = [json.loads(line) for line in fs.cat_file(f"{BUCKET}/eval/scored.jsonl").decode().splitlines()]
    want = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert got == want and [r["em"] for r in got] == [1.0, 0.0, 1.0]
    assert json.loads(fs.cat_file(f"{BUCKET}/eval/summary.json")) == json.loads((tmp_path / "summary.json").read_text())
    assert read_trajectory_dump(out) == read_trajectory_dump(str(tmp_path / "scored.jsonl"))  # dumps read back
    assert [r["data_source"] for r in read_trajectory_dump(f"gs://{BUCKET}/dumps/nq_dump.jsonl")] == \
        ["nq", "nq", "bamboogle"]  # the source comes from the URL's file name, as locally


@pytest.mark.parametrize("flag", ["--out", "--summary-json"])
@pytest.mark.parametrize("bad, message", [
    (f"gs://no-such-bucket-{os.getpid()}/x.jsonl", "does not exist or is not accessible"),
    ("gs://Bad_Bucket!/x.jsonl", "malformed gs:// URL"),
])
def test_eval_bad_gcs_output_is_one_line_exit_2(gcs, tmp_path, capsys, flag, bad, message):
    url, fs = gcs
    (tmp_path / "d.jsonl").write_text(_jsonl(ROWS))
    capsys.readouterr()
    assert eval_main.main(["--rescore", str(tmp_path / "d.jsonl"), flag, bad]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert err.count("\n") == 0 and err.startswith("rexrag eval: ") and bad in err and message in err, err
    assert cap.out == ""  # nothing was scored or printed before the check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_trace_buffer_save_load_on_gcs(gcs):
    sys.path.insert(0, str(REPO / "tests" / "rapo"))
    from rapo_fakes import bow_encode
    from rexrag_jax.rapo.trace_buffer import TraceBuffer

    url, fs = gcs
    buf = TraceBuffer(bow_encode, capacity=8, searcher="exact")
    buf.keys, buf.values = ["who is the king of france", "river in egypt"], ["<search> king </search>", "Nile"]
    buf.emb = bow_encode(buf.keys)
    path = f"gs://{BUCKET}/buffers/7"
    buf.save(path)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/buffers/7")) == ["embeddings.npy", "entries.json"]
    again = TraceBuffer.load(path, bow_encode)
    assert again.keys == buf.keys and again.values == buf.values and (again.emb == buf.emb).all()
    assert again.query(["the king of france"], 1)[0][0]["value"] == "<search> king </search>"


def test_rapo_trainer_buffers_under_a_gcs_run_dir_and_resume(gcs):
    sys.path.insert(0, str(REPO / "tests" / "rapo"))
    from test_rapo_trainer import make

    url, fs = gcs
    run = f"gs://{BUCKET}/rapo-run"
    trainer = make(run, steps=3)
    assert trainer.run() == 0
    fs.invalidate_cache()
    # keep_checkpoints = 2: the buffer of step 1 was removed with its checkpoint
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/rapo-run/trace_buffer")) == ["2", "3"]
    assert fs.exists(f"{BUCKET}/rapo-run/trace_buffer/3/entries.json")
    buf = trainer.rollout.buffer
    assert len(buf) > 0

    resumed = make(run, steps=4)
    assert len(resumed.rollout.buffer) == 0
    assert resumed.maybe_restore() and resumed.step == 3
    assert resumed.rollout.buffer.keys == buf.keys and resumed.rollout.buffer.values == buf.values


def test_eval_loads_the_policy_of_a_gcs_run_dir(gcs, tmp_path):
    """`rexrag eval --checkpoint gs://.../run`: model from the bucket's operative_config.gin, params from
    its orbax checkpoint, the same as from the local copy of the run."""
    import gin
    import jax
    import numpy as np

    from rexrag_jax.evaluation.policy import load_policy
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.tokenizers import train_sentencepiece
    from rexrag_jax.train.checkpoint import Checkpointer
    from rexrag_jax.train.optim import OptimizerConfig

    url, fs = gcs
    spm = train_sentencepiece([f"question {i} about the river and the king of france" for i in range(200)],
                              tmp_path / "tok" / "spm", vocab_size=300)
    params = qwen2.init_params(Qwen2Config.from_preset("tiny"), jax.random.PRNGKey(2))
    gin_text = f'TOKENIZER = "{spm}"\nmodel_config.preset = "tiny"\nSearchRollout.tokenizer_path = %TOKENIZER\n'
    got = {}
    for run in (str(tmp_path / "run"), f"gs://{BUCKET}/eval-run"):
        ckpt = Checkpointer(run + "/checkpoints")
        ckpt.save(3, {"params": params, "opt_state": OptimizerConfig().make().init(params)}, {"step": 3})
        ckpt.close()
        if run.startswith("gs://"):
            fs.pipe_file(f"{BUCKET}/eval-run/operative_config.gin", gin_text.encode())
        else:
            pathlib.Path(run, "operative_config.gin").write_text(gin_text)
        gin.clear_config()
        try:
            got[run] = load_policy(run, progress=False)
        finally:
            gin.clear_config()
    (lcfg, lparams, ltok), (rcfg, rparams, rtok) = got.values()
    assert rcfg == lcfg and rtok.vocab_size == ltok.vocab_size
    jax.tree_util.tree_map(np.testing.assert_array_equal, rparams, lparams)
    with pytest.raises(FileNotFoundError, match="no checkpoints/<step>/"):
        load_policy(f"gs://{BUCKET}/no-run-here", progress=False)


def test_eval_bad_gcs_checkpoint_is_one_line_exit_2(gcs, shared_data, capsys):
    bad = f"gs://no-such-bucket-{os.getpid()}/run"
    rc = eval_main.main(["--data", str(shared_data / "benchmarks" / "bamboogle_test.jsonl"), "--limit", "1",
                         "--checkpoint", bad, "--retriever-url", "http://127.0.0.1:9", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and bad in err and "does not exist or is not accessible" in err, err


def test_qa_files_read_from_gcs_like_local(gcs, shared_data, tmp_path):
    """Benchmark / training QA files (rexrag eval --data, TRAIN_FILES) in a gs:// dir read like a local copy."""
    from rexrag_jax.data.readers import read_qa_files

    url, fs = gcs
    local = tmp_path / "qa"
    local.mkdir()
    rows = (shared_data / "benchmarks" / "bamboogle_test.jsonl").read_text().splitlines()[:5]
    (local / "bamboogle_test.jsonl").write_text("\n".join(rows) + "\n")
    (local / "nq_dev.csv").write_text('question,golden_answers\n"who, then?","[""A"", ""B""]"\nwhere,C\n')
    (local / "popqa.json").write_text(json.dumps([{"question": "q1", "answer": "x"}]))
    for f in local.iterdir():
        fs.put(str(f), f"{BUCKET}/qa/{f.name}")
    got = read_qa_files([f"gs://{BUCKET}/qa"])
    want = read_qa_files([str(local)])
    assert [(e.id, e.question, e.golden_answers, e.data_source) for e in got] == \
        [(e.id, e.question, e.golden_answers, e.data_source) for e in want] and len(got) == 8
