"""rexrag_jax.io.run_dir: fresh / resume / refuse finished / refuse incompatible / overwrite replaces whole."""
import json
import os

import pytest

from rexrag_jax.io import run_dir as R

CFG = {"TrainConfig.total_steps": "6", "TrainConfig.seed": "0"}


def _quiet(**kw):
    return dict(log=None, **kw)


def test_fresh_run_dir_gets_a_manifest(tmp_path):
    d = tmp_path / "run"
    run = R.prepare(str(d), "train", CFG, **_quiet())
    assert not run.resumed and run.created
    m = json.loads((d / "run.json").read_text())
    assert m["command"] == "train" and m["finished"] is False and m["config"] == CFG
    assert m["fingerprint"] == R.fingerprint(CFG) and len(m["fingerprint"]) == 64
    # an existing empty dir is a fresh run too (pytest's tmp_path, a pre-made bucket prefix)
    empty = tmp_path / "empty"
    empty.mkdir()
    run2 = R.prepare(str(empty), "train", CFG, **_quiet())
    assert not run2.resumed and not run2.created and (empty / "run.json").exists()


def test_compatible_unfinished_run_resumes(tmp_path):
    R.prepare(str(tmp_path), "train", CFG, **_quiet())
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    msgs = []
    run = R.prepare(str(tmp_path), "train", dict(CFG), log=msgs.append)
    assert run.resumed and run.manifest["attempts"] == 2
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing removed
    assert msgs == [f"rexrag train: resuming the unfinished run in {tmp_path}"]


def test_finished_run_is_refused_naming_overwrite(tmp_path):
    R.prepare(str(tmp_path), "train", CFG, **_quiet()).mark_finished(step=6)
    with pytest.raises(R.RunDirError) as e:
        R.prepare(str(tmp_path), "train", CFG, **_quiet())
    msg = str(e.value)
    assert "\n" not in msg and "finished" in msg and "--overwrite" in msg and "run.json" in msg
    assert json.loads((tmp_path / "run.json").read_text())["finished_info"] == {"step": 6}


def test_incompatible_unfinished_run_is_refused_naming_the_field(tmp_path):
    R.prepare(str(tmp_path), "train", CFG, **_quiet())
    other = dict(CFG, **{"TrainConfig.seed": "1"})
    with pytest.raises(R.RunDirError) as e:
        R.prepare(str(tmp_path), "train", other, **_quiet())
    msg = str(e.value)
    assert "\n" not in msg and "TrainConfig.seed: 0 -> 1" in msg and "--overwrite" in msg
    with pytest.raises(R.RunDirError, match="a `rexrag train` run, not `rexrag demo`.*--overwrite"):
        R.prepare(str(tmp_path), "demo", CFG, **_quiet())


def test_overwrite_replaces_the_run_dir_whole(tmp_path):
    d = tmp_path / "run"
    R.prepare(str(d), "train", CFG, **_quiet()).mark_finished(step=6)
    for rel in ("checkpoints/6/state/x", "tensorboard/events.out.tfevents.1.host", "metrics.jsonl"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("old run")
    inode = os.stat(d).st_ino
    other = dict(CFG, **{"TrainConfig.seed": "1"})
    run = R.prepare(str(d), "train", other, overwrite=True, **_quiet())
    assert not run.resumed
    assert sorted(os.listdir(d)) == ["run.json"]  # no checkpoint, event file or metrics line of the old run
    assert os.stat(d).st_ino != inode  # a new directory took the name (the old one was renamed aside)
    assert [n for n in os.listdir(tmp_path) if n != "run"] == []  # and the old one is gone
    m = json.loads((d / "run.json").read_text())
    assert m["config"] == other and m["finished"] is False
    # --overwrite on an unfinished compatible run also starts over
    (d / "metrics.jsonl").write_text("x")
    R.prepare(str(d), "train", other, overwrite=True, **_quiet())
    assert sorted(os.listdir(d)) == ["run.json"]


def test_replace_cleans_leftovers_of_a_crashed_replace(tmp_path):
    d = tmp_path / "run"
    R.prepare(str(d), "train", CFG, **_quiet())
    stale = tmp_path / "run.replaced-1-2"
    (stale / "checkpoints").mkdir(parents=True)
    R.prepare(str(d), "train", CFG, overwrite=True, **_quiet())
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_foreign_directory_is_refused_even_with_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(R.RunDirError, match="not empty and not a `rexrag train` run dir"):
            R.prepare(str(tmp_path), "train", CFG, overwrite=overwrite, legacy_files=("config.gin",), **_quiet())
    assert (tmp_path / "notes.txt").read_text() == "mine"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(R.RunDirError, match="not a directory"):
        R.prepare(str(f), "train", CFG, **_quiet())


def test_run_dir_of_an_earlier_version_resumes_only_with_the_same_config(tmp_path):
    (tmp_path / "config.gin").write_text("seed")
    legacy = dict(legacy_files=("config.gin",), legacy_config=lambda p: CFG)
    assert R.prepare(str(tmp_path), "train", CFG, **_quiet(**legacy)).resumed
    assert json.loads((tmp_path / "run.json").read_text())["config"] == CFG  # adopted
    d = tmp_path / "b"
    d.mkdir()
    (d / "config.gin").write_text("seed")
    with pytest.raises(R.RunDirError, match="holds an earlier run.*another configuration.*--overwrite"):
        R.prepare(str(d), "train", dict(CFG, x="1"), **_quiet(**legacy))
    assert not (d / "run.json").exists()


def test_restart_mode_replaces_a_compatible_unfinished_run(tmp_path):
    R.prepare(str(tmp_path), "demo", CFG, **_quiet())
    (tmp_path / "metrics.jsonl").write_text("half")
    run = R.prepare(str(tmp_path), "demo", CFG, on_unfinished="restart", **_quiet())
    assert not run.resumed and sorted(os.listdir(tmp_path)) == ["run.json"]


def test_abandon_undoes_a_fresh_start(tmp_path):
    d = tmp_path / "new"
    run = R.prepare(str(d), "train", CFG, **_quiet())
    (d / "tensorboard").mkdir()
    run.abandon()
    assert not d.exists()
    run = R.prepare(str(tmp_path), "train", CFG, **_quiet())  # existed (empty): emptied, kept
    (tmp_path / "config.gin").write_text("x")
    run.abandon()
    assert tmp_path.is_dir() and os.listdir(tmp_path) == []


def test_corrupt_manifest_is_one_line(tmp_path):
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(R.RunDirError) as e:
        R.prepare(str(tmp_path), "train", CFG, **_quiet())
    assert "\n" not in str(e.value) and "--overwrite" in str(e.value)
    R.prepare(str(tmp_path), "train", CFG, overwrite=True, **_quiet())
    assert json.loads((tmp_path / "run.json").read_text())["config"] == CFG


def test_gin_bindings_parse_gin_layout_and_drop_exempt_keys():
    text = ("# Macros:\n# ====\nTOTAL_STEPS = 6\n\nimport rexrag_jax.train\n# Parameters for TrainConfig:\n"
            "TrainConfig.debug_sleep_s = 1.0\nTrainConfig.inject_nonfinite_steps = \\\n    (1,\n     2)\n"
            "TrainConfig.seed = 0\n")
    assert R.gin_bindings(text) == {"TOTAL_STEPS": "6", "TrainConfig.inject_nonfinite_steps": "(1, 2)",
                                    "TrainConfig.seed": "0"}
    assert "TrainConfig.debug_sleep_s" in R.gin_bindings(text, exempt=())


def tb_texts(tb_dir) -> dict:
    """{tag: [(step, text)]} of the text summaries in every event file under tb_dir (TFRecord framing:
    u64 length, u32 crc, payload, u32 crc)."""
    import glob
    import struct

    from tensorboardX.proto import event_pb2
    out = {}
    for path in sorted(glob.glob(os.path.join(str(tb_dir), "events.out.tfevents.*"))):
        data, i = open(path, "rb").read(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                if v.HasField("tensor") and v.tensor.string_val:
                    out.setdefault(v.tag, []).append((ev.step, v.tensor.string_val[0].decode()))
    return out


def test_save_configs_writes_files_and_tensorboard_text(tmp_path):
    from rexrag_jax.train.metrics_log import MetricsLogger

    run = R.prepare(str(tmp_path), "demo", CFG, **_quiet())
    logger = MetricsLogger(str(tmp_path), use_tensorboard=True, stream=open(os.devnull, "w"))
    run.save_configs("A = 1\n", "DemoConfig.rl_steps = 3\n", logger)
    logger.close()
    assert (tmp_path / "config.gin").read_text() == "A = 1\n"
    assert (tmp_path / "operative_config.gin").read_text() == "DemoConfig.rl_steps = 3\n"
    texts = tb_texts(tmp_path / "tensorboard")
    (tag,) = [t for t in texts if t.startswith("gin/operative_config")]
    assert "DemoConfig.rl_steps = 3" in texts[tag][0][1]


def test_save_gin_writes_the_gin_state_and_tensorboard_text(tmp_path):
    """The demo's path: gin parsed, a configurable built, then one call saves both configs + TB text."""
    import dataclasses

    import gin

    @gin.configurable
    @dataclasses.dataclass(frozen=True)
    class RunDirTestConfig:
        steps: int = 1
        lr: float = 0.1

    gin.parse_config("RunDirTestConfig.steps = 7")
    cfg = RunDirTestConfig()
    run = R.prepare(str(tmp_path), "demo", {"seed": 0, **dataclasses.asdict(cfg)}, on_unfinished="restart",
                    **_quiet())
    run.save_gin()
    assert "RunDirTestConfig.steps = 7" in (tmp_path / "config.gin").read_text()
    operative = (tmp_path / "operative_config.gin").read_text()
    assert "RunDirTestConfig.steps = 7" in operative and "RunDirTestConfig.lr = 0.1" in operative
    texts = tb_texts(tmp_path / "tensorboard")
    (tag,) = [t for t in texts if t.startswith("gin/operative_config")]
    assert "RunDirTestConfig.lr = 0.1" in texts[tag][0][1]


def test_save_gin_records_values_changed_after_gin(tmp_path):
    """The demo's --quick replaces DemoConfig fields after gin built it: operative_config.gin must still parse
    back to the configuration the run used."""
    import dataclasses

    import gin

    @gin.configurable
    @dataclasses.dataclass(frozen=True)
    class RunDirQuickConfig:
        steps: int = 1
        name: str = "full"

    gin.parse_config("RunDirQuickConfig.steps = 7")
    cfg = dataclasses.replace(RunDirQuickConfig(), name="quick")
    run = R.prepare(str(tmp_path), "demo", dataclasses.asdict(cfg), **_quiet())
    run.save_gin(resolved=(cfg,), tensorboard=False)
    text = (tmp_path / "operative_config.gin").read_text()
    assert "RunDirQuickConfig.name = 'quick'" in text and "RunDirQuickConfig.steps = 7" in text
    gin.clear_config()
    gin.parse_config(text)
    assert RunDirQuickConfig() == cfg
