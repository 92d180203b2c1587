"""Shared test setup: 8 fake CPU devices for sharding tests and a persistent compile cache."""
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

_CACHE = pathlib.Path(os.environ.get("REXRAG_JAX_CACHE", pathlib.Path.home() / ".cache" / "rexrag_jax_xla"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    if not SHARED_DATA.exists():
        pytest.fail(f"shared data not found at {SHARED_DATA} (expected ../shared/data beside the checkout)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _isolated_gin_config():
    """gin bindings are process-global: no test may see another test's bindings."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()
