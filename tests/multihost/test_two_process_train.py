"""2 CPU processes (jax.distributed over 127.0.0.1) x 2 fake devices each run 2 GRPO update steps of a
tiny Qwen2 with per-host data sharding; both must end with the same params, equal (1e-5) to one process
updating on the full batch, and different from one process updating on half of it."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "two_process_worker.py"
TIMEOUT_S = 420
CACHE = pathlib.Path(os.environ.get("REXRAG_JAX_CACHE", pathlib.Path.home() / ".cache" / "rexrag_jax_xla"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_COMPILATION_CACHE_DIR=str(CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_ID"):
        if k not in extra:
            env.pop(k, None)
    return env


def _launch(mode, out, env, cwd):
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(out)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(procs: dict) -> dict:
    """Wait for every process (bounded); on any failure kill the rest and report all outputs."""
    results, failures = {}, []
    try:
        for name, p in procs.items():
            try:
                out, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                failures.append(f"--- {name}: timed out after {TIMEOUT_S}s\n{out[-2000:]}\n{err[-4000:]}")
                continue
            lines = [json.loads(l[len("RESULT "):]) for l in out.splitlines() if l.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                failures.append(f"--- {name}: exit {p.returncode}\n{out[-2000:]}\n{err[-4000:]}")
                continue
            for r in lines:
                results[r.get("mode", name)] = r
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not failures, "\n".join(failures)
    return results


def test_two_processes_train_like_one(tmp_path):
    port = _free_port()
    procs = {}
    for pid in range(2):
        procs[f"process{pid}"] = _launch("multi", tmp_path / f"multi{pid}.npz",
                                         _env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                              JAX_PROCESS_COUNT="2", JAX_PROCESS_ID=str(pid)), tmp_path)
    results = _collect(procs)
    # references after the distributed run (2 cores: running all at once only slows everyone down)
    results.update(_collect({"reference": _launch("reference", tmp_path, _env(1), tmp_path)}))

    for pid in range(2):
        r = results[f"process{pid}"]
        assert (r["pid"], r["processes"], r["devices"], r["local"]) == (pid, 2, 4, 2), r
        assert r["mesh"]["data"] * r["mesh"]["fsdp"] == 4, r
    assert results["process0"]["loss_tokens"] == results["single"]["loss_tokens"] > results["half"]["loss_tokens"] > 0

    p0, p1 = np.load(tmp_path / "multi0.npz"), np.load(tmp_path / "multi1.npz")
    single, half = np.load(tmp_path / "single.npz"), np.load(tmp_path / "half.npz")
    assert sorted(p0.files) == sorted(p1.files) == sorted(single.files) and len(p0.files) >= 10
    assert results["process0"]["checksum"] == results["process1"]["checksum"]
    max_full_half = 0.0
    for k in p0.files:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=f"processes disagree on {k}")
        np.testing.assert_allclose(p0[k], single[k], atol=1e-5, rtol=0, err_msg=f"multi-process != single on {k}")
        max_full_half = max(max_full_half, float(np.abs(single[k] - half[k]).max()))
    # the comparison means something: params moved (lr 1e-3, 2 AdamW steps) and both halves of the batch mattered
    init = _initial_params()
    moved = max(float(np.abs(single[k] - init[k]).max()) for k in single.files)
    assert moved > 1e-3, moved
    assert max_full_half > 1e-4, max_full_half


def _initial_params() -> dict:
    import jax
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.models.qwen2.config import Qwen2Config
    params = qwen2.init_params(Qwen2Config.from_preset("tiny"), jax.random.PRNGKey(0))
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(params)}
