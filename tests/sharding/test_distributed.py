"""initialize_from_env parsing, and a real 2-process CPU run over loopback (127.0.0.1)."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from rexrag_jax.sharding.distributed import initialize_from_env

REPO = pathlib.Path(__file__).resolve().parents[2]

WORKER = r"""
import json, numpy as np
from rexrag_jax.sharding.distributed import initialize_from_env, host_local_batch_to_global
assert initialize_from_env()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from rexrag_jax.sharding import make_mesh
pid = jax.process_index()
mesh = make_mesh(data=2, fsdp=2, tensor=1)  # 2 processes x 2 CPU devices
x = np.random.default_rng(100 + pid).normal(size=(4, 8)).astype(np.float32)  # this process's rows
w = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
gx = host_local_batch_to_global({"x": x}, mesh)["x"]
rep = NamedSharding(mesh, P())
f = jax.jit(lambda a, w: (jnp.tanh(a @ w).sum(), jnp.tanh(a @ w).sum(-1)), out_shardings=(rep, rep))
total, rows = f(gx, w)
print("RESULT " + json.dumps({"pid": pid, "devices": len(jax.devices()), "local": len(jax.local_devices()),
                             "shape": list(gx.shape), "spec": str(gx.sharding.spec),
                             "total": float(total), "rows": np.asarray(rows).tolist()}), flush=True)
jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_process_env_is_a_noop():
    assert initialize_from_env({}) is False
    assert initialize_from_env({"TPU_WORKER_HOSTNAMES": "localhost"}) is False


def test_partial_or_bad_env_is_an_error():
    with pytest.raises(ValueError, match=r"\['JAX_PROCESS_COUNT', 'JAX_PROCESS_ID'\] missing"):
        initialize_from_env({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"})
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": "2"}
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID=2 must lie in \[0, JAX_PROCESS_COUNT=2\)"):
        initialize_from_env(env)
    with pytest.raises(ValueError, match=r"JAX_PROCESS_COUNT='two': expected an integer"):
        initialize_from_env(dict(env, JAX_PROCESS_COUNT="two"))


def test_two_cpu_processes_agree_on_a_sharded_computation(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_COUNT="2", JAX_PROCESS_ID=str(pid),
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r["pid"] for r in results] == [0, 1]
    for r in results:
        assert r["devices"] == 4 and r["local"] == 2 and r["shape"] == [8, 8]
        assert "data" in r["spec"] and "fsdp" in r["spec"]
    # both processes hold the same replicated result ...
    assert results[0]["total"] == results[1]["total"] and results[0]["rows"] == results[1]["rows"]
    # ... equal to numpy on the global batch = process 0's rows then process 1's rows
    x = np.concatenate([np.random.default_rng(100 + i).normal(size=(4, 8)).astype(np.float32) for i in range(2)])
    w = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    ref_rows = np.tanh(x @ w).sum(-1)
    np.testing.assert_allclose(results[0]["rows"], ref_rows, atol=1e-5)
    assert abs(results[0]["total"] - ref_rows.sum()) < 1e-4
