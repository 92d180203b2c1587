"""One path layer for run dirs, index dirs and output files: local paths and `gs://` URLs alike.

Every writer and reader of a run dir (orbax checkpoints, TensorBoard events, metrics.jsonl, the gin
configs), of an index dir and of trajectory dumps goes through these helpers. Remote paths are
`etils.epath.Path` objects, the same path type orbax uses, so checkpoints and everything else share one
backend: `gcsfs` through fsspec (or TensorFlow's gfile where TensorFlow is installed; epath picks it).
Orbax's array data goes through tensorstore's own GCS driver (same bucket, same credentials).

Local paths stay what they were: absolute `os.path.abspath` paths, written with the same
temp-file-then-rename steps as before. A URL is never passed to os.path (`os.path.abspath("gs://b/r")`
is `<cwd>/gs:/b/r`, a local folder named `gs:`).

GCS has no directories, no append and no rename: an object appears whole when its single upload
completes, so "atomic write" on GCS is one upload, and "makedirs" only checks the bucket. Directories
that other libraries need as local files (ScaNN, memmaps) are staged in a local cache dir and copied
with `upload_dir` / `download_dir`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading

from etils import epath

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# GCS bucket names: 3-63 chars (222 with dots), lowercase letters, digits, '-', '_', '.'.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
SUPPORTED_SCHEMES = ("gs",)
CHECK_TIMEOUT_ENV = "REXRAG_REMOTE_CHECK_TIMEOUT_S"
CACHE_ENV = "REXRAG_REMOTE_CACHE"


class RemotePathError(ValueError):
    """A remote path that is malformed, names a missing bucket, or cannot be reached (message: one line)."""


def is_remote(path) -> bool:
    """True for `scheme://...` URLs (gs://bucket/run), False for local paths."""
    return bool(_SCHEME.match(os.fspath(path) if not isinstance(path, str) else path))


def _split_url(url: str) -> tuple[str, str, str]:
    m = _SCHEME.match(url)
    scheme = m.group(1).lower()
    rest = url[m.end():]
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def check_url(url: str) -> None:
    """Syntax check of a remote URL (no network): supported scheme and a valid bucket name."""
    scheme, bucket, _ = _split_url(url)
    if scheme not in SUPPORTED_SCHEMES:
        raise RemotePathError(f"{url}: unsupported scheme {scheme}:// (supported: "
                              f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)})")
    if not _BUCKET.match(bucket):
        raise RemotePathError(f"{url}: malformed gs:// URL, {bucket!r} is not a valid bucket name "
                              "(expected gs://BUCKET/PATH)")


def as_path(path) -> epath.Path:
    """An epath.Path: remote URLs as they are (syntax-checked), local paths made absolute."""
    s = os.fspath(path)
    if is_remote(s):
        check_url(s)
        return epath.Path(s)
    return epath.Path(os.path.abspath(s))


def as_str(path) -> str:
    """The string form of as_path(path): an absolute local path or the URL."""
    return os.fspath(as_path(path))


def join(path, *parts) -> str:
    """`path / part / ...` as a string, for a local path or a URL alike."""
    p = as_path(path)
    for part in parts:
        p = p / part
    return os.fspath(p)


def exists(path) -> bool:
    return as_path(path).exists()


def isfile(path) -> bool:
    return as_path(path).is_file()


def isdir(path) -> bool:
    return as_path(path).is_dir()


def listdir(path) -> list[str]:
    """Names directly under `path` ([] when it does not exist)."""
    p = as_path(path)
    if not p.exists():
        return []
    return sorted(c.name for c in p.iterdir())


def _with_timeout(fn, what: str, timeout_s: float):
    """fn() in a daemon thread, RemotePathError if it takes longer than timeout_s (GCS clients retry a
    refused connection for about a minute)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  re-raised below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RemotePathError(f"{what}: storage not reachable (no answer within {timeout_s:g} s)")
    if "error" in box:
        e = box["error"]
        raise RemotePathError(f"{what}: storage not reachable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e
    return box["value"]


def check_remote_dir(url: str, timeout_s: float | None = None) -> None:
    """Raises RemotePathError (one-line message naming `url`) unless `url` is a well-formed URL whose
    bucket exists and answers within timeout_s (default: $REXRAG_REMOTE_CHECK_TIMEOUT_S or 60 s)."""
    check_url(url)
    scheme, bucket, _ = _split_url(url)
    if timeout_s is None:
        timeout_s = float(os.environ.get(CHECK_TIMEOUT_ENV, "60"))
    root = epath.Path(f"{scheme}://{bucket}")
    if not _with_timeout(root.exists, url, timeout_s):
        raise RemotePathError(f"{url}: bucket {scheme}://{bucket} does not exist or is not accessible")


def makedirs(path) -> None:
    """mkdir -p for a local path; for a URL nothing is created (object stores have no directories and
    gcsfs's makedirs would create a missing *bucket*), the bucket is only checked to exist."""
    s = os.fspath(path)
    if is_remote(s):
        check_remote_dir(s)
    else:
        os.makedirs(os.path.abspath(s), exist_ok=True)


def write_text_atomic(path, text: str) -> None:
    """Write `text` so that readers see the old or the new file, never a part: locally a temp file beside
    `path` then os.replace; on GCS a single upload (an object appears only when its upload completes)."""
    s = os.fspath(path)
    if is_remote(s):
        as_path(s).write_text(text, encoding="utf-8")
        return
    path = os.path.abspath(s)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json_atomic(path, obj, **dump_kw) -> None:
    write_text_atomic(path, json.dumps(obj, **dump_kw))


def read_text(path) -> str:
    return as_path(path).read_text(encoding="utf-8")


def read_json(path):
    return json.loads(read_text(path))


def open_file(path, mode: str = "r", **kw):
    """open() for a local path or a URL (remote writes become visible when the file is closed)."""
    s = os.fspath(path)
    if is_remote(s):
        return as_path(s).open(mode, **kw)
    return open(os.path.abspath(s), mode, **kw)


def upload_file(local: str, remote) -> None:
    """Copy a local file to `remote` (a URL or a local path), streamed."""
    with open(local, "rb") as src, open_file(remote, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)


def upload_dir(local_dir: str, remote_dir, last: tuple[str, ...] = (), prune: bool = False) -> None:
    """Copy every file under local_dir to remote_dir (same relative names). Files named in `last` (e.g. a
    manifest) are deleted from remote_dir first and uploaded after all others, so a reader that finds
    them knows the upload finished. prune: also delete files under remote_dir that local_dir does not
    have (after `last` is gone, so no reader takes the mix of old and new files for a finished copy)."""
    remote = as_path(remote_dir)
    for name in last:
        if (remote / name).exists():
            (remote / name).unlink()
    files = []
    for root, _, names in os.walk(local_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), local_dir)
            files.append(rel)
    if prune and remote.exists():
        keep = {tuple(rel.split(os.sep)) for rel in files}
        for src_path, rel in list(_walk_files(remote)):
            if rel not in keep:
                src_path.unlink()
    for rel in sorted(files, key=lambda r: (r in last, r)):
        dst = remote
        for part in rel.split(os.sep):
            dst = dst / part
        upload_file(os.path.join(local_dir, rel), dst)


def download_dir(remote_dir, local_dir: str) -> None:
    """Copy every object under remote_dir into local_dir (replacing what was there), via a temp dir
    and a rename so a crash never leaves a half copy at local_dir."""
    remote = as_path(remote_dir)
    parent = os.path.dirname(os.path.abspath(local_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".download-", dir=parent)
    try:
        for src_path, rel in _walk_files(remote):
            dst = os.path.join(tmp, *rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with src_path.open("rb") as src, open(dst, "wb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
        if os.path.exists(local_dir):
            shutil.rmtree(local_dir)
        os.replace(tmp, local_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_files(path) -> list[str]:
    """Relative names ('a/b.txt', '/'-separated) of every file under `path`, sorted ([] when missing)."""
    p = as_path(path)
    if not p.exists():
        return []
    return ["/".join(rel) for _, rel in _walk_files(p)]


def remove_tree(path) -> None:
    """rm -rf for a local dir or everything under a URL prefix; a missing path is not an error."""
    s = os.fspath(path)
    if is_remote(s):
        p = as_path(s)
        if p.exists():
            p.rmtree()
    else:
        shutil.rmtree(os.path.abspath(s), ignore_errors=True)


def download_file(remote, local: str) -> None:
    """Copy one file (URL or local path) to the local path `local`, via a temp file and a rename."""
    local = os.path.abspath(local)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=os.path.dirname(local))
    try:
        with open_file(remote, "rb") as src, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, 16 << 20)
        os.replace(tmp, local)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def basename(path) -> str:
    """Last component of a local path or a URL (no os.path on URLs)."""
    return as_path(path).name


def dirname(path) -> str:
    """Parent of a local path or a URL, as a string."""
    return os.fspath(as_path(path).parent)


def _walk_files(root: epath.Path, prefix: tuple[str, ...] = ()):
    """(path, relative parts) of every file under root (iterdir recursion: the same on every backend)."""
    for child in sorted(root.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            yield from _walk_files(child, prefix + (child.name,))
        else:
            yield child, prefix + (child.name,)


def local_cache_dir(url: str) -> str:
    """Local directory that mirrors `url` ($REXRAG_REMOTE_CACHE or ~/.cache/rexrag_jax/remote, then
    scheme/bucket/key)."""
    scheme, bucket, key = _split_url(url)
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rexrag_jax", "remote")
    return os.path.join(root, scheme, bucket, *[k for k in key.split("/") if k])
