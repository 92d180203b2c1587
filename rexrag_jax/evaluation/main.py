"""`rexrag eval`: greedy evaluation of a policy over benchmark files, or re-scoring of trajectory dumps.

    rexrag eval --rescore dump.jsonl [more.json ...] [--out scored.jsonl] [--summary-json s.json]
                (also FlashRAG / Search-R1 output files as published, e.g. intermediate_data.json: our EM is
                printed next to the file's stored score per source, and rows where they differ are listed)
    rexrag eval --data nq_test_1k.jsonl hotpotqa_dev_500.jsonl --checkpoint CKPT
                (--retriever-url URL | --corpus CORPUS.jsonl [--index-dir DIR])
                [--limit 100] [--batch-size 64] [--out trajectories.jsonl]
CKPT: an HF-format Qwen2 dir (config.json + safetensors + tokenizer), a `rexrag train` run dir or a
`rexrag demo` run dir (its rl/): latest orbax checkpoint, model and tokenizer from the run's policy.json
(else its operative_config.gin). Rollout settings (--topk, --max-turns, --max-new-tokens, --max-context)
default to the values the run trained with, else the paper's 3 / 5 / 500 / 4096; a context beyond the
model's max_position_embeddings is refused. Decoding is greedy, without probes.
Prints the EM table (nq triviaqa popqa hotpotqa 2wiki musique bamboogle avg).
"""
from __future__ import annotations

import argparse
import os
import sys

from rexrag_jax.evaluation.dumps import read_trajectory_dump
from rexrag_jax.evaluation.runner import build_generate_fn, evaluate, write_jsonl_atomic
from rexrag_jax.evaluation.scoring import format_table, score_and_summarize
from rexrag_jax.config.cli_style import conventional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rexrag eval", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rescore", nargs="+", metavar="DUMP", help="trajectory dumps (.jsonl/.json) to re-score")
    mode.add_argument("--data", nargs="+", metavar="FILE", help="benchmark files or directories to evaluate")
    p.add_argument("--data-source", help="override data_source for every input file")
    p.add_argument("--raw-fallback", action="store_true",
                   help="score a response without any <answer> block as the bare predicted answer")
    p.add_argument("--out", help="write every scored trajectory here (jsonl)")
    p.add_argument("--summary-json", help="write the per-source summary here (json)")
    p.add_argument("--limit", type=int, help="first N questions of each file (--data)")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip and count unmappable rows (--data)")
    p.add_argument("--batch-size", type=int, default=64, help="questions per rollout batch (--data)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    model = p.add_argument_group("model (--data)")
    model.add_argument("--checkpoint", help="policy: HF-format Qwen2 dir (config.json + safetensors) or a "
                                            "`rexrag train` run dir (latest orbax step)")
    model.add_argument("--tokenizer", help="tokenizer path (default: from the checkpoint)")
    model.add_argument("--gin-file", dest="gin_file", action="append", default=[],
                       help="gin config(s) of the run (default: the run dir's policy.json / operative_config.gin)")
    model.add_argument("--gin-param", "--gin-bindings", dest="gin_param",
                       action="append", default=[], help="gin binding override(s) (default: none)")
    model.add_argument("--retriever-url", dest="retriever_url",
                       help="Search-R1 POST /retrieve server (e.g. http://127.0.0.1:8000/retrieve)")
    model.add_argument("--corpus", help="corpus jsonl for the in-process MiniLM retriever (instead of --retriever-url)")
    model.add_argument("--index-dir", dest="index_dir",
                       help="index cache for --corpus (default: ~/.cache/rexrag_jax/eval_index/<corpus>)")
    run = " (default: the value a run dir trained with, else %s)"
    model.add_argument("--topk", type=int, default=None, help="passages per search" + run % 3)
    model.add_argument("--max-turns", dest="max_turns", type=int, default=None,
                       help="search-enabled turns" + run % 5)
    model.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=None,
                       help="tokens per turn" + run % 500)
    model.add_argument("--max-context", dest="max_context", type=int, default=None,
                       help="rolling context, left-truncated beyond; with --max-new-tokens at most the model's "
                            "max_position_embeddings" + run % 4096)
    return conventional(p)


def _load_examples(args):
    from rexrag_jax.data.readers import list_qa_files, read_qa_file
    examples = []
    for f in list_qa_files(args.data):
        rows = read_qa_file(f, args.data_source, skip_bad_rows=args.skip_bad_rows)
        examples.extend(rows[:args.limit] if args.limit else rows)
    return examples


def _print_disagreements(records, limit: int = 20) -> None:
    """One line per re-scored row whose stored score (e.g. FlashRAG's metric_score em) differs from ours."""
    bad = [r for r in records if r.get("agrees") is False]
    if not bad:
        return
    print(f"{len(bad)} row(s) where our EM differs from the file's stored score:")
    for r in bad[:limit]:
        print(f"  {r['id']} ({r['data_source']}): ours {r['em']:.0f} pred {r['prediction']!r}; "
              f"stored {r['stored_em']:g} pred {r.get('stored_pred')!r}; golds {r['golden_answers']}")
    if len(bad) > limit:
        print(f"  ... {len(bad) - limit} more (see --out: field 'agrees')")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from rexrag_jax.io import paths

    try:
        for out in (args.out, args.summary_json):  # a bad gs:// output fails before any model runs
            if out and paths.is_remote(out):
                paths.check_remote_dir(out)
        if args.rescore:
            records = [r for path in args.rescore for r in read_trajectory_dump(path, args.data_source)]
            records, summary = score_and_summarize(records, raw_fallback=args.raw_fallback)
            if args.out:
                write_jsonl_atomic(args.out, records)
        else:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # MiniLM ships with the package: never download
            examples = _load_examples(args)
            generate_fn = build_generate_fn(
                checkpoint=args.checkpoint, tokenizer=args.tokenizer, gin_files=args.gin_file,
                gin_params=args.gin_param, retriever_url=args.retriever_url, topk=args.topk,
                max_turns=args.max_turns, corpus=args.corpus, index_dir=args.index_dir,
                batch_size=min(args.batch_size, max(1, len(examples))), max_new_tokens=args.max_new_tokens,
                max_context=args.max_context, progress=not args.no_progress)
            if getattr(generate_fn, "settings", None):  # value (flag / run / default) per rollout setting
                print("rollout settings: " + ", ".join(f"{k} {v} ({generate_fn.settings_source[k]})"
                                                       for k, v in generate_fn.settings.items()), file=sys.stderr)
            records, summary = evaluate(examples, generate_fn, batch_size=args.batch_size, out_path=args.out,
                                        progress=not args.no_progress, raw_fallback=args.raw_fallback)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"rexrag eval: {e}", file=sys.stderr)
        return 2
    print(format_table(summary))
    _print_disagreements(records if args.rescore else [])
    if args.out:
        print(f"wrote {len(records)} trajectories to {args.out}")
    if args.summary_json:  # a local path (temp file + rename) or a gs:// URL (one upload)
        try:
            paths.write_json_atomic(args.summary_json, summary.to_dict(), indent=2)
        except paths.RemotePathError as e:
            print(f"rexrag eval: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
