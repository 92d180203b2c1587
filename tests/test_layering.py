"""Lower layers never import upper ones (statically, lazy imports included): the data flow's stages
import downwards only, so e.g. the rollout loop can be used without the trainer."""
import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rexrag_jax")
# layer -> the packages it must never import (each stage may use everything below it)
UPPER = ("train", "evaluation", "rapo", "demo", "cli")
FORBIDDEN = {
    "config": ("data", "models", "rollout", "rl", "generation", "retrieval") + UPPER,
    "models": ("rollout", "rl", "generation", "retrieval", "data") + UPPER,
    "rl": ("rollout", "generation", "retrieval", "data") + UPPER,
    "generation": ("rollout", "rl", "retrieval", "data") + UPPER,
    "retrieval": ("rollout", "rl", "generation", "data") + UPPER,
    "rollout": UPPER,
    "train": ("evaluation", "rapo", "demo", "cli"),
}


def imports_of(layer):
    """(file, module) of every rexrag_jax import in the package folder or module file `layer`."""
    top = os.path.join(PKG, layer)
    files = [top] if os.path.isfile(top) else [os.path.join(root, f) for root, _, fs in os.walk(top)
                                                for f in fs if f.endswith(".py")]
    assert files, f"no python files under {top}"
    out = []
    for path in files:
        for node in ast.walk(ast.parse(open(path).read())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            out += [(os.path.relpath(path, PKG), n) for n in names if n.startswith("rexrag_jax.")]
    return out


def test_shape_reuse_rule_imports_nothing_from_the_package():
    """rexrag_jax/shapes.py is used by generation, retrieval and train alike: it sits below every layer."""
    assert imports_of("shapes.py") == []
    assert ("generation/engine.py", "rexrag_jax.shapes") in imports_of("generation")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer):
    bad = [(f, m) for f, m in imports_of(layer) if m.split(".")[1] in FORBIDDEN[layer]]
    assert not bad, f"{layer} imports an upper layer: {bad}"
