"""Hugging Face `tokenizer.json` tokenizers (Qwen2.5, Llama-3, ...) through the `tokenizers` library.

Metadata is read the way transformers resolves it:
- special tokens (bos/eos/pad/unk/...) from tokenizer_config.json; eos/pad ids fall back to
  generation_config.json and then config.json `eos_token_id` / `pad_token_id` (eos_ids = their union, so
  Qwen instruct stops on both <|im_end|> and <|endoftext|>), and pad to eos;
- the chat template from chat_template.jinja (takes priority, as in transformers) or tokenizer_config.json
  `chat_template` (a string, or a list of {"name", "template"} of which "default" is used).
Decoding returns the exact text (`clean_up_tokenization_spaces` is not applied: transformers skips it for
BPE models too, and RL needs the exact bytes the policy produced).
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from tokenizers import Tokenizer as _HFBackend

from rexrag_jax.tokenizers.base import Tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_FALLBACK_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, source: str, field: str) -> str | None:
    """A special-token entry is a string or an AddedToken dict {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{source}: field {field!r} must be a string or {{'content': str}}, got {value!r}")


def _as_id_list(value: Any, source: str, field: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: field {field!r} must be an int or a list of ints, got {value!r}")
    return list(values)


def _select_template(value: Any, source: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{source}: chat_template is a list without a 'default' entry (names: {sorted(named)})")
    raise ValueError(f"{source}: chat_template must be a string or a list of {{name, template}}, got {type(value)}")


class HFTokenizer(Tokenizer):
    def __init__(self, backend: _HFBackend, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None, extra_eos_ids: Sequence[int] = (), pad_id: int | None = None,
                 source: str = "tokenizer.json"):
        self._tok = backend
        self._size = backend.get_vocab_size(with_added_tokens=True)
        self._source = source
        self._special = dict(special_tokens or {})
        self.chat_template = chat_template
        for name, content in self._special.items():
            if backend.token_to_id(content) is None:
                raise ValueError(f"{source}: {name} {content!r} is not in the vocabulary of the tokenizer")
        eos = [backend.token_to_id(self._special["eos_token"])] if "eos_token" in self._special else []
        eos += [i for i in extra_eos_ids if i not in eos]
        if not eos:
            found = [backend.token_to_id(t) for t in _FALLBACK_EOS if backend.token_to_id(t) is not None]
            if not found:
                raise ValueError(f"{source}: no eos token: set eos_token in tokenizer_config.json or eos_token_id in "
                                 f"generation_config.json (none of {_FALLBACK_EOS} is in the vocabulary either)")
            eos = found[:1]
        self._eos_ids = eos
        if "pad_token" in self._special:
            pad_id = backend.token_to_id(self._special["pad_token"])
        self._pad_id = eos[0] if pad_id is None else pad_id
        self._special_ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    # --- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str, chat_template: str | None = None) -> "HFTokenizer":
        return cls.from_file(os.path.join(path, "tokenizer.json"), chat_template=chat_template)

    @classmethod
    def from_file(cls, tokenizer_json: str, chat_template: str | None = None) -> "HFTokenizer":
        """Load tokenizer.json plus whatever config files sit beside it."""
        folder = os.path.dirname(os.path.abspath(tokenizer_json))
        try:
            backend = _HFBackend.from_file(tokenizer_json)
        except Exception as e:  # the Rust side raises plain Exception with a serde message
            raise ValueError(f"{tokenizer_json}: not a valid tokenizers JSON file: {e}") from e
        tc_path = os.path.join(folder, "tokenizer_config.json")
        tc = _read_json(tc_path)
        gen_path, cfg_path = os.path.join(folder, "generation_config.json"), os.path.join(folder, "config.json")
        gen, cfg = _read_json(gen_path), _read_json(cfg_path)

        # Names visible to the chat template: only what tokenizer_config.json sets (as in transformers).
        special = {}
        for name in _SPECIAL_NAMES:
            content = _token_content(tc.get(name), tc_path, name)
            if content is not None:
                special[name] = content
        # Ids: the model configs stand in for eos/pad when tokenizer_config.json does not name them.
        extra_eos, pad_id = [], None
        for src, d in ((gen_path, gen), (cfg_path, cfg)):
            extra_eos += _as_id_list(d.get("eos_token_id"), src, "eos_token_id")
            pads = _as_id_list(d.get("pad_token_id"), src, "pad_token_id")
            if pad_id is None and pads:
                pad_id = pads[0]
        size = backend.get_vocab_size(with_added_tokens=True)
        for i in extra_eos + ([pad_id] if pad_id is not None else []):
            if not 0 <= i < size:
                raise ValueError(f"{folder}: eos/pad token id {i} in generation_config.json/config.json is outside "
                                 f"the tokenizer vocabulary (size {size})")

        if chat_template is None:
            jinja_path = os.path.join(folder, "chat_template.jinja")
            if os.path.exists(jinja_path):
                with open(jinja_path, encoding="utf-8") as f:
                    chat_template = f.read()
            else:
                chat_template = _select_template(tc.get("chat_template"), tc_path)
        return cls(backend, special, chat_template, extra_eos_ids=extra_eos, pad_id=pad_id, source=tokenizer_json)

    # --- interface -------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Batched encode (parallel in Rust): same ids as [encode(t) for t in texts]."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(map(int, ids))
        # The Rust decoder silently drops unknown ids; a model whose embedding is larger than the
        # vocabulary (Qwen: 151936 vs 151665) can sample them, so say so instead of losing text.
        if ids and (min(ids) < 0 or max(ids) >= self._size):
            bad = [i for i in ids if not 0 <= i < self._size]
            raise ValueError(f"decode: token id(s) {bad[:5]} outside the vocabulary (size {self._size}) of "
                             f"{self._source}")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eos_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def special_ids(self) -> dict[str, int]:
        """Added tokens marked special (dropped by decode(skip_special_tokens=True))."""
        return dict(self._special_ids)

    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    def __repr__(self) -> str:
        return f"HFTokenizer({self._source!r}, vocab_size={self.vocab_size}, eos_ids={self._eos_ids})"
