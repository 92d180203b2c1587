"""Test stand-ins: a toy tokenizer with a boundary-straddling piece, a scripted engine with the
GenerationEngine API, and an in-memory retriever that logs its calls."""
from __future__ import annotations

from rexrag_jax.generation.engine import GenOut
from rexrag_jax.generation.stops import find_stop_cut

SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "</answer>"]
# " <" straddles the text boundary before "<answer>": " <answer>" tokenizes as " <", "a", "n", ... so
# the probe splice must drop that token and re-append the space.
MULTI = ["Doc ", "(Title: ", " <", "My action is invalid. "]


class ToyTokenizer:
    """Greedy longest-match over a fixed piece list (specials, tags, a few words, printable ASCII)."""

    def __init__(self):
        self.pieces = SPECIALS + TAGS + MULTI + [chr(c) for c in range(32, 127)] + ["\n"]
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.maxlen = max(len(p) for p in self.pieces)

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.maxlen, len(text) - i), 0, -1):
                tid = self.ids.get(text[i:i + n])
                if tid is not None and (n > 1 or tid >= len(SPECIALS)):
                    out.append(tid)
                    i += n
                    break
            else:
                raise ValueError(f"ToyTokenizer cannot encode {text[i]!r}")
        return out

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i < len(SPECIALS)))

    vocab_size = property(lambda self: len(self.pieces))
    eos_id = property(lambda self: 1)
    eos_ids = property(lambda self: [1])
    pad_id = property(lambda self: 0)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def fake_logprob(position: int) -> float:
    """The scripted engine reports this log-prob for a token generated at cache slot `position`."""
    return -(position + 1) / 1000.0


class ScriptedEngine:
    """GenerationEngine API over host lists. `responder(row, context_text, context_tokens)` returns the
    turn's output as text (tokenized) or a token list; the stop-string cut mirrors the real engine."""

    def __init__(self, tokenizer, responder, batch_size, max_len=100_000,
                 stop_strings=("</search>", "</answer>")):
        self.tok, self.responder = tokenizer, responder
        self.batch_size, self.max_len = batch_size, max_len
        self.stop_strings = stop_strings
        self.cache = [[] for _ in range(batch_size)]
        self.log = []  # (op, args) for assertions

    def lengths(self):
        return [len(c) for c in self.cache]

    def reset(self, rows=None):
        rows = range(self.batch_size) if rows is None else rows
        self.log.append(("reset", tuple(rows)))
        for r in rows:
            self.cache[r] = []

    def truncate(self, row, length):
        assert 0 <= length <= len(self.cache[row])
        self.log.append(("truncate", row, length))
        self.cache[row] = self.cache[row][:length]

    def copy_prefix(self, src, dst, length):
        assert 0 <= length <= len(self.cache[src])
        self.log.append(("copy_prefix", src, dst, length))
        self.cache[dst] = list(self.cache[src][:length])

    def append(self, rows, token_lists):
        assert len(set(rows)) == len(rows)
        self.log.append(("append", tuple(rows), tuple(len(t) for t in token_lists)))
        for r, toks in zip(rows, token_lists):
            assert len(self.cache[r]) + len(toks) <= self.max_len
            self.cache[r] = self.cache[r] + list(toks)

    def generate(self, rows, max_new_tokens, rng, temperature=1.0, top_p=1.0, greedy=False):
        self.log.append(("generate", tuple(rows)))
        outs = []
        for r in rows:
            assert self.cache[r], f"row {r} empty"
            out = self.responder(r, self.tok.decode(self.cache[r]), list(self.cache[r]))
            toks = self.tok.encode(out) if isinstance(out, str) else list(out)
            toks = toks[:max_new_tokens]
            reason = "length"
            if self.tok.eos_id in toks:
                toks = toks[: toks.index(self.tok.eos_id) + 1]
                reason = "eos"
            cut = find_stop_cut(toks, self.tok.decode, self.stop_strings, blocks=True)  # engine stop_blocks
            if cut is not None:
                keep, text = cut
                toks, reason = toks[:keep], "stop"
            else:
                text = self.tok.decode(toks)
            start = len(self.cache[r])
            lps = [fake_logprob(start + i) for i in range(len(toks))]
            self.cache[r] = self.cache[r] + toks
            outs.append(GenOut(toks, lps, reason, text, lps))
        return outs


class FakeRetriever:
    """Deterministic hits: for query q, k-th doc contents = '"Title q k"\\nbody of q k'."""

    def __init__(self):
        self.calls = []

    def search(self, queries, topk=3):
        self.calls.append((list(queries), topk))
        return [[{"document": {"id": f"{q}-{k}", "contents": f'"Title {q} {k}"\nbody of {q} {k}'},
                  "score": 1.0 / (k + 1)} for k in range(topk)] for q in queries]


def question_of(context_text: str) -> str:
    return context_text.split("Question: ", 1)[1].split("\n", 1)[0]


__all__ = ["ToyTokenizer", "ScriptedEngine", "FakeRetriever", "fake_logprob", "question_of"]
