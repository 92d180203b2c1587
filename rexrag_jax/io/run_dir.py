"""Run directories: resume a compatible unfinished run, refuse a finished or different one, or replace it whole.

Every command that writes a run dir (`rexrag train`, `rexrag demo`) opens it with `prepare`:

    run = run_dir.prepare(args.run_dir, "train", config, overwrite=args.overwrite, prog="rexrag train")
    ...                                   # the command writes its files
    run.save_configs(config_text, operative_text, logger)   # config.gin, operative_config.gin, TensorBoard text
    run.save_gin()                        # the same from the current gin state (no logger needed)
    run.mark_finished(step=...)           # only when the command completed its work

`<run_dir>/run.json` is the run manifest, written atomically (rexrag_jax.io.paths.write_json_atomic):

    {"format": 1, "command": "train", "fingerprint": sha256 of the resolved config, "config": {...},
     "finished": false, "attempts": 1, "created_unix": ..., "updated_unix": ..., "finished_info": {...}}

`config` is the command's resolved configuration as a JSON object (train: gin binding -> value text,
`gin_bindings`; demo: the DemoConfig fields and the seed). What `prepare` does with `path`:

    missing or empty                        fresh run: created, manifest written
    run.json, same command + fingerprint,   resumed (the command continues from its checkpoints); with
      not finished                          on_unfinished="restart" (a command without resume) replaced
    run.json, finished                      refused (RunDirError, one line naming --overwrite)
    run.json, other command / fingerprint   refused, naming the first differing fields and --overwrite
    no run.json but files of this command   a run of an earlier version: adopted when `legacy_config` reads
      (legacy_files)                        the same config from it, refused otherwise (--overwrite replaces)
    anything else (foreign files)           refused even with --overwrite: it is not a run dir

With `overwrite=True` a run dir is replaced whole, never merged with the new run: locally it is renamed
aside (`<run_dir>.replaced-<pid>-<time>`, one atomic rename), a fresh directory takes its name, then the
old one is deleted (a crash during the delete leaves only that sibling, removed on the next replace).
On gs:// (no rename) the manifest is first rewritten with "replacing": true, every other object is
deleted, then the fresh manifest is written; a crash in between leaves a manifest that every later
`prepare` refuses unless --overwrite (which finishes the job).

Bindings that change no result (TrainConfig.debug_sleep_s, RolloutConfig.show_progress) are left out of
the fingerprint, so a run paused by a test hook resumes without them; so is the mesh (MESH_SHAPE,
TrainConfig.mesh_shape): a run resumes on another slice shape.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Callable, Mapping

from rexrag_jax.io import paths

MANIFEST = "run.json"
FORMAT = 1
# The mesh is exempt too: a preempted run resumes on whatever slice it gets (checkpoints are restored into
# the new mesh's shardings), and the math does not depend on it beyond float reduction order (about 1e-6).
EXEMPT_BINDINGS = ("TrainConfig.debug_sleep_s", "RolloutConfig.show_progress", "TrainConfig.mesh_shape",
                   "MESH_SHAPE")


class RunDirError(ValueError):
    """A run dir that may not be written to as asked (message: one line, naming --overwrite where it helps)."""


def gin_bindings(config_text: str, exempt: tuple[str, ...] = EXEMPT_BINDINGS) -> dict[str, str]:
    """{binding: value text} of a gin config string (gin.config_str() layout: comments, `import` lines and
    blank lines skipped, indented continuation lines joined, whitespace collapsed); `exempt` keys dropped."""
    out: dict[str, list[str]] = {}
    key = None
    for line in config_text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line[0].isspace() and key is not None:  # continuation of the previous binding's value
            out[key].append(stripped)
            continue
        if stripped.startswith(("import ", "include ")) or " = " not in stripped and not stripped.endswith("="):
            key = None
            continue
        name, _, value = stripped.partition("=")
        key = name.strip()
        out[key] = [value.strip()]
    clean = {k: " ".join(" ".join(v).replace("\\", " ").split()) for k, v in out.items()}
    return {k: v for k, v in sorted(clean.items()) if k not in exempt}


def fingerprint(config: Mapping) -> str:
    """sha256 of the canonical JSON of `config` (sorted keys; non-JSON values by str())."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(path: str) -> dict | None:
    """The run manifest of `path` (None when there is none); a corrupt one is a RunDirError."""
    mpath = paths.join(path, MANIFEST)
    if not paths.isfile(mpath):
        return None
    try:
        m = paths.read_json(mpath)
    except ValueError as e:
        raise RunDirError(f"{mpath}: not valid JSON ({e}); pass --overwrite to replace the run") from None
    if not isinstance(m, dict) or not {"command", "fingerprint", "finished"} <= set(m):
        raise RunDirError(f"{mpath}: expected a run manifest with command, fingerprint and finished; "
                          "pass --overwrite to replace the run")
    return m


def _diff(old: Mapping, new: Mapping, limit: int = 3) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not keys:
        return "fields equal, fingerprint differs"
    shown = [f"{k}: {old.get(k, '<unset>')!s:.40} -> {new.get(k, '<unset>')!s:.40}" for k in keys[:limit]]
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return "; ".join(shown) + more


class RunDir:
    """An opened run dir (see the module docstring); `resumed` is True when an unfinished run continues."""

    def __init__(self, path: str, manifest: dict, resumed: bool, created: bool = False):
        self.path, self.manifest, self.resumed = path, manifest, resumed
        self.created = created  # `prepare` made the directory (it did not exist)

    @property
    def command(self) -> str:
        return self.manifest["command"]

    def _write(self) -> None:
        self.manifest["updated_unix"] = int(time.time())
        paths.write_json_atomic(paths.join(self.path, MANIFEST), self.manifest, indent=2, sort_keys=True)

    def save_configs(self, config_text: str | None = None, operative_text: str | None = None, logger=None,
                     step: int = 0) -> None:
        """config.gin (all bindings) / operative_config.gin (values used), each written atomically; with a
        MetricsLogger `logger` the operative config (else the config) also goes to TensorBoard as text
        (tag gin/operative_config or gin/config, t5x's habit)."""
        if config_text is not None:
            paths.write_text_atomic(paths.join(self.path, "config.gin"), config_text)
        if operative_text is not None:
            paths.write_text_atomic(paths.join(self.path, "operative_config.gin"), operative_text)
        if logger is not None:
            if operative_text is not None:
                logger.text("gin/operative_config", operative_text, step)
            elif config_text is not None:
                logger.text("gin/config", config_text, step)

    def save_gin(self, resolved=(), tensorboard: bool = True, step: int = 0) -> None:
        """save_configs with the current gin state: config.gin = gin.config_str(), operative_config.gin =
        gin.operative_config_str() (call it after the configurables were built), and, unless tensorboard is
        False, the operative config as TensorBoard text in <run_dir>/tensorboard (its own event file).

        resolved: gin-configurable dataclass instances the command changed after gin built them (the
        demo's `--quick`: dataclasses.replace(cfg, **QUICK_OVERRIDES)); each field that differs from a fresh
        gin-built instance is appended to operative_config.gin as a binding, so the file parses to the
        configuration the run used."""
        import dataclasses
        import tempfile

        import gin

        operative = gin.operative_config_str()
        extra = []
        for obj in resolved:
            built = type(obj)()
            name = type(obj).__name__
            extra += [f"{name}.{f.name} = {getattr(obj, f.name)!r}" for f in dataclasses.fields(obj)
                      if getattr(obj, f.name) != getattr(built, f.name)]
        if extra:
            operative += "\n# Changed by the command after gin (e.g. --quick): these bindings win\n" + "\n".join(extra) + "\n"
        self.save_configs(gin.config_str(), operative)
        if not tensorboard:
            return
        from tensorboardX import SummaryWriter

        tmp = tempfile.mkdtemp(prefix="rexrag-run-config-tb-")
        try:
            writer = SummaryWriter(tmp)
            writer.add_text("gin/operative_config", "    " + operative.replace("\n", "\n    "), step)
            writer.close()
            if not paths.is_remote(self.path):
                os.makedirs(os.path.join(self.path, "tensorboard"), exist_ok=True)
            for name in sorted(os.listdir(tmp)):
                paths.upload_file(os.path.join(tmp, name), paths.join(self.path, "tensorboard", name))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def abandon(self) -> None:
        """Undo a fresh start that failed before any work (bad input found while the command set up):
        the directory is removed again if `prepare` created it, else emptied. A resumed run is left as it is."""
        if self.resumed or not _is_primary():
            return
        if paths.is_remote(self.path) or not self.created:
            for rel in paths.list_files(self.path):
                paths.as_path(paths.join(self.path, *rel.split("/"))).unlink()
            if not paths.is_remote(self.path):
                for name in os.listdir(self.path):
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)

    def mark_finished(self, **info) -> None:
        """Record that the command completed: a later `prepare` refuses the dir unless --overwrite."""
        self.manifest["finished"] = True
        self.manifest["finished_info"] = info
        self._write()


def _is_primary() -> bool:
    """Process 0 of a multi-process job (from the environment, so no JAX call is needed here)."""
    return os.environ.get("JAX_PROCESS_ID", "0") in ("", "0") and os.environ.get("TPU_WORKER_ID", "0") in ("", "0")


def replace_dir(path: str) -> None:
    """Empty `path` whole (see the module docstring): local rename aside + delete; gs:// marker + delete."""
    if paths.is_remote(path):
        mpath = paths.join(path, MANIFEST)
        paths.write_json_atomic(mpath, {"command": "?", "fingerprint": "", "finished": False, "replacing": True})
        for rel in paths.list_files(path):
            if rel != MANIFEST:
                paths.as_path(paths.join(path, *rel.split("/"))).unlink()
        return
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    for stale in os.listdir(parent):  # leftovers of a replace that crashed while deleting
        if stale.startswith(name + ".replaced-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    if os.path.exists(path):
        aside = f"{path}.replaced-{os.getpid()}-{time.time_ns()}"
        os.replace(path, aside)
        os.makedirs(path)
        shutil.rmtree(aside)
    else:
        os.makedirs(path)


def prepare(path: str, command: str, config: Mapping, *, overwrite: bool = False, prog: str | None = None,
            legacy_files: tuple[str, ...] = (), legacy_config: Callable[[str], Mapping | None] | None = None,
            on_unfinished: str = "resume", log: Callable[[str], None] | None = print) -> RunDir:
    """Open `path` for `command` with the resolved `config` (see the module docstring). Raises RunDirError."""
    if on_unfinished not in ("resume", "restart"):
        raise ValueError(f"on_unfinished must be 'resume' or 'restart', got {on_unfinished!r}")
    path = paths.as_str(path)
    prog = prog or f"rexrag {command}"
    config = dict(config)
    fp = fingerprint(config)
    now = int(time.time())
    fresh = {"format": FORMAT, "command": command, "fingerprint": fp, "config": config, "finished": False,
             "attempts": 1, "created_unix": now, "updated_unix": now}
    say = log or (lambda _msg: None)
    primary = _is_primary()

    def start_fresh(replace: bool) -> RunDir:
        created = not paths.is_remote(path) and not os.path.exists(path)
        run = RunDir(path, dict(fresh), resumed=False, created=created)
        if primary:
            if replace:
                replace_dir(path)
            else:
                paths.makedirs(path)
            run._write()
        return run

    if paths.is_remote(path):
        paths.check_remote_dir(path)
    elif os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"{path}: exists and is not a directory; pass another --run_dir")
    names = [n for n in paths.listdir(path) if not n.startswith(".tmp-")]
    if not names:
        return start_fresh(replace=False)

    try:
        m = read_manifest(path)
    except RunDirError:
        if not overwrite:
            raise
        say(f"{prog}: --overwrite: replacing the run with an unreadable {MANIFEST} in {path}")
        return start_fresh(replace=True)
    if m is None:
        present = [f for f in legacy_files if f in names]
        if not present:
            raise RunDirError(f"{path}: not empty and not a `{prog}` run dir (no {MANIFEST}; holds "
                              f"{', '.join(sorted(names)[:3])}{' ...' if len(names) > 3 else ''}); "
                              "pass a new or empty --run_dir")
        if overwrite:
            say(f"{prog}: --overwrite: replacing the earlier run in {path}")
            return start_fresh(replace=True)
        old = legacy_config(path) if legacy_config is not None else None
        if old is not None and fingerprint(dict(old)) == fp:
            run = RunDir(path, dict(fresh), resumed=True)
            if primary:
                run._write()
            say(f"{prog}: resuming the run in {path} (written before run manifests; same config)")
            return run
        why = "another configuration" if old is not None else "no run.json to compare configurations"
        raise RunDirError(f"{path}: holds an earlier run ({', '.join(present)}; {why}); pass --overwrite to "
                          "replace it, or pick another --run_dir")

    where = paths.join(path, MANIFEST)
    if m.get("replacing"):
        if overwrite:
            return start_fresh(replace=True)
        raise RunDirError(f"{where}: a replace of this run dir was interrupted; pass --overwrite to finish it")
    if overwrite:
        state = "finished" if m["finished"] else "unfinished"
        say(f"{prog}: --overwrite: replacing the {state} `rexrag {m['command']}` run in {path}")
        return start_fresh(replace=True)
    if m["command"] != command:
        raise RunDirError(f"{where}: a `rexrag {m['command']}` run, not `{prog}`; pass --overwrite to replace "
                          "it, or pick another --run_dir")
    if m["finished"]:
        raise RunDirError(f"{where}: this run finished already; pass --overwrite to replace it, or pick another "
                          "--run_dir")
    old_config = m.get("config") if isinstance(m.get("config"), dict) else None
    if m["fingerprint"] != fp and not (  # runs written before a binding became exempt (e.g. MESH_SHAPE)
            old_config is not None and fingerprint({k: v for k, v in old_config.items()
                                                    if k not in EXEMPT_BINDINGS}) == fp):
        raise RunDirError(f"{where}: an unfinished run with another configuration ({_diff(m.get('config') or {}, config)}); "
                          "pass --overwrite to replace it, or rerun with its configuration to resume")
    if on_unfinished == "restart":
        say(f"{prog}: restarting the unfinished run in {path} from the beginning (same configuration)")
        return start_fresh(replace=True)
    m = dict(m, attempts=int(m.get("attempts", 1)) + 1)
    run = RunDir(path, m, resumed=True)
    if primary:
        run._write()
    say(f"{prog}: resuming the unfinished run in {path}")
    return run
