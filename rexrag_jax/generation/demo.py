"""`rexrag generate`: sample from a policy with GenerationEngine and print tokens/s.

  rexrag generate                                   # tiny random Qwen2 ("tiny" preset), token-id prompts
  rexrag generate --preset small --batch 16 --new 128
  rexrag generate --checkpoint /path/to/Qwen2.5-0.5B --prompt "Question: who wrote Hamlet?"
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from rexrag_jax.config.cli_style import conventional


def _parse(argv):
    ap = argparse.ArgumentParser(prog="rexrag generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="HF Qwen2 directory (config.json, safetensors, tokenizer.json)")
    ap.add_argument("--preset", default="tiny", help="random-weight model preset when no --checkpoint")
    ap.add_argument("--prompt", default="Answer the given question. Question: who wrote Hamlet?\n",
                    help="prompt text (with --checkpoint); random token ids otherwise")
    ap.add_argument("--batch", type=int, default=4, help="rows sampled at once (the same prompt)")
    ap.add_argument("--new", type=int, default=64, help="max new tokens per row")
    ap.add_argument("--max-len", type=int, default=1024, help="KV cache slots per row")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    ap.add_argument("--seed", type=int, default=0, help="sampling (and random-init) seed")
    ap.add_argument("--decode-chunk", type=int, default=16, help="decode steps per jitted call")
    return conventional(ap).parse_args(argv)


def main(argv=None) -> int:
    from rexrag_jax.generation import GenerationEngine, stop_token_sequences
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.models.qwen2.model import init_params

    args = _parse(argv)
    tok = None
    if args.checkpoint:
        from rexrag_jax.models.qwen2.hf_io import load_checkpoint
        from rexrag_jax.tokenizers import load_tokenizer
        cfg, params = load_checkpoint(args.checkpoint)
        tok = load_tokenizer(args.checkpoint)
        prompt = tok.encode(args.prompt)
        eos_ids, pad_id = tuple(tok.eos_ids), tok.pad_id
        detok = tok.decode
        seqs = stop_token_sequences(tok.encode, tok.decode, ("</search>", "</answer>"))
    else:
        cfg = Qwen2Config.from_preset(args.preset)
        params = init_params(cfg, jax.random.PRNGKey(args.seed))
        prompt = np.random.RandomState(args.seed).randint(1, cfg.vocab_size, 16).tolist()
        eos_ids, pad_id, seqs = (), 0, ()
        detok = lambda ids: " ".join(map(str, ids))  # noqa: E731  (no tokenizer: show ids)
    if len(prompt) + args.new > args.max_len:
        raise SystemExit(f"rexrag generate: prompt ({len(prompt)} tokens) + --new {args.new} exceeds "
                         f"--max-len {args.max_len}")
    eng = GenerationEngine(params, cfg, args.batch, args.max_len, pad_id=pad_id, eos_ids=eos_ids,
                           detokenize=detok, decode_chunk=args.decode_chunk, stop_token_seqs=seqs)
    rows = list(range(args.batch))

    def run(seed):
        eng.reset()
        eng.append(rows, [prompt] * args.batch)
        outs = eng.generate(rows, args.new, jax.random.PRNGKey(seed), temperature=args.temperature,
                            top_p=args.top_p, greedy=args.greedy)
        eng.block_until_ready()
        return outs

    t0 = time.perf_counter()
    run(args.seed)  # includes compilation
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = run(args.seed + 1)
    dt = time.perf_counter() - t0
    n = sum(len(o.tokens) for o in outs)
    for i, o in enumerate(outs):
        print(f"[row {i}] ({o.stop_reason}, {len(o.tokens)} tokens, mean logprob "
              f"{np.mean(o.logprobs) if o.logprobs else 0.0:.3f}) {o.text!r}")
    print(f"{n} tokens in {dt:.3f} s: {n / dt:.1f} tokens/s (batch {args.batch}; first call incl. compile "
          f"{t_first:.1f} s)")
    return 0
