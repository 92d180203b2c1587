"""Crash/resume, SIGTERM and non-finite-loss behaviour of `rexrag train` on gin/tiny.gin (synthetic rollouts).

The tiny run is deterministic from (seed, step): a run killed with SIGKILL after a checkpoint and
restarted must produce exactly the metrics of an uninterrupted run for every later step.
"""
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rexrag_jax.train.metrics_log import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPARE = ("loss", "grad_norm", "reward/mean", "em/train", "all/ratio_mean", "all/clip_frac", "probe/ratio_mean",
           "keep_ratio", "probes/kept", "entropy", "kl", "lr")


def _env():
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(jax.config.jax_compilation_cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cmd(run_dir, *bindings):
    cmd = [sys.executable, "-m", "rexrag_jax.cli", "train", "--gin_file", "tiny.gin", "--run_dir", str(run_dir)]
    for b in bindings:
        cmd += ["--gin_bindings", b]
    return cmd


def _run(run_dir, *bindings, timeout=600):
    p = subprocess.run(_cmd(run_dir, *bindings), env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _steps(run_dir):
    d = pathlib.Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _start_and_wait(run_dir, wait_step, *bindings, timeout=600):
    proc = subprocess.Popen(_cmd(run_dir, *bindings), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while wait_step not in _steps(run_dir):
        if proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) before checkpoint {wait_step}: {proc.stdout.read()[-3000:]}")
        if time.time() - t0 > timeout:
            proc.kill()
            pytest.fail(f"no checkpoint {wait_step} after {timeout}s")
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    _run(run_dir)
    return read_metrics(run_dir)


def _assert_same(a, b, step):
    for k in COMPARE:
        if k in a or k in b:
            np.testing.assert_allclose(float(b[k]), float(a[k]), rtol=1e-6, atol=1e-9, err_msg=f"step {step} {k}")


def test_sigkill_then_resume_matches_uninterrupted(reference_run, tmp_path):
    assert sorted(reference_run) == [1, 2, 3, 4, 5, 6]
    # Sleep after each step so the kill lands while step 3 has not been checkpointed.
    proc = _start_and_wait(tmp_path, 2, "TrainConfig.debug_sleep_s = 1.0")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(_steps(tmp_path))
    assert killed_at < 6
    out = _run(tmp_path)
    assert f"resumed from checkpoint {killed_at}" in out
    resumed = read_metrics(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(killed_at + 1, 7):  # every step after the resume point, the first one above all
        _assert_same(reference_run[step], resumed[step], step)
    assert _steps(tmp_path)[-1] == 6


def test_sigterm_checkpoints_and_exits_zero(reference_run, tmp_path):
    proc = _start_and_wait(tmp_path, 2, "TrainConfig.debug_sleep_s = 2.0")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: checkpoint" in out
    last = max(_steps(tmp_path))
    assert last < 6 and last == max(read_metrics(tmp_path))  # the step it stopped at was written
    # And the run continues from there to the same result.
    _run(tmp_path)
    _assert_same(reference_run[6], read_metrics(tmp_path)[6], 6)


def test_nonfinite_loss_is_skipped_and_never_checkpointed(tmp_path):
    import orbax.checkpoint as ocp

    out = _run(tmp_path, "TrainConfig.inject_nonfinite_steps = (1,)", "TrainConfig.checkpoint_every = 1",
               "TOTAL_STEPS = 3")
    assert "SKIPPED" in out and "non-finite" in out  # console line + warning
    # The resolved config is saved beside the checkpoints and TensorBoard got events.
    assert "TrainConfig.inject_nonfinite_steps = (1,)" in (tmp_path / "operative_config.gin").read_text()
    assert "TOTAL_STEPS = 3" in (tmp_path / "config.gin").read_text()
    assert any(p.stat().st_size > 0 for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    m = read_metrics(tmp_path)
    assert m[2]["skipped_updates"] == m[2]["updates"] >= 1  # step index 1 = the second step
    assert m[2]["loss"] == "nan"
    assert m[1]["skipped_updates"] == 0 and m[3]["skipped_updates"] == 0
    # Params after the skipped step equal those before it; every checkpoint is finite.
    mngr = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=("state", "meta"))
    states = {s: mngr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
              for s in (1, 2, 3)}
    for s, st in states.items():
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(st)), f"checkpoint {s}"
    for a, b in zip(jax.tree.leaves(states[1]["params"]), jax.tree.leaves(states[2]["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(states[2]["params"]), jax.tree.leaves(states[3]["params"])))


def test_checkpointer_refuses_nan_state(tmp_path):
    import jax.numpy as jnp

    from rexrag_jax.train.checkpoint import Checkpointer, NonFiniteCheckpointError

    ck = Checkpointer(str(tmp_path / "ck"), keep=2)
    ck.save(1, {"w": jnp.ones(3)}, {"step": 1})
    with pytest.raises(NonFiniteCheckpointError, match="non-finite"):
        ck.save(2, {"w": jnp.array([1.0, jnp.nan, 0.0])}, {"step": 2})
    assert ck.all_steps() == [1]
    state, meta = ck.restore(1, {"w": jnp.zeros(3)})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.ones(3))
    assert meta == {"step": 1}
    ck.close()
