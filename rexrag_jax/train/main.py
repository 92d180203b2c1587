"""`rexrag train`: REX-RAG / GRPO training configured with gin, t5x style.

    rexrag train --gin_file gin/rexrag.gin --gin_file gin/model/qwen2.5-3b.gin \
        --gin_bindings 'TRAIN_FILES = ["data/nq_hotpotqa_train.parquet"]' \
        --gin_bindings 'TOKENIZER = "/models/Qwen2.5-3B"' --run_dir runs/rexrag-3b

--gin_file paths are tried as given, then relative to the repository's gin/ directory (so
`--gin_file rexrag.gin` works too; gin files may `include` each other the same way). The run directory
gets config.gin (all bindings, written before training) and operative_config.gin (the values actually
used, written once the trainer is built); both also go to TensorBoard as text. Re-running the same
command resumes from the latest checkpoint in <run_dir>/checkpoints. The run dir's run.json
(rexrag_jax.io.run_dir) records the resolved bindings and whether the run finished: a finished run, or an
unfinished one with other bindings, is refused (one line, exit 2) unless --overwrite, which replaces the
run dir whole (old checkpoints, events and metrics.jsonl are never mixed with the new run's).

--run_dir may be a gs:// URL (the TPU launch scripts pass one): every file of the run then goes to the
bucket through rexrag_jax.io.paths, and nothing is written locally but temp files. A malformed URL, a
missing bucket or unreachable storage is refused before anything else (one line, exit 2).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import gin

from rexrag_jax.config import GIN_DIR, parse_gin  # noqa: F401  (parse_gin: re-exported for callers)
from rexrag_jax.config.cli_style import conventional


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rexrag train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gin_file", dest="gin_file", action="append", default=[],
                    help="gin file (repeatable; tried as given, then under gin/)")
    ap.add_argument("--gin_bindings", "--gin_param", dest="gin_bindings",
                    action="append", default=[], help="gin binding, e.g. 'TOTAL_STEPS = 10' (repeatable; default: none)")
    ap.add_argument("--run_dir", required=True, help="checkpoints, TensorBoard logs, metrics.jsonl, configs")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a finished run, or an unfinished one with other bindings, in --run_dir "
                         "(default: off; such run dirs are refused and a compatible unfinished run resumes)")
    return conventional(ap)


def write_text_atomic(path: str, text: str) -> None:
    """Local: temp file + rename; gs://: one upload (rexrag_jax.io.paths.write_text_atomic)."""
    from rexrag_jax.io import paths

    paths.write_text_atomic(path, text)


@gin.configurable
def run_type(trainer=None):
    """The trainer class of the run type: `run_type.trainer = @RapoTrainer` in gin/rapo.gin; default Trainer."""
    if trainer is None:
        from rexrag_jax.train.trainer import Trainer as trainer
    return trainer


def unset_required_macros() -> list[str]:
    """Macros still bound to %gin.REQUIRED after parsing (gin does not enforce REQUIRED macros itself)."""
    return sorted(m.group(1) for m in re.finditer(r"^([A-Z][A-Z0-9_]*) = %gin\.REQUIRED\s*$", gin.config_str(), re.M))


def gin_error_line(e: BaseException) -> str:
    """One line for a gin parse/call error: the message's first line, plus where gin says it came from
    ("In file ..., line N" / "In bindings string line N" / "In call to configurable 'X'")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    where = next((ln for ln in lines[1:] if ln.startswith("In ")), None)
    return lines[0] + (f" ({where})" if where else "")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if not args.gin_file:
        print("rexrag train: at least one --gin_file is required (e.g. gin/rexrag.gin + gin/model/*.gin)",
              file=sys.stderr)
        return 2
    from rexrag_jax.io import paths

    if paths.is_remote(args.run_dir):
        try:
            paths.check_remote_dir(args.run_dir)
        except paths.RemotePathError as e:
            print(f"rexrag train: --run_dir {e}", file=sys.stderr)
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes at INFO
    # gin logs "Path not found" before trying its search path (gin/); a truly missing file still raises.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda r: not r.getMessage().startswith(("Path not found", "system_path_file_exists")))
    try:
        parse_gin(args.gin_file, args.gin_bindings)
    except Exception as e:  # noqa: BLE001  missing file, unknown configurable/parameter, syntax: one line
        print(f"rexrag train: bad gin config: {gin_error_line(e)}", file=sys.stderr)
        return 2
    missing = unset_required_macros()
    if missing:
        print(f"rexrag train: required gin macro(s) not set: {', '.join(missing)}; set them in a gin file or "
              f"with --gin_bindings 'NAME = value' (see the header of {args.gin_file[0]})", file=sys.stderr)
        return 2
    from rexrag_jax.io import run_dir as run_dirs

    config_text = gin.config_str()
    try:
        run = run_dirs.prepare(args.run_dir, "train", run_dirs.gin_bindings(config_text), overwrite=args.overwrite,
                               prog="rexrag train", legacy_files=LEGACY_FILES, legacy_config=_legacy_config)
    except (run_dirs.RunDirError, paths.RemotePathError) as e:
        print(f"rexrag train: {e}", file=sys.stderr)
        return 2
    run.save_configs(config_text)
    from rexrag_jax.config.errors import StartupInputError

    try:
        trainer = run_type()(args.run_dir)
    except StartupInputError as e:  # bad input found while the trainer is built (e.g. a RAPO trace buffer)
        run.abandon()  # a fresh run dir goes again: the corrected command starts clean, not "incompatible"
        print(f"rexrag train: {str(e).splitlines()[0]}", file=sys.stderr)  # gin appends "In call to ..."
        return 2
    except (ValueError, TypeError) as e:  # a wrongly typed / out-of-range value, found while building
        run.abandon()
        print(f"rexrag train: bad configuration: {gin_error_line(e)}", file=sys.stderr)
        return 2
    except BaseException:
        run.abandon()
        raise
    operative = gin.operative_config_str()
    run.save_configs(operative_text=operative)  # TensorBoard text: Trainer.run (at the resumed step)
    rc = trainer.run(config_text=operative)
    if rc == 0 and trainer.step >= trainer.cfg.total_steps:  # not a SIGTERM exit: the run is complete
        run.mark_finished(step=int(trainer.step))
    return rc


# Files of a `rexrag train` run dir written before run.json existed: such a dir resumes when its config.gin
# holds the same bindings, else it is refused unless --overwrite.
LEGACY_FILES = ("config.gin", "operative_config.gin", "checkpoints", "metrics.jsonl", "tensorboard")


def _legacy_config(run_dir: str):
    from rexrag_jax.io import paths, run_dir as run_dirs

    path = paths.join(run_dir, "config.gin")
    return run_dirs.gin_bindings(paths.read_text(path)) if paths.isfile(path) else None


if __name__ == "__main__":
    sys.exit(main())
