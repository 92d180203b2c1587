"""`rexrag build-trace-buffer`: the static RAPO trace buffer from a stronger policy's rollouts (SPEC §8).

    rexrag build-trace-buffer --checkpoint RUN_DIR_OR_HF_EXPORT --questions train.jsonl --n 16 --k 5 \\
        --out buffers/nq_hotpot (--retriever-url URL | --corpus CORPUS.jsonl [--index-dir DIR]) \\
        [--temperature 1.0] [--batch-size 64] [--max-turns 5] [--limit 1000] [--shard-size 64] [--overwrite]
    rexrag build-trace-buffer --policy solver --noise 0.3 --questions world/train.jsonl \\
        --corpus world/corpus.jsonl [--lexical] --out buffers/world0        (the miniature: seconds)

Policy: `--checkpoint` (a `rexrag train` run dir or an HF export, loaded as `rexrag eval` loads it) samples
N trajectories per question with temperature sampling and the plain Search-R1 prompt (no probes, no
<retrieve> note); `--policy solver` is the synthetic world's solver with noise (rapo/solver.py).
Retriever: as `rexrag eval` (--retriever-url, or --corpus for the in-process MiniLM index); --lexical
uses the synthetic world's exact lexical retriever over --corpus instead (no encoder, seconds).
Keys are embedded with the trainer's trace-buffer encoder (all-MiniLM-L6-v2, --encoder-max-length 256 =
HybridSearchRollout.encoder_max_length). Layout, resume and the manifest: rapo/static_buffer.py.
Bad input (missing files, a finished --out without --overwrite, ...): one line, exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from rexrag_jax.rapo.static_buffer import Candidate, TraceBufferError, build_trace_buffer, questions_fingerprint
from rexrag_jax.config.cli_style import conventional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rexrag build-trace-buffer", description=__doc__.split("\n")[0])
    p.add_argument("--questions", required=True, help="training questions file (Search-R1 schema: jsonl/parquet/...)")
    p.add_argument("--out", required=True, help="buffer directory (local or gs://)")
    p.add_argument("--n", type=int, default=16, help="trajectories sampled per question (paper: 16)")
    p.add_argument("--k", type=int, default=5, help="top trajectories kept per question by reward (paper: 5)")
    p.add_argument("--policy", choices=("checkpoint", "solver"), default="checkpoint", help="the stronger agent: a trained policy (--checkpoint) or the synthetic world's noisy solver")
    p.add_argument("--checkpoint", help="stronger policy: a `rexrag train` run dir or an HF-format Qwen2 dir")
    p.add_argument("--noise", type=float, default=0.3, help="--policy solver: early-answer probability per hop")
    p.add_argument("--limit", type=int, help="first N questions only (the world id still covers the whole file)")
    p.add_argument("--shard-size", type=int, default=64, help="questions per shard (the unit of resumption)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--min-reward", type=float, default=None,
                   help="drop kept trajectories below this reward (default: none, the paper's top-K)")
    p.add_argument("--structure-format-score", type=float, default=0.0, help="reward format bonus (SPEC §2)")
    p.add_argument("--overwrite", action="store_true", help="rebuild a finished buffer / a partial one with "
                                                             "other settings")
    p.add_argument("--history-chars", type=int, default=1000, help="key history tail (HybridConfig.history_chars)")
    p.add_argument("--encoder-max-length", type=int, default=256, help="MiniLM tokens per buffer key")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("model and retriever (as rexrag eval)")
    m.add_argument("--tokenizer", help="tokenizer.json / SentencePiece model (default: the checkpoint's)")
    m.add_argument("--gin-file", action="append", default=[], help="gin file(s) of a train run dir checkpoint")
    m.add_argument("--gin-param", action="append", default=[], help="gin binding(s), repeatable")
    m.add_argument("--retriever-url", dest="retriever_url", help="Search-R1 /retrieve URL (else --corpus / --index-dir)")
    m.add_argument("--corpus", help="corpus jsonl for an in-process MiniLM retriever")
    m.add_argument("--index-dir", dest="index_dir", help="index dir of `rexrag build-index` for the in-process retriever")
    m.add_argument("--lexical", action="store_true", help="exact lexical retriever over --corpus (synthetic world)")
    m.add_argument("--topk", type=int, default=3, help="passages per search")
    m.add_argument("--max-turns", type=int, default=5, help="turns per trajectory")
    m.add_argument("--max-new-tokens", type=int, default=500, help="tokens generated per turn")
    m.add_argument("--max-obs-tokens", type=int, default=500, help="observation tokens kept per search")
    m.add_argument("--max-context", type=int, default=4096, help="context tokens per trajectory")
    m.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    m.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    m.add_argument("--batch-size", type=int, default=64, help="engine rows (a multiple of --n)")
    return conventional(p)


class RolloutSampler:
    """Sampler for build_trace_buffer over the project's rollout loop: N sampled trajectories per question
    (groups of run_rollouts, `batch_size // n` questions per engine batch, PRNG = fold_in(seed, question
    index)); steps by trace_buffer.trajectory_steps (policy run + its observation, key = history before)."""

    def __init__(self, engine, tokenizer, retriever, config, history_chars: int = 1000, info: dict | None = None):
        if config.probes:
            raise ValueError("RolloutSampler: RolloutConfig.probes must be False")
        self.engine, self.tok, self.retriever, self.config = engine, tokenizer, retriever, config
        self.history_chars, self.info = history_chars, dict(info or {})

    def __call__(self, examples, n: int, seed: int, start_index: int) -> list[list[Candidate]]:
        import jax

        from rexrag_jax.rapo.trace_buffer import trajectory_steps
        from rexrag_jax.rollout.loop import run_rollouts

        per = max(1, self.engine.batch_size // n)
        if self.engine.batch_size < n:
            raise TraceBufferError(f"--batch-size {self.engine.batch_size} < --n {n}: one question's samples must fit")
        out = []
        for lo in range(0, len(examples), per):
            part = list(examples[lo:lo + per])
            rng = jax.random.fold_in(jax.random.PRNGKey(seed), start_index + lo)
            batch, _ = run_rollouts(self.engine, self.tok, self.retriever, part, n, rng, self.config)
            for q in range(len(part)):  # originals first, group by group: row q * n + j
                out.append([Candidate(batch.response_text[q * n + j],
                                      trajectory_steps(batch, q * n + j, self.tok.decode, self.history_chars),
                                      int(batch.num_searches[q * n + j])) for j in range(n)])
        return out


def make_encode_fn(max_length: int = 256):
    """The trainer's trace-buffer encoder (HybridSearchRollout: minilm_encode_fn), name/max_length attached."""
    from rexrag_jax.rapo.trace_buffer import minilm_encode_fn

    return minilm_encode_fn(max_length=max_length)


def _retriever(args):
    from rexrag_jax.io import paths

    if args.lexical:
        if not args.corpus or not paths.isfile(args.corpus):
            raise FileNotFoundError(f"--lexical needs --corpus CORPUS.jsonl (got {args.corpus!r})")
        import json

        from rexrag_jax.data.synthetic_world import WorldRetriever
        rows = [json.loads(line) for line in paths.read_text(args.corpus).splitlines() if line.strip()]
        return WorldRetriever(rows)
    from rexrag_jax.evaluation.policy import make_retriever

    return make_retriever(args.retriever_url, args.corpus, args.index_dir, progress=not args.no_progress)


def _sampler(args, retriever):
    if args.policy == "solver":
        from rexrag_jax.rapo.solver import NoisySolver

        return NoisySolver(retriever, args.noise, args.topk, args.history_chars)
    from rexrag_jax.evaluation.policy import load_policy
    from rexrag_jax.generation.engine import GenerationEngine
    from rexrag_jax.rollout.loop import RolloutConfig

    if not args.checkpoint:
        raise ValueError("--policy checkpoint needs --checkpoint (a `rexrag train` run dir or an HF export); "
                         "or --policy solver")
    if args.batch_size < args.n:
        raise ValueError(f"--batch-size {args.batch_size} < --n {args.n}: one question's samples must fit")
    cfg, params, tok = load_policy(args.checkpoint, args.tokenizer, args.gin_file, args.gin_param,
                                   progress=not args.no_progress)
    rcfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                         max_obs_tokens=args.max_obs_tokens, max_context=args.max_context, topk=args.topk,
                         temperature=args.temperature, top_p=args.top_p, greedy=False, probes=False)
    rows = (args.batch_size // args.n) * args.n
    engine = GenerationEngine(params, cfg, batch_size=rows, max_len=args.max_context + args.max_new_tokens,
                              pad_id=tok.pad_id, eos_ids=tok.eos_ids, detokenize=tok.decode)
    from rexrag_jax.io import paths
    info = {"kind": "checkpoint", "checkpoint": paths.as_str(args.checkpoint), "temperature": args.temperature,
            "top_p": args.top_p, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
            "topk": args.topk, "max_obs_tokens": args.max_obs_tokens, "max_context": args.max_context,
            "batch_size": rows}
    return RolloutSampler(engine, tok, retriever, rcfg, args.history_chars, info)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # MiniLM ships with the package: never download
    from rexrag_jax.data.readers import read_qa_file
    from rexrag_jax.io import paths

    try:
        if paths.is_remote(args.out):
            paths.check_remote_dir(args.out)
        if not paths.isfile(args.questions):
            raise FileNotFoundError(f"--questions: file not found: {args.questions}")
        if args.policy == "solver" and args.checkpoint:
            raise ValueError("--policy solver takes no --checkpoint (the solver is the stronger agent)")
        if paths.isfile(paths.join(args.out, "manifest.json")) and not args.overwrite:  # before any model loads
            raise TraceBufferError(f"{args.out}: a finished trace buffer is already there (manifest.json); "
                                   "pass --overwrite to rebuild it")
        examples = read_qa_file(args.questions)
        world = {"id": questions_fingerprint(examples), "questions": paths.as_str(args.questions),
                 "num_questions": len(examples)}
        if args.corpus and not args.retriever_url:
            world["corpus"] = paths.as_str(args.corpus)
        t0 = time.perf_counter()
        retriever = _retriever(args)
        sampler = _sampler(args, retriever)
        encode_fn = make_encode_fn(args.encoder_max_length)
        policy = dict(sampler.info, retriever="lexical" if args.lexical else
                      (args.retriever_url or "minilm-local"))
        m = build_trace_buffer(args.out, examples, sampler, encode_fn, n=args.n, k=args.k,
                               shard_size=args.shard_size, seed=args.seed, overwrite=args.overwrite,
                               min_reward=args.min_reward, structure_format_score=args.structure_format_score,
                               history_chars=args.history_chars, world=world, policy=policy,
                               num_questions=args.limit, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:  # TraceBufferError, QADataError, ...
        print(f"rexrag build-trace-buffer: {e}", file=sys.stderr)
        return 2
    c = m["counts"]
    print(f"wrote {args.out}: {c['questions']} questions x {m['n']} samples, kept {c['trajectories_kept']} "
          f"trajectories (top {m['k']}), {m['count']} steps ({c['insertable_steps']} insertable, "
          f"{c['answer_steps']} answers); sampled reward {m['rewards']['sampled_mean']:.3f}, kept "
          f"{m['rewards']['kept_mean']:.3f}; {time.perf_counter() - t0:.1f} s (build {m['build_seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
