"""Resume on another mesh (issue 16 item 3, the reduced size that runs in CI).

A tiny `rexrag train` run on 8 fake devices as fsdp 4 x tensor 2 is SIGKILLed after checkpoint 2, then
resumed (a) on the same 8 devices as fsdp 8 and (b) on 4 devices as fsdp 4, as after a preemption that
lands on another slice. The restored params and optimizer state equal the checkpoint's exactly under each
mesh, and the next steps' metrics equal the uninterrupted fsdp 4 x tensor 2 run within 1e-5. The same at
the Qwen2.5-0.5B shape with a 151,936-token tokenizer.json: benchmarks/reshard_resume.py (outside CI).
"""
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from rexrag_jax.train.metrics_log import read_metrics
from test_train_reliability import COMPARE, REPO, _env, _start_and_wait, _steps  # noqa: E402  (same folder)

# the restore-and-dump program (params + optimizer state to .npz, then "n_devices n_leaves [specs]")
_spec = importlib.util.spec_from_file_location("reshard_resume", REPO / "benchmarks" / "reshard_resume.py")
reshard_resume = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reshard_resume)

BINDINGS = ("TOTAL_STEPS = 3", "MICRO_BATCH = 8", "TrainConfig.checkpoint_every = 1",
            "TrainConfig.initial_keep_ratio = 0.0")  # no probes: K rounds to the data-parallel size
MESH_A, MESH_B, MESH_C = "MESH_SHAPE = (1, 4, 2)", "MESH_SHAPE = (1, 8, 1)", "MESH_SHAPE = (1, 4, 1)"


def _env_devices(n):
    env = _env()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    return env


def _train(run_dir, *bindings, devices=8):
    cmd = [sys.executable, "-m", "rexrag_jax.cli", "train", "--gin_file", "tiny.gin", "--run_dir", str(run_dir)]
    for b in bindings:
        cmd += ["--gin_bindings", b]
    p = subprocess.run(cmd, env=_env_devices(devices), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _dump(run_dir, out, mesh, devices):
    p = subprocess.run([sys.executable, "-c", reshard_resume.DUMP, "tiny.gin", str(run_dir), str(out), *BINDINGS, mesh],
                       cwd=REPO, env=_env_devices(devices), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1], dict(np.load(out))


def test_resume_on_another_mesh_matches_the_uninterrupted_run(tmp_path):
    _train(tmp_path / "ref", *BINDINGS, MESH_A)
    ref = read_metrics(tmp_path / "ref")
    assert sorted(ref) == [1, 2, 3]

    part = tmp_path / "part"
    proc = _start_and_wait(part, 2, *BINDINGS, MESH_A, "TrainConfig.debug_sleep_s = 2.0")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = max(_steps(part))
    assert killed_at == 2, _steps(part)
    assert not json.loads((part / "run.json").read_text())["finished"]

    # the checkpoint restored into three meshes: exactly the same numbers, laid out per mesh
    dumps = {}
    for name, mesh, n in (("a", MESH_A, 8), ("b", MESH_B, 8), ("c", MESH_C, 4)):
        copy = tmp_path / f"dump_{name}"
        shutil.copytree(part, copy)
        dumps[name] = _dump(copy, tmp_path / f"{name}.npz", mesh, n)
    (info_a, a), (info_b, b), (info_c, c) = dumps["a"], dumps["b"], dumps["c"]
    assert info_a.startswith("8 ") and info_b.startswith("8 ") and info_c.startswith("4 ")
    assert info_a != info_b  # tensor-sharded specs on (1, 4, 2) only
    assert sorted(a) == sorted(b) == sorted(c) and len(a) > 10
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
        np.testing.assert_array_equal(c[k], a[k], err_msg=k)

    for name, mesh, n in (("fsdp8", MESH_B, 8), ("fsdp4_4dev", MESH_C, 4)):
        run = tmp_path / name
        shutil.copytree(part, run)
        out = _train(run, *BINDINGS, mesh, devices=n)
        assert "resumed from checkpoint 2" in out
        got = read_metrics(run)
        assert sorted(got) == [1, 2, 3]
        for k in COMPARE:
            if k in ref[3] or k in got[3]:
                np.testing.assert_allclose(float(got[3][k]), float(ref[3][k]), rtol=1e-5, atol=1e-7,
                                           err_msg=f"{name} step 3 {k}")
