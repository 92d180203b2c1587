"""Tiny random transformers Qwen2 models saved with save_pretrained, shared by the qwen2 model tests."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

# Non-default rope_theta / eps so a mapping mistake in config.json handling shows up in the logits.
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            head_dim=8, rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=128)
VARIANTS = {
    "tied_gqa4": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "untied_mha": dict(num_key_value_heads=4, tie_word_embeddings=False),
}


def make_hf_model(variant: str, seed: int = 0) -> "transformers.Qwen2ForCausalLM":
    """Random weights of O(0.1) everywhere, incl. q/k/v biases and norm gains (HF inits those to 0/1)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**BASE, **VARIANTS[variant])
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long))
    return out.logits.float().numpy()


def batch(seed: int = 1, B: int = 3, T: int = 12, V: int = 96):
    """Right-padded token batch with a mask (rows of length T, T-4, T-7)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    lengths = np.array([T, T - 4, T - 7][:B])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    return tokens * mask, mask
