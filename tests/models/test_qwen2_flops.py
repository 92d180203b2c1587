"""Model FLOPs: hand-computed on a 1-layer config, and checked against XLA's own count of our forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.models.qwen2 import model
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.flops import dense_flops_per_token, forward_flops, train_flops


def test_hand_computed_one_layer():
    # d=8, H=2, K=1, hd=4, I=16, V=10, L=1
    cfg = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    # q 8*8=64, k 8*4=32, v 32, o 64, mlp 3*8*16=384 -> 576 MACs -> 1152 FLOPs
    assert dense_flops_per_token(cfg) == 1152
    # T=3: 3*(1152 + 2*8*10) + 4*1*2*4*(1+2+3) = 3*1312 + 192 = 4128
    assert forward_flops(cfg, [3]) == 4128
    # two sequences add; packing them does not change the count
    assert forward_flops(cfg, [3, 1]) == 4128 + 1312 + 32
    assert train_flops(cfg, [3]) == 3 * 4128


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_close_to_xla_cost_analysis(preset):
    """XLA counts our forward at T=1 (no attention asymmetry): it must agree with the matmul count to a few
    percent (XLA adds the elementwise ops, we do not). One layer: XLA's cost analysis counts a scan
    (while-loop) body once, not once per iteration."""
    cfg = Qwen2Config.from_preset(preset, num_layers=1)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.zeros((1, 1), jnp.int32)
    fn = jax.jit(lambda p, t: model.forward(p, t, cfg))
    cost = fn.lower(params, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost["flops"])
    ours = forward_flops(cfg, [1])
    assert ours <= xla <= 1.1 * ours, (ours, xla)
