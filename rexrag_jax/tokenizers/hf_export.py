"""Tokenizer files for an HF-format export, so `transformers.AutoTokenizer.from_pretrained(export)` gives
exactly our ids and `apply_chat_template` renders exactly our prompt text.

    save_tokenizer_for_hf(tokenizer_path, out_dir)

tokenizer_path is one of
- a SentencePiece `.model` (the demo's, trained by `train_sentencepiece`): written as `tokenizer.model`
  (what our own `load_tokenizer(export)` reads, see MARKER) plus a `tokenizer.json` converted from it:
  BPE over the SentencePiece vocabulary and merges (merge rank = the merged piece's score order, which
  is SentencePiece's BPE merge order), byte fallback, " " -> "▁" without a dummy prefix, SentencePiece's
  word split (a word is a run of "▁" followed by non-"▁" characters), the user-defined symbols (ChatML
  markers, agent tags) and control pieces as added tokens (ChatML markers and control pieces special),
  no BOS/EOS added. `tokenizer_config.json` (class PreTrainedTokenizerFast, eos/pad/unk, the chat
  template), `special_tokens_map.json` and `chat_template.jinja` go beside it.
- a `tokenizer.json` file or a directory holding one (an HF checkpoint's tokenizer): it is copied with
  the config files found beside it (tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
  vocab.json, merges.txt, added_tokens.json, tokenizer.model, tokenization_rexrag.py).

A full policy export (config.json with model_type "qwen2"): transformers 5.x (checked with 5.25) lists
"qwen2" in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, so AutoTokenizer ignores tokenizer_class and would
rebuild a byte-level Qwen2Tokenizer from the vocabulary, which mis-tokenizes a SentencePiece vocabulary.
The SentencePiece export therefore declares its class in tokenizer_config.json's `auto_map` (AutoTokenizer
-> `tokenization_rexrag.RexragTokenizerFast`, a PreTrainedTokenizerFast subclass written beside it, see
REMOTE_CLASS_FILE). transformers then loads tokenizer.json as it is: with trust_remote_code=True through
that class, without it (its default) as TokenizersBackend, because it skips remote tokenizer code for these
model types and falls back to tokenizer_class. Both give exactly our ids (tested).

One difference stays: a literal control-piece text such as "<|endoftext|>" inside the input is one special token in transformers (as
with Qwen's own tokenizer) but plain characters to SentencePiece.
"""
from __future__ import annotations

import json
import os
import shutil

MARKER = "rexrag_jax_tokenizer"  # tokenizer_config.json key: the file our load_tokenizer(dir) reads
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model", "tokenization_rexrag.py")
# tokenizer_config.json's auto_map target: tokenizer.json as it is, whatever model_type config.json names
REMOTE_CLASS_FILE = "tokenization_rexrag.py"
REMOTE_CLASS = "RexragTokenizerFast"
_REMOTE_CLASS_SOURCE = f'''"""rexrag_jax export: the tokenizer is tokenizer.json as written (a converted SentencePiece BPE).
Declared in tokenizer_config.json's auto_map so that AutoTokenizer does not rebuild a byte-level
Qwen2Tokenizer for this model_type="qwen2" directory."""
from transformers import PreTrainedTokenizerFast


class {REMOTE_CLASS}(PreTrainedTokenizerFast):
    pass
'''
_WORD_SPLIT = "▁*[^▁]+|▁+"  # SentencePiece SplitIntoWords with allow_whitespace_only_pieces


def save_tokenizer_for_hf(tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Write the tokenizer files of an HF export into out_dir (see module docstring); returns their names."""
    tokenizer_path, out_dir = os.fspath(tokenizer_path), os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if os.path.isdir(tokenizer_path) or tokenizer_path.endswith(".json"):
        folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))
        src = tokenizer_path if tokenizer_path.endswith(".json") else os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(src):
            raise FileNotFoundError(f"{tokenizer_path}: no tokenizer.json to export")
        written = []
        for name in _HF_FILES:
            path = src if name == "tokenizer.json" else os.path.join(folder, name)
            if os.path.isfile(path):
                shutil.copy(path, os.path.join(out_dir, name))
                written.append(name)
        return written
    if not tokenizer_path.endswith(".model"):
        raise ValueError(f"{tokenizer_path}: expected a SentencePiece .model, a tokenizer.json or a directory")
    return _save_sentencepiece(tokenizer_path, out_dir)


def sentencepiece_to_tokenizer_json(model_path: str) -> dict:
    """The tokenizers-library JSON of a BPE SentencePiece model (see module docstring)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise ValueError(f"{model_path}: only BPE SentencePiece models are converted for HF export")
    T = sentencepiece_model_pb2.ModelProto.SentencePiece
    pieces = [p.piece for p in proto.pieces]
    kinds = [p.type for p in proto.pieces]
    scores = [p.score for p in proto.pieces]
    n = len(pieces)
    unk_id = kinds.index(T.UNKNOWN)
    vocab = {p: i for i, p in enumerate(pieces)}
    mergeable = {p for p, k in zip(pieces, kinds) if k in (T.NORMAL, T.BYTE)}
    merges = []
    for i in sorted((i for i in range(n) if kinds[i] == T.NORMAL), key=lambda i: (-scores[i], i)):
        p = pieces[i]  # SentencePiece BPE merges the adjacent pair whose union scores highest
        merges += [(p[:k], p[k:]) for k in range(1, len(p)) if p[:k] in mergeable and p[k:] in mergeable]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=pieces[unk_id], byte_fallback=True,
                               fuse_unk=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_WORD_SPLIT), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = []
    for i in range(n):
        if kinds[i] in (T.CONTROL, T.UNKNOWN, T.USER_DEFINED):
            special = kinds[i] != T.USER_DEFINED or (pieces[i].startswith("<|") and pieces[i].endswith("|>"))
            added.append(AddedToken(pieces[i], special=special, normalized=False, single_word=False,
                                    lstrip=False, rstrip=False))
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    return json.loads(tok.to_str())


def _save_sentencepiece(model_path: str, out_dir: str) -> list[str]:
    from rexrag_jax.tokenizers.spm import SentencePieceTokenizer

    ours = SentencePieceTokenizer(model_path)
    shutil.copy(model_path, os.path.join(out_dir, "tokenizer.model"))
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(sentencepiece_to_tokenizer_json(model_path), f, ensure_ascii=False)
    special = {k: v for k, v in ours.special_tokens_map().items()}
    special["unk_token"] = ours.id_to_token(0)
    added = {}
    for i in range(ours.vocab_size):
        piece = ours.id_to_token(i)
        if i in ours._special or piece in ("<unk>",):
            added[str(i)] = {"content": piece, "special": True, "normalized": False, "lstrip": False,
                             "rstrip": False, "single_word": False}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False, "legacy": False,
              "model_max_length": 131072, "bos_token": None, **special, "chat_template": ours.chat_template,
              "added_tokens_decoder": added, MARKER: "tokenizer.model",
              "auto_map": {"AutoTokenizer": [None, f"{REMOTE_CLASS_FILE[:-3]}.{REMOTE_CLASS}"]}}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(ours.chat_template)
    with open(os.path.join(out_dir, REMOTE_CLASS_FILE), "w", encoding="utf-8") as f:
        f.write(_REMOTE_CLASS_SOURCE)
    return ["tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", REMOTE_CLASS_FILE]
