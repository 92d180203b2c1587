"""The engine on a (data=4, fsdp=2) mesh of fake CPU devices gives the unsharded engine's outputs."""
import jax
import numpy as np
from jax.sharding import Mesh

from rexrag_jax.generation import GenerationEngine

from .test_engine import CFG, params  # noqa: F401  (fixture)

PROMPTS = [[5, 6, 7], [8, 9], [1, 2, 3, 4], [7], [3, 3], [4, 4, 4], [9, 9, 1], [100]]


def _run(p, mesh):
    eng = GenerationEngine(p, CFG, 8, 128, decode_chunk=8, stop_strings=(), mesh=mesh)
    eng.append(list(range(8)), PROMPTS)
    eng.append([2], [[11, 12]])  # subset append: sub-batch padded up to the data-parallel size
    eng.copy_prefix(0, 5, 2)
    outs = eng.generate(list(range(8)), 10, jax.random.PRNGKey(0), temperature=1.0)
    return eng, outs


def test_sharded_engine_matches_unsharded(params):  # noqa: F811
    assert len(jax.devices()) >= 8
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2, 1), ("data", "fsdp", "tensor"))
    _, ref = _run(params, None)
    eng, got = _run(params, mesh)
    assert eng._k.sharding.spec[1] == ("data", "fsdp")  # cache batch axis sharded over data x fsdp
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
