"""Qwen2 HF checkpoint IO and chunked log-probs: time and host memory vs transformers, same run.

    python benchmarks/qwen2_hf_io.py [--layers 8 --hidden 1024 --vocab 32000] [--workdir DIR]

1. load: a random bf16 Qwen2 checkpoint (sharded safetensors) into bf16 params on 8 fake CPU devices
   (mesh 1x4x2) with `hf_io.load_checkpoint`, vs `Qwen2ForCausalLM.from_pretrained(dtype=bfloat16)`.
   Each side runs in a fresh subprocess; reported: wall time and the transient host memory = peak RSS
   minus RSS after loading (what the loader needed on top of the loaded weights).
2. export: `hf_io.export_checkpoint` vs `save_pretrained` of the same weights (wall time; ours also a
   second time, with its per-leaf programs compiled).
3. log-probs: XLA temp memory of `token_logprobs` vs `token_logprobs_chunked` (B=4, T=1024,
   V=151936, one small layer) from the compiled executables' memory analysis.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
           HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

CHILD = r"""
import json, os, sys, threading, time
def rss():  # current RSS in bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
# Peak by sampling every 2 ms: ru_maxrss would report the (large) parent's RSS at fork time.
samples, done = [0], threading.Event()
def sample():
    while not done.is_set():
        samples.append(rss()); time.sleep(0.002)
which, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
if which == "ours":
    import jax, numpy as np
    from rexrag_jax.models.qwen2 import hf_io
    from rexrag_jax.sharding import make_mesh
    mesh = make_mesh(1, 4, 2)
    jax.block_until_ready(jax.device_put(np.ones(8)))  # start the runtime before the baseline
    base = rss(); threading.Thread(target=sample, daemon=True).start(); t = time.perf_counter()
    cfg, params = hf_io.load_checkpoint(path, mesh=mesh, param_dtype="bfloat16", progress=False)
    jax.block_until_ready(params); dt = time.perf_counter() - t
    done.set(); after = rss(); peak = max(samples + [after])
    t = time.perf_counter(); hf_io.export_checkpoint(params, cfg, out, max_shard_size="200MB", progress=False)
    ex = time.perf_counter() - t
    # again with the 11 per-leaf slice/transpose programs compiled (a fixed cost, independent of size)
    t = time.perf_counter(); hf_io.export_checkpoint(params, cfg, out + "2", max_shard_size="200MB", progress=False)
    ex_warm = time.perf_counter() - t
else:
    import torch, transformers
    torch.set_num_threads(2)
    base = rss(); threading.Thread(target=sample, daemon=True).start(); t = time.perf_counter()
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    dt = time.perf_counter() - t
    done.set(); after = rss(); peak = max(samples + [after])
    t = time.perf_counter(); model.save_pretrained(out, max_shard_size="200MB"); ex = time.perf_counter() - t
    ex_warm = ex
print(json.dumps({"load_s": dt, "export_s": ex, "export_warm_s": ex_warm, "base": base, "after": after, "peak": peak}))
"""


def make_checkpoint(path: str, layers: int, hidden: int, vocab: int) -> int:
    import torch
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                   tie_word_embeddings=False)
    with torch.device("cpu"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def run_child(which: str, path: str, out: str) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, which, path, out], env=ENV, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if res.returncode:
        raise RuntimeError(f"{which} child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def logprob_memory() -> tuple[int, int]:
    import jax
    import jax.numpy as jnp
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.models.qwen2.model import init_params, token_logprobs, token_logprobs_chunked
    cfg = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((4, 1024), jnp.int32)
    full = jax.jit(lambda p, t: token_logprobs(p, t, cfg)).lower(params, tokens).compile()
    chunked = jax.jit(lambda p, t: token_logprobs_chunked(p, t, cfg, chunk=128)).lower(params, tokens).compile()
    return full.memory_analysis().temp_size_in_bytes, chunked.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    os.environ.update(ENV)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        n = make_checkpoint(ckpt, args.layers, args.hidden, args.vocab)
        mib = 2**20
        print(f"checkpoint: {n / 1e6:.1f}M params, {n * 2 / mib:.0f} MiB bf16, "
              f"{len([f for f in os.listdir(ckpt) if f.endswith('.safetensors')])} shards")
        ours = run_child("ours", ckpt, os.path.join(tmp, "ex_ours"))
        peer = run_child("peer", ckpt, os.path.join(tmp, "ex_peer"))
    for name, r in (("rexrag_jax (mesh 1x4x2)", ours), ("transformers", peer)):
        print(f"{name:24s} load {r['load_s']:6.2f} s  resident +{(r['after'] - r['base']) / mib:6.0f} MiB  "
              f"transient peak over resident {(r['peak'] - r['after']) / mib:6.0f} MiB  "
              f"export {r['export_s']:6.2f} s (warm {r['export_warm_s']:.2f} s)")
    print(f"load time ratio ours/transformers: {ours['load_s'] / peer['load_s']:.2f}; "
          f"export time ratio: {ours['export_s'] / peer['export_s']:.2f} "
          f"(warm {ours['export_warm_s'] / peer['export_s']:.2f})")
    full, chunked = logprob_memory()
    print(f"token_logprobs temp memory (B=4,T=1024,V=151936): full {full / mib:.0f} MiB, chunked(128) "
          f"{chunked / mib:.0f} MiB, ratio {full / max(chunked, 1):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
