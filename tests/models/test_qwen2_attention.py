"""The decode attention (cache read in place, flat batched matmuls) against the reference einsum attention."""
import jax
import numpy as np
import pytest

from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config


@pytest.mark.parametrize("preset,T", [("tiny", 1), ("tiny", 3), ("small", 1)])
def test_decode_attention_equals_reference(preset, T):
    cfg = Qwen2Config.from_preset(preset)
    B, S = 5, 40
    r = np.random.RandomState(T)
    q = r.randn(B, T, cfg.num_heads, cfg.head_dim).astype(np.float32)
    k = r.randn(B, S, cfg.num_kv_heads, cfg.head_dim).astype(np.float32)
    v = r.randn(B, S, cfg.num_kv_heads, cfg.head_dim).astype(np.float32)
    lengths = np.array([1, 7, 39, 40, 20])  # ragged rows; token t of row b sees slots < lengths[b] - T + t + 1
    mask = np.arange(S)[None, None, :] < (lengths[:, None] - T + np.arange(T)[None, :] + 1)[:, :, None]
    want = qwen2._attention(q, k, v, mask, cfg)
    got = jax.jit(qwen2._attention_decode, static_argnums=4)(q, k, v, mask, cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    # a masked slot really is ignored: changing it leaves the output unchanged, changing a live one does not
    k2 = k.copy()
    k2[0, 5] += 10.0  # row 0 sees slot 0 only (T=1) or slots <= 0 - ... : slot 5 is masked for every T
    np.testing.assert_allclose(np.asarray(qwen2._attention_decode(q, k2, v, mask, cfg)), np.asarray(got), atol=1e-6)
    k2[3, 0] += 10.0
    assert not np.allclose(np.asarray(qwen2._attention_decode(q, k2, v, mask, cfg))[3], np.asarray(got)[3], atol=1e-3)
