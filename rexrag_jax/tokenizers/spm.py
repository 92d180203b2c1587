"""SentencePiece tokenizers (small demo / synthetic-world models) with a built-in ChatML template.

Models trained by `train_sentencepiece` behave like Qwen's byte-level BPE where it matters for rollouts:
identity normalisation, no dummy-prefix space, whitespace kept verbatim, byte fallback (any text round-trips
exactly, newlines included), no BOS; `<|im_start|>`, `<|im_end|>` and the agent tags are user-defined
symbols, i.e. always single tokens; `<|endoftext|>` is EOS.
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterable, Sequence

import sentencepiece as spm

from rexrag_jax.tokenizers.base import AGENT_TAGS, CHATML_TOKENS, Tokenizer
from rexrag_jax.tokenizers.chat_template import CHATML_TEMPLATE

DEFAULT_USER_SYMBOLS = CHATML_TOKENS + AGENT_TAGS
EOS_PIECE = "<|endoftext|>"


def _is_chat_control(piece: str) -> bool:
    """ChatML markers (<|...|>) count as special tokens, like Qwen's added tokens; agent tags do not."""
    return piece.startswith("<|") and piece.endswith("|>")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str | os.PathLike, chat_template: str | None = None):
        self.path = os.fspath(model_path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.path}: not a loadable SentencePiece model: {e}") from e
        self.chat_template = chat_template if chat_template is not None else CHATML_TEMPLATE
        n = self._sp.GetPieceSize()
        # Special ids: control pieces (eos/bos/pad) and ChatML markers; dropped by skip_special_tokens.
        self._special = {i for i in range(n)
                         if self._sp.IsControl(i) or _is_chat_control(self._sp.IdToPiece(i))}
        im_end = self.token_to_id("<|im_end|>")
        eos = self._sp.eos_id()
        if eos < 0 and im_end is None:
            raise ValueError(f"{self.path}: the model defines neither an EOS piece nor <|im_end|>")
        self._eos_ids = [i for i in (eos if eos >= 0 else None, im_end) if i is not None]
        self._pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._eos_ids[0]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return list(self._sp.EncodeAsIds(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch expects a list of str")
        return [list(x) for x in self._sp.Encode(texts, out_type=int)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Decode; control pieces (which SentencePiece itself renders as "") are written out as their piece
        text unless skipped, so decode(encode(x)) == x and a trajectory shows where EOS was."""
        out, run = [], []
        for i in (int(t) for t in ids):
            if not 0 <= i < self._sp.GetPieceSize():
                raise ValueError(f"decode: token id {i} outside the vocabulary (size {self.vocab_size})")
            if i in self._special:
                if skip_special_tokens:
                    continue
                if self._sp.IsControl(i):
                    out.append(self._sp.DecodeIds(run))
                    out.append(self._sp.IdToPiece(i))
                    run = []
                    continue
            run.append(i)
        out.append(self._sp.DecodeIds(run))
        return "".join(out)

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def eos_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def pad_id(self) -> int:
        return self._pad

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.PieceToId(token)
        # PieceToId maps unknown pieces to unk; only report unk for the unk piece itself.
        return None if i == self._sp.unk_id() and token != self._sp.IdToPiece(i) else i

    def id_to_token(self, token_id: int) -> str | None:
        return self._sp.IdToPiece(int(token_id)) if 0 <= int(token_id) < self.vocab_size else None

    def special_tokens_map(self) -> dict[str, str]:
        return {"eos_token": self._sp.IdToPiece(self.eos_id), "pad_token": self._sp.IdToPiece(self.pad_id)}

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def train_sentencepiece(lines: Iterable[str], out_prefix: str | os.PathLike, vocab_size: int,
                        user_symbols: Sequence[str] = DEFAULT_USER_SYMBOLS, model_type: str = "bpe",
                        byte_fallback: bool = True, num_threads: int = 2) -> str:
    """Train a SentencePiece model on `lines`; writes `{out_prefix}.model` / `.vocab` and returns the .model path.

    Ids: 0 = <unk>, 1 = <|endoftext|> (EOS), then `user_symbols` in order, then (with byte_fallback) the 256
    byte pieces, then learned pieces. `vocab_size` is an upper bound (hard_vocab_limit=False) so tiny corpora
    do not fail. Files are written under a temporary prefix and renamed, so a failed run leaves any previous
    model intact.
    """
    out_prefix = os.fspath(out_prefix)
    symbols = list(dict.fromkeys(user_symbols))
    bad = [s for s in symbols if not s or s in ("<unk>", EOS_PIECE)]
    if bad:
        raise ValueError(f"train_sentencepiece: user_symbols {bad!r} are empty or clash with <unk>/{EOS_PIECE}")
    minimum = 2 + len(symbols) + (256 if byte_fallback else 0) + 1
    if vocab_size < minimum:
        raise ValueError(f"train_sentencepiece: vocab_size={vocab_size} is too small; need at least {minimum} "
                         f"(2 reserved + {len(symbols)} user symbols" + (" + 256 bytes" if byte_fallback else "")
                         + " + 1 learned piece)")
    lines = [ln for ln in (str(x).rstrip("\n") for x in lines) if ln]
    if not lines:
        raise ValueError("train_sentencepiece: no non-empty training lines")
    out_dir = os.path.dirname(os.path.abspath(out_prefix))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".spm_tmp_") as tmp:
        tmp_prefix = os.path.join(tmp, "m")
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(lines), model_prefix=tmp_prefix, vocab_size=vocab_size, model_type=model_type,
            user_defined_symbols=symbols, unk_id=0, eos_id=1, eos_piece=EOS_PIECE, bos_id=-1, pad_id=-1,
            normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=byte_fallback,
            character_coverage=1.0, hard_vocab_limit=False, num_threads=num_threads,
            minloglevel=2, train_extremely_large_corpus=False)
        for ext in (".model", ".vocab"):
            os.replace(tmp_prefix + ext, out_prefix + ext)
    return out_prefix + ".model"
