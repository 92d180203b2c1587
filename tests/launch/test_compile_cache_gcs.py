"""The launch scripts' persistent compilation cache (JAX_COMPILATION_CACHE_DIR=gs://<bucket>/rexrag_xla_cache)
works on GCS: a first process compiles and writes its entries into the bucket, a second process (a
restart, or another worker) loads them instead of compiling. Against the GCS emulator on 127.0.0.1."""
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gcs_emulator import emulator, skip_without_emulator, subprocess_env  # noqa: E402

skip_without_emulator()

BUCKET = "rexrag-cache-test"
CHILD = r"""
import json, jax, jax.numpy as jnp
from jax import monitoring
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
f = jax.jit(lambda x, y: jnp.tanh(x @ y).sum(axis=0))
f(jnp.ones((128, 128)), jnp.ones((128, 128))).block_until_ready()
print(json.dumps({k: events.count(k) for k in set(events) if k.startswith("/jax/compilation_cache/")}))
"""


def _child(url, cache_dir):
    env = subprocess_env(url, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                         JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_first_ones_executable_from_the_bucket(tmp_path):
    with emulator(tmp_path, BUCKET) as (url, fs):
        cache = f"gs://{BUCKET}/rexrag_xla_cache"
        first = _child(url, cache)
        assert first.get("/jax/compilation_cache/cache_misses", 0) >= 1, first
        assert first.get("/jax/compilation_cache/cache_hits", 0) == 0, first
        entries = fs.ls(f"{BUCKET}/rexrag_xla_cache")
        assert entries, "nothing was written to the bucket"
        second = _child(url, cache)
        assert second.get("/jax/compilation_cache/cache_hits", 0) >= 1, second
        assert second.get("/jax/compilation_cache/cache_misses", 0) == 0, second
    assert not (pathlib.Path.cwd() / "gs:").exists()
