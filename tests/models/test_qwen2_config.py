"""config.json <-> Qwen2Config: presets survive a trip through transformers' Qwen2Config."""
import pytest
import transformers

from rexrag_jax.models.qwen2.config import PRESETS, Qwen2Config

# A Qwen2.5-3B config.json in the transformers 4.x layout (top-level rope_theta, sliding_window fields).
QWEN25_3B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 32768, "max_window_layers": 36,
    "model_type": "qwen2", "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_published_qwen25_config_maps_to_preset():
    assert Qwen2Config.from_hf_dict(QWEN25_3B) == PRESETS["qwen2.5-3b"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_roundtrip_through_transformers(name):
    cfg = PRESETS[name]
    hf = transformers.Qwen2Config(**cfg.to_hf_dict())
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.head_dim == cfg.head_dim and hf.num_key_value_heads == cfg.num_kv_heads
    assert Qwen2Config.from_hf_dict(hf.to_dict()) == cfg
