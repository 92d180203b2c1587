"""Decode throughput of GenerationEngine vs HF transformers `generate`, against this machine's roofline,
and the probe-splice saving.

Same random Qwen2 weights in both (ours exported through hf_io.iter_hf_tensors), same machine, same
run, warm-up excluded. transformers is timed with torch threads = CPU count and with 1 thread (on a
loaded machine the multi-threaded run can be far slower); the ratio is reported against each and against
the faster one. Both sides time prefill + `--new` greedy tokens; the decode step alone is timed as
ours: generate() without the prompt's append; transformers: (t(new tokens) - t(1 token)) / (new - 1).

Roofline of one decode step (issue 13): the machine's fp32 GEMM peak and read bandwidth are measured in
the same run (benchmarks/_machine.py, before and after the timed runs; the higher of each is used), and
    t_roof = max(bytes / bandwidth, FLOPs / GEMM peak)
with bytes = every weight read once (decoder layers, the tied embedding / LM head; B embedding rows when
untied) + the K/V of the live context (prompt + new/2 slots per row, all layers), and FLOPs = B x (dense
matmuls + LM head) + attention over that context (rexrag_jax/models/qwen2/flops.py). Prints
`decode: X% of roofline, Y× transformers` (X = t_roof / our step, Y = their step / ours). With
`--compare-stacked` the engine's other decode layouts (GenerationEngine.decode_layout: "stacked", the
previous one, weights sliced inside the layer loop; "layers"; "out_in") are timed too, with the share of
rows whose greedy tokens are identical to ours. Then prefill tokens and wall time of copy_prefix vs re-prefilling a
1k-token prefix (target >= 5x; `--prefix 0` skips it).

  python benchmarks/generation.py [--preset small] [--batch 16] [--new 128] [--prompt 32] [--repeats 3]
                                  [--single-thread]   # XLA and torch both on one thread
  python benchmarks/generation.py --preset qwen2.5-0.5b --batch 16 --prompt 32 --new 32 --repeats 1 \
                                  --prefix 0 --compare-stacked
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--single-thread" in sys.argv:  # must precede jax's import: XLA reads its flags once
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import _machine  # noqa: E402
from rexrag_jax.models.qwen2.flops import dense_flops_per_token  # noqa: E402

from rexrag_jax.generation import GenerationEngine  # noqa: E402
from rexrag_jax.models.qwen2.config import Qwen2Config  # noqa: E402
from rexrag_jax.models.qwen2.hf_io import iter_hf_tensors  # noqa: E402
from rexrag_jax.models.qwen2.model import init_params  # noqa: E402


def hf_model(params, cfg):
    import torch
    import transformers

    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "torch_dtype")})
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in iter_hf_tensors(params, cfg)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight transfer failed: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def decode_roofline(cfg, batch: int, context: float, machine: dict) -> dict:
    """Bytes, FLOPs and the roofline time of one decode step at `batch` rows of `context` live slots."""
    item = np.dtype(cfg.param_dtype).itemsize
    L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    layer_params = dense_flops_per_token(cfg) // 2 + L * (2 * D + (cfg.num_heads + 2 * cfg.num_kv_heads)
                                                          * cfg.head_dim)  # matmuls + norms + biases
    head = V * D if cfg.tie_word_embeddings else V * D + batch * D
    weight_bytes = (layer_params + head + D) * item
    kv_bytes = 2 * L * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize * context * batch
    flops = batch * (dense_flops_per_token(cfg) + 2 * D * V) + 4 * L * cfg.num_heads * cfg.head_dim * context * batch
    t_bw = (weight_bytes + kv_bytes) / machine["read_bytes_per_s"]
    t_fl = flops / machine["gemm_flops_per_s"]
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops, "t_bytes": t_bw, "t_flops": t_fl,
            "t": max(t_bw, t_fl)}


def machine_limits() -> dict:
    m = _machine.measure(gemm_repeats=3)
    print(f"machine: fp32 GEMM peak {m['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s "
          f"({', '.join(f'{n}²: {v / 1e9:.0f}' for n, v in m['gemm_per_size'].items())}), read bandwidth "
          f"{m['read_bytes_per_s'] / 1e9:.1f} GB/s, load average {os.getloadavg()[0]:.1f}")
    return m


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--decode-chunk", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--single-thread", action="store_true",
                    help="XLA CPU single-threaded and transformers timed with 1 torch thread only")
    ap.add_argument("--compare-stacked", action="store_true",
                    help="also time the engine with stacked weights (unstack=False, the previous decode layout)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = ap.parse_args(argv)
    if args.new < 2 or args.prompt < 1 or args.batch < 1 or args.repeats < 1:
        print("generation.py: --new must be >= 2 and --prompt, --batch, --repeats >= 1", file=sys.stderr)
        return 2

    cfg = Qwen2Config.from_preset(args.preset)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    prompts = rng.randint(1, cfg.vocab_size, (args.batch, args.prompt))
    print(f"device: {jax.devices()[0].platform}, cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, "
          f"XLA single-thread {args.single_thread}; "
          f"preset {args.preset} (L={cfg.num_layers}, D={cfg.hidden_size}, V={cfg.vocab_size}); batch "
          f"{args.batch}, prompt {args.prompt}, new {args.new}")

    machine = [machine_limits()]

    # --- ours: prefill + decode, greedy, no stops (every row runs the full length) ------------------
    rows = list(range(args.batch))
    engines = {"ours": GenerationEngine(params, cfg, args.batch, args.max_len, eos_ids=(), stop_strings=(),
                                        decode_chunk=args.decode_chunk)}
    if args.compare_stacked:  # the previous decode layout and the other per-layer layout
        for layout in ("stacked", "layers", "out_in"):
            if layout != engines["ours"].decode_layout:
                engines[layout] = GenerationEngine(params, cfg, args.batch, args.max_len, eos_ids=(), stop_strings=(),
                                                   decode_chunk=args.decode_chunk, decode_layout=layout)
    eng = engines["ours"]

    def run_engine(e):
        e.reset()
        t0 = time.perf_counter()
        e.append(rows, prompts.tolist())
        e.block_until_ready()
        t1 = time.perf_counter()
        outs = e.generate(rows, args.new, jax.random.PRNGKey(0), greedy=True)
        e.block_until_ready()
        t2 = time.perf_counter()
        return outs, t2 - t0, (t2 - t1) / args.new

    outs = {name: run_engine(e)[0] for name, e in engines.items()}  # warm-up: compiles

    # --- HF transformers generate ------------------------------------------------------------------
    settings = [] if args.no_hf else ([1] if args.single_thread else sorted({os.cpu_count(), 1}, reverse=True))
    if settings:
        import torch
        model = hf_model(params, cfg)
        ids = torch.from_numpy(prompts).long()

    def hf(n):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    hf_out = None
    for threads in settings:
        torch.set_num_threads(threads)
        hf(2)  # warm-up

    # Interleave the timed runs (ours, then transformers at each thread count) and keep each side's
    # best: the machine's load drifts, and back-to-back blocks would charge the drift to one side.
    t_tot = {n: float("inf") for n in engines}
    t_step = {n: float("inf") for n in engines}
    hf_tot, hf_step = {t: float("inf") for t in settings}, {t: float("inf") for t in settings}
    for _ in range(args.repeats):
        for name, e in engines.items():
            o, tt, ts = run_engine(e)
            t_tot[name], t_step[name] = min(t_tot[name], tt), min(t_step[name], ts)
        for threads in settings:
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            hf(1)
            t1 = time.perf_counter()
            hf_out = hf(args.new)
            t2 = time.perf_counter()
            hf_tot[threads] = min(hf_tot[threads], t2 - t1)
            hf_step[threads] = min(hf_step[threads], ((t2 - t1) - (t1 - t0)) / (args.new - 1))
    machine.append(machine_limits())
    best = {k: max(m[k] for m in machine) for k in ("gemm_flops_per_s", "read_bytes_per_s")}
    n_tok = args.batch * args.new
    for name in engines:
        print(f"{name + ':':13s} {t_tot[name]:7.3f} s  {n_tok / t_tot[name]:9.1f} tok/s   decode step "
              f"{t_step[name] * 1e3:8.1f} ms")
    for name in engines:
        if name != "ours":
            same = np.mean([a.tokens == b.tokens for a, b in zip(outs["ours"], outs[name])])
            print(f"ours ({eng.decode_layout}) vs {name}: decode step {t_step[name] / t_step['ours']:.2f}x faster; "
                  f"rows with identical greedy tokens: {same:.0%}")
    for threads in settings:
        print(f"transformers ({threads} torch thread{'s' * (threads > 1)}): {hf_tot[threads]:7.3f} s  "
              f"{n_tok / hf_tot[threads]:9.1f} tok/s   decode step {hf_step[threads] * 1e3:8.1f} ms   "
              f"ratio ours/transformers {hf_tot[threads] / t_tot['ours']:.2f}x (decode step "
              f"{hf_step[threads] / t_step['ours']:.2f}x)")
    print(f"load average now {os.getloadavg()[0]:.1f}")
    roof = decode_roofline(cfg, args.batch, args.prompt + args.new / 2, best)
    print(f"roofline of one decode step (GEMM peak {best['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s, read "
          f"{best['read_bytes_per_s'] / 1e9:.1f} GB/s): weights {roof['weight_bytes'] / 1e9:.3f} GB + KV "
          f"{roof['kv_bytes'] / 1e9:.4f} GB -> {roof['t_bytes'] * 1e3:.1f} ms; {roof['flops'] / 1e9:.2f} GFLOP -> "
          f"{roof['t_flops'] * 1e3:.1f} ms; roofline {roof['t'] * 1e3:.1f} ms")
    if settings:
        agree = np.mean([o.tokens[:16] == hf_out[i, args.prompt: args.prompt + 16].tolist()
                         for i, o in enumerate(outs["ours"])])
        print(f"ratio vs the faster transformers setting: {min(hf_tot.values()) / t_tot['ours']:.2f}x   "
              f"(greedy first-16-token agreement {agree:.0%})")
        ratio = f"{min(hf_step.values()) / t_step['ours']:.2f}× transformers"
    else:
        ratio = "transformers not run"
    print(f"decode: {roof['t'] / t_step['ours']:.0%} of roofline, {ratio}   "
          f"(preset {args.preset}, batch {args.batch}, step {t_step['ours'] * 1e3:.1f} ms vs roofline "
          f"{roof['t'] * 1e3:.1f} ms)")
    if args.prefix <= 0:
        return 0

    # --- probe splice: copy_prefix vs re-prefilling a 1k prefix -------------------------------------
    probe = rng.randint(1, cfg.vocab_size, 16).tolist()
    prefix = rng.randint(1, cfg.vocab_size, args.prefix).tolist()
    eng.reset()
    eng.append([0], [prefix])

    def splice():
        eng.reset([1])
        eng.copy_prefix(0, 1, args.prefix)
        eng.append([1], [probe])
        eng.block_until_ready()

    def reprefill():
        eng.reset([1])
        eng.append([1], [prefix + probe])
        eng.block_until_ready()

    splice(), reprefill()  # warm-up
    t_splice, t_re = float("inf"), float("inf")
    for _ in range(args.repeats):  # interleaved, best of each
        t_splice, t_re = min(t_splice, best_of(splice, 1)), min(t_re, best_of(reprefill, 1))
    print(f"splice: prefill tokens {len(probe)} vs {args.prefix + len(probe)} "
          f"({(args.prefix + len(probe)) / len(probe):.0f}x fewer); wall {t_splice * 1e3:.1f} ms vs "
          f"{t_re * 1e3:.1f} ms ({t_re / t_splice:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
