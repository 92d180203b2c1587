"""Step metrics: TensorBoard scalars (tensorboardX), an append-only metrics.jsonl, a console line.

metrics.jsonl holds one {"step": s, ...} object per logged step. After a crash and resume, steps
between the last checkpoint and the crash appear twice; the later line is the one that counts
(`read_metrics` keeps the last line per step).

The run dir may be a gs:// URL (rexrag_jax.io.paths). GCS objects cannot be appended to, so there the
logger keeps metrics.jsonl in memory (starting from the bucket's copy on resume) and uploads the whole
file after every logged step, one upload each (the object is replaced whole, never seen half-written).
TensorBoard on GCS: tensorboardX has a gs:// writer of its own, but it goes through google-cloud-storage
with its own client and credentials, apart from the path layer every other file uses. Instead the
events are written to a local temp dir by the ordinary SummaryWriter and, after every flush (each
logged step) and on close, each event file there is uploaded whole to <run_dir>/tensorboard/ through
rexrag_jax.io.paths. A preempted worker loses at most the events of the step it was in; each session
writes its own event file (tensorboardX names them by time and host), so a resume never overwrites the
events of an earlier session.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile

from tensorboardX import SummaryWriter

from rexrag_jax.io import paths

CONSOLE_KEYS = (("reward/mean", "reward", "{:.3f}"), ("em/train", "em", "{:.3f}"), ("loss", "loss", "{:.4f}"),
                ("kl", "kl", "{:.2e}"), ("entropy", "ent", "{:.2f}"), ("grad_norm", "gnorm", "{:.3f}"),
                ("lr", "lr", "{:.1e}"), ("probes/kept", "probes", "{:.0f}"), ("keep_ratio", "rho", "{:.3f}"),
                ("response_len/mean", "len", "{:.0f}"), ("time/step", "s", "{:.2f}"),
                ("tokens_per_s", "tok/s", "{:.0f}"))


def _scalar(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


class MetricsLogger:
    def __init__(self, run_dir: str, use_tensorboard: bool = True, stream=None):
        self.remote = paths.is_remote(run_dir)
        paths.makedirs(run_dir)
        self.jsonl_path = paths.join(run_dir, "metrics.jsonl")
        self.tb_dir = paths.join(run_dir, "tensorboard")
        self._jsonl_text = None
        self._tb_local = None
        if self.remote:
            self._jsonl_text = paths.read_text(self.jsonl_path) if paths.exists(self.jsonl_path) else ""
            if use_tensorboard:
                self._tb_local = tempfile.mkdtemp(prefix="rexrag-tensorboard-")
        self.writer = SummaryWriter(self._tb_local or self.tb_dir) if use_tensorboard else None
        self.stream = stream or sys.stdout

    def _flush_writer(self) -> None:
        self.writer.flush()
        self._mirror_events()

    def _mirror_events(self) -> None:
        if self._tb_local is not None:  # upload the local event file(s) into the bucket, whole
            for name in sorted(os.listdir(self._tb_local)):
                local = os.path.join(self._tb_local, name)
                if os.path.isfile(local):
                    paths.upload_file(local, paths.join(self.tb_dir, name))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            # Markdown code block keeps gin's layout in the TensorBoard text tab.
            self.writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)
            self._flush_writer()

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: _scalar(v) for k, v in metrics.items()}
        clean = {k: v for k, v in clean.items() if v is not None}
        if self.writer is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self._flush_writer()
        # NaN/inf are written as strings so the file stays strict JSON.
        line = json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}) + "\n"
        if self.remote:
            self._jsonl_text += line
            paths.write_text_atomic(self.jsonl_path, self._jsonl_text)
        else:
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(line)
        self.stream.write(console_line(step, clean) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            if self._tb_local is not None:
                self._mirror_events()
                shutil.rmtree(self._tb_local, ignore_errors=True)
                self._tb_local = None


def console_line(step: int, metrics: dict) -> str:
    parts = [f"step {step:5d}"]
    for key, short, fmt in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} " + fmt.format(metrics[key]))
    if metrics.get("skipped_updates"):
        parts.append(f"SKIPPED {int(metrics['skipped_updates'])} non-finite update(s)")
    return " | ".join(parts)


def read_metrics(run_dir: str) -> dict[int, dict]:
    """{step: metrics} from metrics.jsonl, the last line per step winning."""
    out = {}
    for line in paths.read_text(paths.join(run_dir, "metrics.jsonl")).splitlines():
        if line.strip():
            row = json.loads(line)
            out[int(row.pop("step"))] = row
    return out
