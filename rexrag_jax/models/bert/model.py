"""BERT encoder as pure functions over a params pytree (layers stacked on axis 0, run with lax.scan).

Params:
```
word_embed [V, D]; pos_embed [P, D]; type_embed [T, D]; embed_norm_scale [D]; embed_norm_bias [D]
layers: q_kernel/k_kernel/v_kernel [L, D, H, Hd]; q_bias/k_bias/v_bias [L, H, Hd];
        o_kernel [L, H, Hd, D]; o_bias [L, D]; attn_norm_scale/attn_norm_bias [L, D];
        ffn_in_kernel [L, D, F]; ffn_in_bias [L, F]; ffn_out_kernel [L, F, D]; ffn_out_bias [L, D];
        ffn_norm_scale/ffn_norm_bias [L, D]
```
Post-norm blocks as in BERT: h = LN(h + Attn(h)); h = LN(h + W2·act(W1·h)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rexrag_jax.models.bert.config import BertConfig

PARAM_LOGICAL_AXES = {
    "word_embed": ("vocab", "embed"), "pos_embed": (None, "embed"), "type_embed": (None, "embed"),
    "embed_norm_scale": ("embed",), "embed_norm_bias": ("embed",),
    "layers": {
        "q_kernel": ("layers", "embed", "heads", "head_dim"), "q_bias": ("layers", "heads", "head_dim"),
        "k_kernel": ("layers", "embed", "heads", "head_dim"), "k_bias": ("layers", "heads", "head_dim"),
        "v_kernel": ("layers", "embed", "heads", "head_dim"), "v_bias": ("layers", "heads", "head_dim"),
        "o_kernel": ("layers", "heads", "head_dim", "embed"), "o_bias": ("layers", "embed"),
        "attn_norm_scale": ("layers", "embed"), "attn_norm_bias": ("layers", "embed"),
        "ffn_in_kernel": ("layers", "embed", "mlp"), "ffn_in_bias": ("layers", "mlp"),
        "ffn_out_kernel": ("layers", "mlp", "embed"), "ffn_out_bias": ("layers", "embed"),
        "ffn_norm_scale": ("layers", "embed"), "ffn_norm_bias": ("layers", "embed"),
    },
}


def init_params(cfg: BertConfig, rng: jax.Array, std: float = 0.02) -> dict:
    """Random params (normal(0, std) kernels/embeddings, zero biases, unit norms), float32."""
    L, D, H, Hd, F = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    keys = iter(jax.random.split(rng, 16))
    n = lambda *shape: std * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    z, o = (lambda *s: jnp.zeros(s, jnp.float32)), (lambda *s: jnp.ones(s, jnp.float32))
    return {
        "word_embed": n(cfg.vocab_size, D), "pos_embed": n(cfg.max_position_embeddings, D),
        "type_embed": n(cfg.type_vocab_size, D), "embed_norm_scale": o(D), "embed_norm_bias": z(D),
        "layers": {
            "q_kernel": n(L, D, H, Hd), "q_bias": z(L, H, Hd), "k_kernel": n(L, D, H, Hd), "k_bias": z(L, H, Hd),
            "v_kernel": n(L, D, H, Hd), "v_bias": z(L, H, Hd), "o_kernel": n(L, H, Hd, D), "o_bias": z(L, D),
            "attn_norm_scale": o(L, D), "attn_norm_bias": z(L, D),
            "ffn_in_kernel": n(L, D, F), "ffn_in_bias": z(L, F), "ffn_out_kernel": n(L, F, D),
            "ffn_out_bias": z(L, D), "ffn_norm_scale": o(L, D), "ffn_norm_bias": z(L, D),
        },
    }


def layer_norm(x, scale, bias, eps):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, statistics in float32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def _act(x, name):
    return jax.nn.gelu(x, approximate=name != "gelu")


def _block(h, p, bias, cfg: BertConfig):
    """One post-norm transformer block; `bias` [B, 1, 1, T] is 0 for real keys, -inf-like for padding."""
    dt = h.dtype
    c = lambda w: w.astype(dt)  # noqa: E731
    q = jnp.einsum("btd,dhk->bhtk", h, c(p["q_kernel"])) + c(p["q_bias"])[None, :, None, :]
    k = jnp.einsum("btd,dhk->bhtk", h, c(p["k_kernel"])) + c(p["k_bias"])[None, :, None, :]
    v = jnp.einsum("btd,dhk->bhtk", h, c(p["v_kernel"])) + c(p["v_bias"])[None, :, None, :]
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, k).astype(jnp.float32) / np.sqrt(cfg.head_dim) + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    ctx = jnp.einsum("bhqs,bhsk->bhqk", probs, v)
    attn = jnp.einsum("bhqk,hkd->bqd", ctx, c(p["o_kernel"])) + c(p["o_bias"])
    h = layer_norm(h + attn, p["attn_norm_scale"], p["attn_norm_bias"], cfg.layer_norm_eps)
    ff = _act(jnp.einsum("btd,df->btf", h, c(p["ffn_in_kernel"])) + c(p["ffn_in_bias"]), cfg.hidden_act)
    ff = jnp.einsum("btf,fd->btd", ff, c(p["ffn_out_kernel"])) + c(p["ffn_out_bias"])
    return layer_norm(h + ff, p["ffn_norm_scale"], p["ffn_norm_bias"], cfg.layer_norm_eps)


def forward(params: dict, input_ids, attention_mask, cfg: BertConfig, token_type_ids=None):
    """Last hidden states [B, T, D] for right- or left-padded `input_ids` [B, T] (mask 1 = real token).

    Positions are 0..T-1 as in HF BertModel (padding is expected on the right).
    """
    B, T = input_ids.shape
    if T > cfg.max_position_embeddings:
        raise ValueError(f"sequence length {T} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    dt = jnp.dtype(cfg.dtype)
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    h = (params["word_embed"][input_ids] + params["pos_embed"][:T][None]
         + params["type_embed"][token_type_ids])
    h = layer_norm(h, params["embed_norm_scale"], params["embed_norm_bias"], cfg.layer_norm_eps).astype(dt)
    neg = jnp.finfo(jnp.float32).min
    bias = jnp.where(attention_mask[:, None, None, :].astype(bool), 0.0, neg).astype(jnp.float32)

    def step(h, p):
        return _block(h, p, bias, cfg), None

    h, _ = jax.lax.scan(step, h, params["layers"])
    return h


def mean_pool(hidden, attention_mask):
    """sum_t mask_t · h_t / max(sum_t mask_t, 1e-9): the sentence-transformers mean pooling."""
    m = attention_mask.astype(jnp.float32)[..., None]
    return (hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)


def l2_normalize(x, eps: float = 1e-12):
    """x / max(||x||_2, eps), as torch.nn.functional.normalize."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def embed(params: dict, input_ids, attention_mask, cfg: BertConfig, normalize: bool = True):
    """Sentence embeddings [B, D] float32: mean pooling over the mask, then (optionally) L2 normalisation."""
    pooled = mean_pool(forward(params, input_ids, attention_mask, cfg), attention_mask)
    return l2_normalize(pooled) if normalize else pooled
