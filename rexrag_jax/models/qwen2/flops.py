"""Model FLOPs of the Qwen2 forward pass, counted the MFU way (PaLM appendix B; MaxText's
`calculate_tflops_training_per_device`): 2 FLOPs per multiply-add of every matmul on real tokens,
causal attention counted over the keys each query actually sees, no remat recompute, no elementwise ops.

Per token of a sequence, at position p (0-based, so the query sees p + 1 keys):
    dense   = 2 · L · (d·H·hd + 2·d·K·hd + H·hd·d + 3·d·I)      q, k, v, o projections and the SwiGLU MLP
    head    = 2 · d · V                                           the LM head (tied or not)
    attn(p) = 4 · L · H · hd · (p + 1)                            QKᵀ and AV
so a sequence of T tokens costs  T·(dense + head) + 4·L·H·hd·T(T+1)/2.
Training (forward + backward) = 3 × forward.
"""
from __future__ import annotations

from typing import Iterable

from rexrag_jax.models.qwen2.config import Qwen2Config


def dense_flops_per_token(cfg: Qwen2Config) -> int:
    """2 × the multiply-adds of the layers' weight matmuls for one token (all layers), LM head excluded."""
    d, h, k, hd, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return 2 * cfg.num_layers * (d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * i)


def forward_flops(cfg: Qwen2Config, lengths: Iterable[int]) -> int:
    """Forward FLOPs of independent causal sequences of the given lengths (packing does not change it:
    a packed segment attends within itself)."""
    per_token = dense_flops_per_token(cfg) + 2 * cfg.hidden_size * cfg.vocab_size
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    total = 0
    for t in lengths:
        t = int(t)
        total += t * per_token + attn * t * (t + 1) // 2
    return total


def train_flops(cfg: Qwen2Config, lengths: Iterable[int]) -> int:
    """Forward + backward: 3 × forward_flops."""
    return 3 * forward_flops(cfg, lengths)
