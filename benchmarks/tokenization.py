"""Tokenizer throughput: rexrag_jax.tokenizers vs HF transformers on rollout-shaped text.

Workload: the SPEC §1 prompt for NQ test questions (rendered with the chat template) and retrieved
observations `<information>Doc k(Title: ...) ...</information>` from the wiki-18 sample, as in a
rollout. Same tokenizer files for both sides (a Qwen2-style byte-level BPE trained on the corpus, or
--tokenizer DIR for a real checkpoint), same run, outputs checked identical before timing.
Prints items/s for encode (loop and batch), decode and chat-template rendering with the ratio ours/peer.

  python benchmarks/tokenization.py [--tokenizer DIR] [--n 2000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "tests" / "tokenizers"))


def build_tokenizer_dir(texts, out_dir: pathlib.Path) -> pathlib.Path:
    from test_hf_tokenizer import QWEN2_SPLIT, QWEN25_TEMPLATE  # the test's Qwen2-style pipeline
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFBackend

    tok = HFBackend(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16000, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|endoftext|>"]))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": QWEN25_TEMPLATE, "clean_up_tokenization_spaces": False}))
    return out_dir


def rate(fn, n_items, repeats):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n_items / best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", help="HF checkpoint/tokenizer dir (default: train a Qwen2-style BPE)")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import transformers

    from rexrag_jax.data.prompts import build_prompt_text
    from rexrag_jax.tokenizers import load_tokenizer

    questions = [json.loads(ln)["question"] for ln in open(DATA / "benchmarks" / "nq_test_1k.jsonl")]
    passages = [json.loads(ln)["contents"] for ln in open(DATA / "corpus" / "wiki18_sample_1000.jsonl")]
    obs = []
    for i in range(0, len(passages) - 2, 3):
        docs = "".join(f"Doc {k + 1}(Title: {p.split(chr(10))[0]}) {p.split(chr(10), 1)[-1]}\n"
                       for k, p in enumerate(passages[i:i + 3]))
        obs.append(f"\n\n<information>{docs}</information>\n\n")
    chats = [[{"role": "user", "content": build_prompt_text(q)}] for q in questions]

    with tempfile.TemporaryDirectory() as tmp:
        path = a.tokenizer or build_tokenizer_dir(passages + [build_prompt_text(q) for q in questions],
                                                  pathlib.Path(tmp))
        ours = load_tokenizer(path)
        ref = transformers.AutoTokenizer.from_pretrained(str(path))
        texts = [ours.apply_chat_template(c) for c in chats] + obs
        texts = (texts * (a.n // len(texts) + 1))[:a.n]
        chats_n = (chats * (a.n // len(chats) + 1))[:a.n]
        ids = ours.encode_batch(texts)
        assert ids == [ref.encode(t, add_special_tokens=False) for t in texts], "encode differs"
        assert [ours.decode(x) for x in ids[:200]] == [ref.decode(x) for x in ids[:200]], "decode differs"
        assert [ours.apply_chat_template(c) for c in chats[:200]] == \
            [ref.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats[:200]]
        n_tok = sum(map(len, ids))
        rows = [
            ("encode, one call per text", lambda: [ours.encode(t) for t in texts],
             lambda: [ref.encode(t, add_special_tokens=False) for t in texts]),
            ("encode, batched", lambda: ours.encode_batch(texts),
             lambda: ref(texts, add_special_tokens=False)["input_ids"]),
            ("decode, one call per row", lambda: [ours.decode(x) for x in ids], lambda: [ref.decode(x) for x in ids]),
            ("chat template render", lambda: [ours.apply_chat_template(c) for c in chats_n],
             lambda: [ref.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats_n]),
        ]
        print(f"tokenizer: {path if a.tokenizer else 'Qwen2-style BPE (16k) trained on wiki-18 sample'}; "
              f"{len(texts)} texts, {n_tok} tokens, best of {a.repeats}, {os.cpu_count()} CPUs")
        print(f"{'operation':28s} {'ours items/s':>14s} {'transformers':>14s} {'ratio':>7s}")
        for name, f_ours, f_ref in rows:
            r_o, r_r = rate(f_ours, len(texts), a.repeats), rate(f_ref, len(texts), a.repeats)
            print(f"{name:28s} {r_o:14,.0f} {r_r:14,.0f} {r_o / r_r:6.2f}x")


if __name__ == "__main__":
    main()
