"""`rexrag train` on an existing run dir (gin/tiny.gin, 2 steps): a finished run is refused, an unfinished
compatible one resumes, an unfinished one with other bindings is refused, --overwrite replaces it whole."""
import json
import os

import pytest

from rexrag_jax.train.main import main
from rexrag_jax.train.metrics_log import read_metrics

TWO_STEPS = ["--gin_bindings", "TOTAL_STEPS = 2", "--gin_bindings", "TrainConfig.checkpoint_every = 1"]


def _train(run_dir, *extra):
    return main(["--gin_file", "tiny.gin", "--run_dir", str(run_dir), *TWO_STEPS, *extra])


def _ckpts(run_dir):
    return sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())


def _events(run_dir):
    return sorted(n for n in os.listdir(run_dir / "tensorboard") if n.startswith("events.out.tfevents"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = tmp_path_factory.mktemp("finished") / "run"
    assert _train(d) == 0
    return d


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_fresh_run_is_recorded_finished_with_its_configs(finished):
    m = json.loads((finished / "run.json").read_text())
    assert m["command"] == "train" and m["finished"] is True and m["finished_info"] == {"step": 2}
    assert m["config"]["TOTAL_STEPS"] == "2" and "TrainConfig.debug_sleep_s" not in m["config"]
    assert "TOTAL_STEPS = 2" in (finished / "config.gin").read_text()
    assert "TOTAL_STEPS = 2" in (finished / "operative_config.gin").read_text()
    assert sorted(read_metrics(finished)) == [1, 2] and _ckpts(finished) == [1, 2]
    # the Trainer's policy record (what `rexrag eval --checkpoint RUN_DIR` reads besides the params)
    import dataclasses
    from rexrag_jax.models.qwen2.config import Qwen2Config
    rec = json.loads((finished / "policy.json").read_text())
    assert rec["model_config"] == dataclasses.asdict(Qwen2Config.from_preset("tiny", dtype="float32"))


def test_finished_run_is_refused_and_left_untouched(finished, tmp_path, capsys):
    d = _copy(finished, tmp_path / "run")
    before = {p: os.path.getmtime(os.path.join(r, p)) for r, _, fs in os.walk(d) for p in fs}
    assert _train(d) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "finished already" in err and "--overwrite" in err and str(d) in err
    after = {p: os.path.getmtime(os.path.join(r, p)) for r, _, fs in os.walk(d) for p in fs}
    assert after == before


def test_unfinished_compatible_run_resumes_and_finishes(finished, tmp_path, capsys):
    """A run stopped after its last checkpoint but before run.json said so (a kill in between)."""
    d = _copy(finished, tmp_path / "run")
    m = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps(dict(m, finished=False)))
    assert _train(d, "--gin_bindings", "TrainConfig.debug_sleep_s = 0.5") == 0  # a test hook: not a config change
    out = capsys.readouterr().out
    assert "resuming the unfinished run" in out and "resumed from checkpoint 2" in out
    m2 = json.loads((d / "run.json").read_text())
    assert m2["finished"] is True and m2["attempts"] == 2 and m2["fingerprint"] == m["fingerprint"]
    assert read_metrics(d) == read_metrics(finished)  # no step was redone


def test_unfinished_run_with_other_bindings_is_refused(finished, tmp_path, capsys):
    d = _copy(finished, tmp_path / "run")
    m = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps(dict(m, finished=False)))
    assert _train(d, "--gin_bindings", "TrainConfig.seed = 7") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "another configuration" in err and "TrainConfig.seed: 0 -> 7" in err
    assert "--overwrite" in err
    assert _ckpts(d) == [1, 2] and json.loads((d / "run.json").read_text())["finished"] is False


def test_overwrite_replaces_the_run_whole(finished, tmp_path, capsys):
    d = _copy(finished, tmp_path / "run")
    (d / "checkpoints" / "99").mkdir()  # a stray step of the old run: must not survive
    old_events = _events(d)
    assert _train(d, "--overwrite", "--gin_bindings", "TrainConfig.seed = 7") == 0
    assert "--overwrite: replacing the finished `rexrag train` run" in capsys.readouterr().out
    assert _ckpts(d) == [1, 2]
    assert len(_events(d)) == 1 and not set(_events(d)) & set(old_events)  # only the new run's event file
    new, old = read_metrics(d), read_metrics(finished)
    assert sorted(new) == [1, 2] and new[1]["loss"] != old[1]["loss"]  # one line per step, the seed-7 run's
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 2
    m = json.loads((d / "run.json").read_text())
    assert m["finished"] is True and m["config"]["TrainConfig.seed"] == "7" and m["attempts"] == 1
    assert [n for n in os.listdir(tmp_path) if n != "run"] == []  # the old dir, renamed aside, is deleted


def test_bad_start_leaves_no_run_dir(tmp_path, capsys):
    """A StartupInputError while the trainer is built: exit 2, and the fresh run dir is gone again (the
    corrected command then starts clean instead of meeting an 'incompatible' half run)."""
    import pathlib

    tiny = pathlib.Path(__file__).resolve().parents[2] / "gin" / "tiny.gin"
    tiny_bindings = [line for line in tiny.read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith(("#", "include"))]
    d = tmp_path / "run"
    rc = main(["--gin_file", "rapo.gin", "--run_dir", str(d)] + [a for b in tiny_bindings for a in ("--gin_bindings", b)]
              + ["--gin_bindings", "Trainer.rollout = @SyntheticHybridRollout()",
                 "--gin_bindings", f"TRACE_BUFFER_DIR = '{tmp_path / 'missing_buffer'}'"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "missing_buffer" in err, err
    assert not d.exists()


@pytest.mark.parametrize("extra, expect", [
    (["--gin_file", "nope.gin"], "bad gin config: Unable to open file: nope.gin"),
    (["--gin_bindings", "TrainConfg.seed = 1"], "bad gin config: No configurable matching 'TrainConfg'. "
                                                "(In bindings string line 1)"),
    (["--gin_bindings", "TrainConfig.sed = 1"], "doesn't have a parameter named 'sed'"),
    (["--gin_bindings", "TrainConfig.total_steps = 'three'"], "bad configuration: TrainConfig.total_steps='three': expected a positive integer"),
])
def test_config_errors_are_one_line_exit_2_and_leave_no_run_dir(tmp_path, capsys, extra, expect):
    d = tmp_path / "run"
    rc = main(["--gin_file", "tiny.gin", "--run_dir", str(d), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and expect in err, err
    assert not d.exists()


def test_gin_binding_flag_aliases(tmp_path):
    from rexrag_jax.train.main import _parser

    for flag in ("--gin_bindings", "--gin-bindings", "--gin_param", "--gin-param"):
        assert _parser().parse_args(["--gin_file", "x", "--run_dir", "r", flag, "A = 1"]).gin_bindings == ["A = 1"]
