"""Qwen2 / Qwen2.5 decoder as pure functions over a params pytree.

GQA attention with q/k/v biases, RoPE (rotate-half, configurable theta), RMSNorm, SwiGLU MLP, tied or
untied embeddings. Decoder layers are stacked on axis 0 (one compiled layer, fast compiles for 36-layer
models). The same function serves training (full sequences, no cache: `lax.scan` over the layers, with
remat) and generation (a per-row KV cache carried through a `fori_loop` over the layers; see `forward`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.sharding.rules import constrain

Params = dict[str, Any]

# Logical axis names of every parameter (leading "layers" axis for the stacked decoder layers).
PARAM_LOGICAL_AXES: Params = {
    "embed": ("vocab", "embed"),
    "layers": {
        "attn_norm": ("layers", "norm"),
        "q_kernel": ("layers", "embed", "heads", "head_dim"),
        "q_bias": ("layers", "heads", "head_dim"),
        "k_kernel": ("layers", "embed", "kv_heads", "head_dim"),
        "k_bias": ("layers", "kv_heads", "head_dim"),
        "v_kernel": ("layers", "embed", "kv_heads", "head_dim"),
        "v_bias": ("layers", "kv_heads", "head_dim"),
        "o_kernel": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "norm"),
        "gate_kernel": ("layers", "embed", "mlp"),
        "up_kernel": ("layers", "embed", "mlp"),
        "down_kernel": ("layers", "mlp", "embed"),
    },
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}

CACHE_LOGICAL_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
# On CPU, cached calls with at most this many new tokens per row use `_attention_decode`.
DECODE_ATTENTION_MAX_T = 1


def param_shapes(cfg: Qwen2Config) -> Params:
    L, D, H, KV, Hd, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                             cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    shapes = {
        "embed": (V, D),
        "layers": {
            "attn_norm": (L, D), "q_kernel": (L, D, H, Hd), "q_bias": (L, H, Hd),
            "k_kernel": (L, D, KV, Hd), "k_bias": (L, KV, Hd), "v_kernel": (L, D, KV, Hd),
            "v_bias": (L, KV, Hd), "o_kernel": (L, H, Hd, D), "mlp_norm": (L, D),
            "gate_kernel": (L, D, F), "up_kernel": (L, D, F), "down_kernel": (L, F, D),
        },
        "final_norm": (D,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def param_logical_axes(cfg: Qwen2Config) -> Params:
    axes = {k: v for k, v in PARAM_LOGICAL_AXES.items() if k != "lm_head"}
    if not cfg.tie_word_embeddings:
        axes["lm_head"] = PARAM_LOGICAL_AXES["lm_head"]
    return axes


def init_params(cfg: Qwen2Config, rng: jax.Array, std: float = 0.02) -> Params:
    """Random init (normal(std) matrices, zero biases, unit norms); for tests and from-scratch runs."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(rng, len(leaves))
    dtype = jnp.dtype(cfg.param_dtype)
    out = []
    for path, shape, key in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        elif "bias" in path:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def init_cache(cfg: Qwen2Config, batch: int, max_len: int) -> dict[str, jax.Array]:
    """Empty KV cache: k/v [L, B, S, KV, Hd] in the compute dtype, lengths [B] = 0."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
            "lengths": jnp.zeros((batch,), jnp.int32)}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 like HF."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE: x*cos + rotate_half(x)*sin, inv_freq_i = theta^(-2i/d). x [B,T,N,Hd]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,Hd/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _attention(q, k, v, mask, cfg: Qwen2Config):
    """GQA softmax attention. q [B,T,H,Hd]; k,v [B,S,KV,Hd]; mask [B,T,S] bool."""
    B, T, H, Hd = q.shape
    qg = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, Hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(Hd)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, H, Hd)


def _attention_decode(q, k, v, mask, cfg: Qwen2Config):
    """_attention for a few query tokens (decode), reading the cache in its stored [B,S,KV,Hd] layout.

    K and V are viewed (free reshape) as [B, S*KV, Hd], so both products are plain batched matmuls:
      full[b,h,(s,j)] = q[b,h]·K[b,s,j];  scores[b,h,s] = full[b,h,(s,kv(h))] / sqrt(Hd)
      out[b,h] = sum_(s,j) [j == kv(h)] softmax_s(scores)[b,h,s] V[b,s,j]
    Each head also scores the other KV heads' keys (KV x the attention flops, tiny at decode), but the
    window is read once and never transposed: the einsums of `_attention` contract over [B,S,KV,Hd]
    with KV between the batch and the slot axes, so XLA copies K and V to [B,KV,S,Hd] every layer and
    step (decode attention is memory-bound on CPU; the copy made it ~1.2-1.5x slower, microbenchmark).
    """
    B, T, H, Hd = q.shape
    S, KV, G = k.shape[1], cfg.num_kv_heads, cfg.num_groups
    own = jnp.arange(KV)[:, None] == jnp.arange(KV)[None, :]  # [kv(h), j]
    own = own[None, None, :, None, None, :]  # [1,1,KV,1,1,KV] against [B,T,KV,G,S,KV]
    full = jnp.einsum("bhd,bjd->bhj", q.reshape(B, T * H, Hd), k.reshape(B, S * KV, Hd),
                      preferred_element_type=jnp.float32).reshape(B, T, KV, G, S, KV)
    scores = jnp.sum(jnp.where(own, full, 0.0), axis=-1) / np.sqrt(Hd)  # [B,T,KV,G,S]
    scores = jnp.where(mask[:, :, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(own, probs[..., None], 0.0).astype(v.dtype).reshape(B, T * H, S * KV)
    out = jnp.einsum("bhj,bjd->bhd", probs, v.reshape(B, S * KV, Hd))
    return out.reshape(B, T, H, Hd)


def _layer(cfg: Qwen2Config, x, lp, positions, attend):
    """One decoder layer; attend(q, k, v) -> (attn [B,T,H,Hd], aux). Returns (x, aux)."""
    dt = jnp.dtype(cfg.dtype)
    if "q_kernel" not in lp:  # decode layout (unstack_layers(transpose=True)): [out, in] matrices
        return _layer_out_in(cfg, x, lp, positions, attend)
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btd,dhk->bthk", h, lp["q_kernel"].astype(dt)) + lp["q_bias"].astype(dt)
    k = jnp.einsum("btd,dhk->bthk", h, lp["k_kernel"].astype(dt)) + lp["k_bias"].astype(dt)
    v = jnp.einsum("btd,dhk->bthk", h, lp["v_kernel"].astype(dt)) + lp["v_bias"].astype(dt)
    q = constrain(rope(q, positions, cfg.rope_theta), ("batch", "length", "act_heads", "head_dim"))
    k = rope(k, positions, cfg.rope_theta)
    attn, aux = attend(q, k, v)
    x = x + jnp.einsum("bthk,hkd->btd", attn, lp["o_kernel"].astype(dt))
    x = constrain(x, ("batch", "length", "act_embed"))
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", h, lp["gate_kernel"].astype(dt))
    up = jnp.einsum("btd,df->btf", h, lp["up_kernel"].astype(dt))
    act = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    x = x + jnp.einsum("btf,fd->btd", act, lp["down_kernel"].astype(dt))
    return constrain(x, ("batch", "length", "act_embed")), aux


def _layer_out_in(cfg: Qwen2Config, x, lp, positions, attend):
    """`_layer` over per-layer weights stored [out, in] (torch Linear's layout; see unstack_layers).

    Same contractions as `_layer`; at decode shapes (a few rows against large matrices) XLA CPU's
    matmul streams an [out, in] weight ~1.2x faster than [in, out] (Qwen2.5-0.5B MLP, batch 16:
    165 vs 205 ms for the 24 layers, 2-core box).
    """
    dt = jnp.dtype(cfg.dtype)
    B, T = x.shape[:2]
    H, KV, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def lin(a, w):
        return jnp.einsum("bti,oi->bto", a, w.astype(dt))

    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = lin(h, lp["q_t"]).reshape(B, T, H, Hd) + lp["q_bias"].astype(dt)
    k = lin(h, lp["k_t"]).reshape(B, T, KV, Hd) + lp["k_bias"].astype(dt)
    v = lin(h, lp["v_t"]).reshape(B, T, KV, Hd) + lp["v_bias"].astype(dt)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    attn, aux = attend(q, k, v)
    x = x + lin(attn.reshape(B, T, H * Hd), lp["o_t"])
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    act = jax.nn.silu(lin(h, lp["gate_t"])) * lin(h, lp["up_t"])
    return x + lin(act, lp["down_t"]), aux


def logits_from_hidden(params: Params, hidden: jax.Array, cfg: Qwen2Config,
                       out_axes=("batch", "length", "act_vocab")) -> jax.Array:
    """Final-normed hidden [B,T,D] -> float32 logits [B,T,V] (tied: embed^T)."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("btd,vd->btv", hidden, params["embed"].astype(dt),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", hidden, params["lm_head"].astype(dt),
                            preferred_element_type=jnp.float32)
    return constrain(logits, out_axes)


def _cached_layers(layers: Params, x: jax.Array, cache: dict, cfg: Qwen2Config, num_new=None,
                   window: int | None = None):
    """The decoder layers over a KV cache, with the stacked cache [L,B,S,KV,Hd] as a fori_loop carry.

    Layer i reads its weights with a dynamic index, scatters its T new K/V rows into the carried cache
    at [i, b, lengths[b] + t] (in place: only B*T slots are written), then attends over slice i. As scan
    inputs/outputs instead, XLA copied the whole cache every call (~4x slower per decode step on CPU at
    512 slots). Attention reads only the first `window` slots of each layer (static; default all S).
    Returns (x, new_cache) with lengths += num_new (default T).

    Decode (T <= DECODE_ATTENTION_MAX_T) on CPU uses `_attention_decode`, which reads the cache without
    transposing it; on accelerators layout assignment already places the cache for the einsum form,
    and the flat view would merge a tensor-sharded KV axis into the slot axis (an all-gather).
    """
    B, T = x.shape[:2]
    starts = cache["lengths"].astype(jnp.int32)
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    S = cache["k"].shape[2]
    W = S if window is None else min(int(window), S)
    mask = jnp.arange(W)[None, None, :] <= positions[:, :, None]  # [B,T,W]

    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))  # token (b, t) goes to slot positions[b, t]
    decode_on_cpu = T <= DECODE_ATTENTION_MAX_T and jax.default_backend() == "cpu"
    attention = _attention_decode if decode_on_cpu else _attention

    def layer_step(i, lp, carry):
        h, k, v = carry

        def attend(q, k_new, v_new):
            # writes at slots >= S are dropped; padded tokens land past the row's new length
            k2 = k.at[i, rows, positions].set(k_new.astype(k.dtype), mode="drop")
            v2 = v.at[i, rows, positions].set(v_new.astype(v.dtype), mode="drop")
            kl = jax.lax.dynamic_slice_in_dim(k2, i, 1, 0)[0, :, :W].astype(q.dtype)
            vl = jax.lax.dynamic_slice_in_dim(v2, i, 1, 0)[0, :, :W].astype(q.dtype)
            return attention(q, kl, vl, mask, cfg), (k2, v2)

        h, (k, v) = _layer(cfg, h, lp, positions, attend)
        return h, k, v

    if isinstance(layers, (list, tuple)):  # per-layer weights (see unstack_layers): unrolled, no slicing
        if len(layers) != cfg.num_layers:
            raise ValueError(f"forward: {len(layers)} per-layer weight dicts for {cfg.num_layers} layers")
        carry = (x, cache["k"], cache["v"])
        for i, lp in enumerate(layers):
            carry = layer_step(i, lp, carry)
        x, k, v = carry
    else:
        def body(i, carry):
            lp = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), layers)
            return layer_step(i, lp, carry)

        x, k, v = jax.lax.fori_loop(0, cfg.num_layers, body, (x, cache["k"], cache["v"]))
    add = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.asarray(num_new).astype(jnp.int32)
    return x, {"k": k, "v": v, "lengths": starts + add}


def _out_in(lp: Params) -> Params:
    """One layer's weights with every matrix as [out, in] (keys *_t); norms and biases unchanged."""
    D = lp["q_kernel"].shape[0]
    flat_in = lambda w: w.reshape(D, -1).T  # [D, heads, hd] -> [heads*hd, D]; [D, F] -> [F, D]
    return {"attn_norm": lp["attn_norm"], "mlp_norm": lp["mlp_norm"],
            "q_t": flat_in(lp["q_kernel"]), "k_t": flat_in(lp["k_kernel"]), "v_t": flat_in(lp["v_kernel"]),
            "q_bias": lp["q_bias"], "k_bias": lp["k_bias"], "v_bias": lp["v_bias"],
            "o_t": lp["o_kernel"].reshape(-1, D).T,  # [H, hd, D] -> [D, H*hd]
            "gate_t": flat_in(lp["gate_kernel"]), "up_t": flat_in(lp["up_kernel"]), "down_t": lp["down_kernel"].T}


def unstack_layers(params: Params, transpose: bool = True) -> Params:
    """params with the stacked decoder layers split into a tuple of per-layer dicts (separate arrays).

    Cached `forward` accepts either form. With the stacked form the layer loop is a `fori_loop` whose
    dynamic index copies every weight matrix out of the stack each step (XLA CPU materialises each
    dynamic-slice: ~1.4 GB written and read again per decode step at Qwen2.5-0.5B); with the tuple the
    loop is unrolled and the matmuls read the weights in place. transpose: store the matrices as
    [out, in] (`_layer_out_in`), the faster layout for decode matmuls on CPU. Run it once (jitted) per
    weight update; the result is a copy (one more set of layer weights in memory).
    """
    layers = params["layers"]
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    out = dict(params)
    per_layer = [jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(n)]
    out["layers"] = tuple(_out_in(lp) if transpose else lp for lp in per_layer)
    return out


def training_mask(attention_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """[B,T,T] bool: query t may attend to key s. Causal and on real keys (attention_mask [B,T]), or, for
    packed rows, causal within the query's segment (segment_ids [B,T]; attention_mask unused)."""
    T = attention_mask.shape[1]
    causal = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]
    if segment_ids is None:
        return causal & attention_mask.astype(bool)[:, None, :]
    return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def forward(params: Params, tokens: jax.Array, cfg: Qwen2Config, *, positions: jax.Array | None = None,
            attention_mask: jax.Array | None = None, cache: dict | None = None,
            num_new: jax.Array | None = None, return_hidden: bool = False, window: int | None = None,
            segment_ids: jax.Array | None = None):
    """Run the decoder.

    Without cache: tokens [B,T] (right-padded), attention_mask [B,T] (1 = real), positions default to
    arange(T); token t attends to real tokens s <= t. Returns (logits [B,T,V] float32, None).

    Packed rows (no cache): `segment_ids` [B,T] int (0 = padding, 1.. = the trajectories of the row) and
    `positions` restarting at 0 per segment; token t attends to s <= t with segment_ids[s] ==
    segment_ids[t] (padding attends to padding only; `attention_mask` is then ignored). Without
    segment_ids the computation is the unpacked one, unchanged.

    With cache (dict k, v [L,B,S,KV,Hd], lengths [B]): row b's T tokens are written at slots
    lengths[b]..lengths[b]+T-1 with RoPE positions equal to the slot; token t attends to slots
    < lengths[b]+t+1. Returns (logits, new_cache) with lengths += num_new (default T). `window` (static
    int) bounds attention to slots < window, so decode cost follows the live context rather than S; the
    caller guarantees lengths[b] + T <= window (later slots would be attended to as if masked out).

    return_hidden=True returns the final-normed hidden states instead of logits (for chunked
    log-prob computation over large vocabularies).
    """
    B, T = tokens.shape
    dt = jnp.dtype(cfg.dtype)
    x = constrain(params["embed"].astype(dt)[tokens], ("batch", "length", "act_embed"))
    layers = params["layers"]

    if cache is None:
        if segment_ids is not None and positions is None:
            raise ValueError("forward: packed rows (segment_ids) need their per-segment positions")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), bool)
        mask = training_mask(attention_mask, segment_ids)

        def body(h, lp):
            return _layer(cfg, h, lp, positions, lambda q, k, v: (_attention(q, k, v, mask, cfg), None))[0], None

        if cfg.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        x, _ = jax.lax.scan(body, x, layers)
        new_cache = None
    else:
        x, new_cache = _cached_layers(layers, x, cache, cfg, num_new, window)

    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if return_hidden:
        return x, new_cache
    return logits_from_hidden(params, x, cfg), new_cache


def segment_starts_zeroed(logp: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Packed rows: 0 at the first token of every segment (it has no prediction within its segment)."""
    if segment_ids is None:
        return logp
    first = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return jnp.where(first, 0.0, logp)


def token_logprobs(params: Params, tokens: jax.Array, cfg: Qwen2Config, attention_mask=None,
                   positions=None, temperature: float = 1.0, segment_ids=None) -> jax.Array:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1 (position 0 gets 0). [B,T] float32.

    Packed rows (segment_ids, see `forward`): the context is the token's own segment and the first
    token of each segment gets 0."""
    logits, _ = forward(params, tokens, cfg, positions=positions, attention_mask=attention_mask,
                        segment_ids=segment_ids)
    logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return segment_starts_zeroed(jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked], axis=1), segment_ids)


def vocab_parallel_head(params: Params, cfg: Qwen2Config) -> Params:
    """The output projection resharded once for chunked logits (Megatron's vocab-parallel head).

    The parameter layout splits the [V, D] table's D over fsdp, so a logits chunk against it needs
    the whole table on every device: XLA all-gathered it (and all-reduced its gradient) once per chunk
    of every micro-batch. Here the rows of the vocabulary are split over tensor x fsdp instead
    ("head_vocab"), one all-to-all per pass, and `head_logits` brings each chunk's hidden states (small)
    to every device: logits, softmax statistics and the table's gradient stay local per vocabulary
    slice, and only [B, c] sums cross devices. Without a mesh this is the identity.

    When the vocabulary does not divide by the fsdp size (151,936 on fsdp=256) the rows could not be
    split, and every device would form the logits of every row: the parameter layout is kept then
    (vocab_splits_over_fsdp False) and the chunks compute as logits_from_hidden does.
    """
    key = "embed" if cfg.tie_word_embeddings else "lm_head"
    if not vocab_splits_over_fsdp(cfg):
        return {key: params[key]}
    return {key: constrain(params[key], ("head_vocab", None) if key == "embed" else (None, "head_vocab"))}


def vocab_splits_over_fsdp(cfg: Qwen2Config) -> bool:
    """True unless the active mesh has fsdp > 1 and the vocabulary's rows cannot be split over it."""
    from rexrag_jax.sharding.rules import active_mesh, spec_for_shape

    active = active_mesh()
    if active is None or active[0].shape.get("fsdp", 1) == 1:
        return True
    split = spec_for_shape(("head_vocab", None), (cfg.vocab_size, cfg.hidden_size), active[0], active[1])[0]
    return "fsdp" in ((split,) if isinstance(split, str) else tuple(split or ()))


def head_logits(head: Params, hidden: jax.Array, cfg: Qwen2Config) -> jax.Array:
    """Hidden [B,c,D] -> float32 logits [B,c,V] split by vocabulary (see vocab_parallel_head)."""
    if not vocab_splits_over_fsdp(cfg):
        return logits_from_hidden(head, hidden, cfg)
    return logits_from_hidden(head, constrain(hidden, ("head_batch", None, None)), cfg,
                              out_axes=("head_batch", None, "head_vocab"))


def pick_vocab(values: jax.Array, ids: jax.Array) -> jax.Array:
    """values[..., ids] for [..., V] values split over the vocabulary: a masked sum (exact: one term is
    nonzero), which partitions as a local reduction plus an all-reduce of [...], where a gather along
    the split axis would make XLA assemble the whole vocabulary first."""
    hit = jnp.arange(values.shape[-1], dtype=ids.dtype) == ids[..., None]
    return jnp.sum(jnp.where(hit, values, 0.0), axis=-1)


def token_logprobs_chunked(params: Params, tokens: jax.Array, cfg: Qwen2Config, attention_mask=None,
                           positions=None, temperature: float = 1.0, chunk: int = 512,
                           segment_ids=None) -> jax.Array:
    """Same values as `token_logprobs`, without materialising the [B,T,V] float32 logits.

    logp[:, t] = h_{t-1}·w[tok_t]/τ − logsumexp_v(h_{t-1}·w_v/τ) for t >= 1, logp[:, 0] = 0, where h are
    the final-normed hidden states. The T−1 predicting positions are processed `chunk` at a time in a
    `lax.scan` whose body is rematerialised, so forward and backward both hold [B, chunk, V] logits at
    most (at V = 152k, B·T·V·4 bytes is the largest buffer of a training step otherwise).
    """
    B, T = tokens.shape
    hidden, _ = forward(params, tokens, cfg, positions=positions, attention_mask=attention_mask,
                        return_hidden=True, segment_ids=segment_ids)
    n = T - 1
    if n <= 0:
        return jnp.zeros((B, T), jnp.float32)
    c = max(1, min(int(chunk), n))
    pad = -n % c
    h = jnp.pad(hidden[:, :-1], ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, pad)))
    h = h.reshape(B, -1, c, h.shape[-1]).swapaxes(0, 1)  # [n_chunks, B, c, D]
    targets = targets.reshape(B, -1, c).swapaxes(0, 1)

    head = vocab_parallel_head(params, cfg)

    @jax.checkpoint
    def one_chunk(hc, tc):
        logits = head_logits(head, hc, cfg) / temperature
        return pick_vocab(logits, tc) - jax.nn.logsumexp(logits, axis=-1)

    _, logp = jax.lax.scan(lambda carry, xs: (carry, one_chunk(*xs)), None, (h, targets))
    logp = logp.swapaxes(0, 1).reshape(B, -1)[:, :n]
    return segment_starts_zeroed(jnp.concatenate([jnp.zeros((B, 1), jnp.float32), logp.astype(jnp.float32)], axis=1),
                                 segment_ids)
