"""One CLI convention (issue 14 item 4): every flag of every sub-command has help, both spellings of a
long flag parse, and the help shows the declared spelling with its default."""
import argparse
import re

import pytest

from rexrag_jax import cli
from rexrag_jax.config.cli_style import conventional

SUBCOMMANDS = ["demo", "demo eval", "train", "eval", "build-index", "merge-index", "serve-retriever", "generate",
               "build-trace-buffer", "plan"]


def _help(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _options(text):
    """(flag spec, help text) of each option entry of an argparse help page."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if re.match(r"^  -", line) and not line.strip().startswith("-h"):
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            text_ = parts[1] if len(parts) > 1 else (nxt.strip() if re.match(r"^\s{10,}\S", nxt) else "")
            out.append((parts[0], text_))
    return out


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_flag_has_help(sub, capsys):
    opts = _options(_help(capsys, sub.split()))
    assert opts, sub
    missing = [spec for spec, text in opts if not text]
    assert not missing, f"rexrag {sub}: flags without help: {missing}"


def test_both_spellings_parse_and_help_shows_the_declared_one_with_its_default():
    p = conventional(argparse.ArgumentParser(prog="x"))
    p.add_argument("--batch_size", type=int, default=32, help="rows")  # declared after conventional(): no alias
    q = argparse.ArgumentParser(prog="y")
    q.add_argument("--batch_size", type=int, default=32, help="rows")
    q.add_argument("--max-turns", type=int, default=5, help="turns")
    q.add_argument("--quiet", action="store_true", help="no bar")
    conventional(q)
    a = q.parse_args(["--batch-size", "7", "--max_turns", "2"])
    assert (a.batch_size, a.max_turns) == (7, 2)
    assert q.parse_args(["--batch_size", "9", "--max-turns", "3"]).batch_size == 9
    text = q.format_help()
    assert "--batch_size BATCH_SIZE" in text and "--batch-size" not in text
    assert "rows (default: 32)" in text and "turns (default: 5)" in text and "no bar (default" not in text
    with pytest.raises(SystemExit):
        p.parse_args(["--batch-size", "1"])


def test_eval_and_demo_eval_take_either_batch_size_spelling():
    from rexrag_jax.evaluation.main import _parser

    assert _parser().parse_args(["--data", "f.jsonl", "--batch_size", "8"]).batch_size == 8
    assert _parser().parse_args(["--data", "f.jsonl", "--batch-size", "8"]).batch_size == 8
