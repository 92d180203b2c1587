"""Step metrics: TensorBoard scalars (tensorboardX), an append-only metrics.jsonl, a console line.

metrics.jsonl holds one {"step": s, ...} object per logged step. After a crash and resume, steps
between the last checkpoint and the crash appear twice; the later line is the one that counts
(`read_metrics` keeps the last line per step).
"""
from __future__ import annotations

import json
import math
import os
import sys

from tensorboardX import SummaryWriter

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
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard")) if use_tensorboard else None
        self.stream = stream or sys.stdout

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            # Markdown code block keeps gin's layout in the TensorBoard text tab.
            self.writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)
            self.writer.flush()

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: _scalar(v) for k, v in metrics.items()}
        clean = {k: v for k, v in clean.items() if v is not None}
        if self.writer is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            # NaN/inf are written as strings so the file stays strict JSON.
            f.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}})
                    + "\n")
        self.stream.write(console_line(step, clean) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out[int(row.pop("step"))] = row
    return out
