"""Qwen2 / Qwen2.5 model configuration with presets per size."""
from __future__ import annotations

import dataclasses
from typing import Any

import gin

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # compute / activation dtype
    param_dtype: str = "float32"
    remat: bool = False  # rematerialise each decoder layer in the backward pass

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Qwen2Config.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Qwen2Config.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Qwen2Config.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"Qwen2Config.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **kw) -> "Qwen2Config":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "Qwen2Config":
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown Qwen2 preset {name!r}; expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[key], **overrides)

    # --- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json", **overrides) -> "Qwen2Config":
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type not in (None, "qwen2") or (archs and not any(a.startswith("Qwen2") for a in archs)):
            raise ValueError(f"{source}: unsupported architecture (model_type={model_type!r}, "
                             f"architectures={archs!r}); expected model_type 'qwen2' / Qwen2ForCausalLM")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing} needed for a Qwen2 model")
        # Features this decoder does not implement: refuse rather than silently compute something else.
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: unsupported hidden_act={d['hidden_act']!r}; expected 'silu'")
        if d.get("use_sliding_window", False):
            raise ValueError(f"{source}: unsupported use_sliding_window=true (sliding-window attention is not "
                             "implemented); expected false")
        rope_params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type not in (None, "default"):
            field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
            raise ValueError(f"{source}: unsupported {field}.rope_type={rope_type!r}; only plain RoPE "
                             "('default') is implemented")
        heads = int(d["num_attention_heads"])
        kw = dict(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rope_theta=float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,  # transformers < 5
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},  # transformers >= 5
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }


PRESETS: dict[str, Qwen2Config] = {
    # Test sizes: tiny enough to compile in seconds on CPU.
    "tiny": Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                        max_position_embeddings=2048),
    "small": Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, rope_theta=10000.0, tie_word_embeddings=True,
                         max_position_embeddings=4096),
    "qwen2.5-0.5b": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                                num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-1.5b": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-3b": Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                              num_heads=16, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
}


@gin.configurable
def model_config(preset: str = gin.REQUIRED, dtype: str = "float32", param_dtype: str = "float32",
                 remat: bool = False, **overrides) -> Qwen2Config:
    """gin entry point: `model_config.preset = %MODEL_PRESET` in gin/model/*.gin."""
    return Qwen2Config.from_preset(preset, dtype=dtype, param_dtype=param_dtype, remat=remat, **overrides)
