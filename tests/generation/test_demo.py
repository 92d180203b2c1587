"""`rexrag generate` (tiny random model) runs and reports throughput."""
import re

from rexrag_jax.cli import main as cli_main


def test_generate_cli_prints_tokens_per_second(capsys):
    # same shapes as the engine tests (batch 4, max_len 128, chunk 8) so compiles are shared
    rc = cli_main(["generate", "--batch", "4", "--new", "8", "--max-len", "128", "--decode-chunk", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert len(re.findall(r"^\[row \d\] \(length, 8 tokens", out, flags=re.M)) == 4
    assert re.search(r"32 tokens in [\d.]+ s: [\d.]+ tokens/s", out)
