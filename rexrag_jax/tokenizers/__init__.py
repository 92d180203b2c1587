"""Tokenizers: one `Tokenizer` interface over HF tokenizer.json and SentencePiece models.

    tok = load_tokenizer("path/to/Qwen2.5-3B")          # dir with tokenizer.json (+ tokenizer_config.json)
    tok = load_tokenizer("path/to/tokenizer.json")
    tok = load_tokenizer("path/to/demo.model")            # SentencePiece, built-in ChatML template
    ids = tok.encode("<search> x </search>")              # never adds BOS/EOS
    prompt = tok.apply_chat_template([{"role": "user", "content": q}])
"""
from __future__ import annotations

import os

from rexrag_jax.tokenizers.base import AGENT_TAGS, CHATML_TOKENS, Tokenizer
from rexrag_jax.tokenizers.chat_template import CHATML_TEMPLATE, render_chat_template
from rexrag_jax.tokenizers.hf import HFTokenizer
from rexrag_jax.tokenizers.spm import DEFAULT_USER_SYMBOLS, SentencePieceTokenizer, train_sentencepiece


def _exported_sentencepiece(folder: str) -> str | None:
    """The .model named by tokenizer_config.json's hf_export.MARKER (written by save_tokenizer_for_hf)."""
    import json

    from rexrag_jax.tokenizers.hf_export import MARKER

    cfg = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg, encoding="utf-8") as f:
            name = json.load(f).get(MARKER)
    except (OSError, ValueError, AttributeError):
        return None
    return os.path.join(folder, name) if isinstance(name, str) and os.path.isfile(os.path.join(folder, name)) else None


def load_tokenizer(path: str | os.PathLike, chat_template: str | None = None) -> Tokenizer:
    """Load a tokenizer from an HF checkpoint dir, a tokenizer.json file or a SentencePiece .model file.

    `chat_template` (Jinja source) overrides the template found beside the tokenizer.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        own = _exported_sentencepiece(path)  # our HF export of a SentencePiece model: read the model itself
        if own:
            return SentencePieceTokenizer(own, chat_template=chat_template)
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return HFTokenizer.from_dir(path, chat_template=chat_template)
        models = sorted(f for f in os.listdir(path) if f.endswith(".model"))
        if len(models) == 1:
            return SentencePieceTokenizer(os.path.join(path, models[0]), chat_template=chat_template)
        raise FileNotFoundError(f"{path}: expected tokenizer.json or exactly one SentencePiece *.model file, "
                                f"found {models or 'neither'}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if path.endswith(".json"):
        return HFTokenizer.from_file(path, chat_template=chat_template)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path, chat_template=chat_template)
    raise ValueError(f"{path}: unrecognised tokenizer file; expected a directory, tokenizer.json or a "
                     "SentencePiece .model file")


__all__ = ["AGENT_TAGS", "CHATML_TOKENS", "CHATML_TEMPLATE", "DEFAULT_USER_SYMBOLS", "HFTokenizer",
           "SentencePieceTokenizer", "Tokenizer", "load_tokenizer", "render_chat_template", "train_sentencepiece"]
