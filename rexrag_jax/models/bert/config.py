"""BERT-family encoder configuration (E5, MiniLM, any HF `BertModel`)."""
from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"          # "gelu" = exact erf GELU (HF); "gelu_new"/"gelu_pytorch_tanh" = tanh form
    pad_token_id: int = 0
    dtype: str = "float32"            # compute dtype of activations; params stay as loaded

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported; expected one of {sorted(_ACTS)}")

    @classmethod
    def from_preset(cls, name: str) -> "BertConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; expected one of {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> "BertConfig":
        """Map an HF BertConfig dict (config.json) onto this config."""
        if d.get("model_type", "bert") not in ("bert",):
            raise ValueError(f"{where}: model_type {d.get('model_type')!r} is not a BERT model")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{where}: only absolute position embeddings are supported")
        try:
            return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
                       intermediate_size=d["intermediate_size"],
                       max_position_embeddings=d.get("max_position_embeddings", 512),
                       type_vocab_size=d.get("type_vocab_size", 2),
                       layer_norm_eps=d.get("layer_norm_eps", 1e-12),
                       hidden_act=d.get("hidden_act", "gelu"), pad_token_id=d.get("pad_token_id", 0) or 0)
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from None

    @classmethod
    def from_hf_dir(cls, model_dir: str | os.PathLike) -> "BertConfig":
        path = os.path.join(os.fspath(model_dir), "config.json")
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), where=path)


_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")

PRESETS = {
    "tiny": BertConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                       max_position_embeddings=64),
    "minilm-l6": BertConfig(hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536),
    "e5-small-v2": BertConfig(hidden_size=384, num_layers=12, num_heads=12, intermediate_size=1536),
    "e5-base-v2": BertConfig(),
    "e5-large-v2": BertConfig(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
}
