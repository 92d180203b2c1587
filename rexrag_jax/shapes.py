"""Which already-compiled program shape to run instead of compiling a new one.

jit compiles once per input shape. The engine's prefill chunks, the query encoder's batches, the
trainer's packed rows and its RL math all see shapes that vary from step to step, and each new one costs
a compile (seconds on CPU, far more at real sizes on TPU). Running a program compiled for a larger shape,
padded, is exact for all of them (pad rows / tokens are masked out) and cheaper than a compile as long as
the padding stays bounded. This module holds that one rule; the callers own the shapes and the bound.

A shape "covers" another when it is >= in every dimension. Among the compiled shapes that cover `want`,
the cheapest (by `cost`, default the product of the dimensions) within `max_ratio` x cost(want) wins, ties
broken by the shape itself, so the choice never depends on a set's iteration order.
No imports from the package: every layer may use it.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

Shape = tuple[int, ...]


def covers(compiled: Iterable[Shape], want: Shape, max_ratio: float | None = None,
           cost: Callable[[Shape], float] = math.prod, accept: Callable[[Shape], bool] | None = None) -> Iterator[Shape]:
    """The shapes of `compiled` that cover `want` (every dimension >=), cheapest first (ties: the smaller
    shape), keeping only those with cost(shape) <= max_ratio * cost(want) (None: no bound) and accept(shape)."""
    want = tuple(want)
    limit = None if max_ratio is None else max_ratio * cost(want)
    fits = [tuple(k) for k in compiled if len(k) == len(want) and all(a >= b for a, b in zip(k, want))]
    for k in sorted(fits, key=lambda k: (cost(k), k)):
        if (limit is None or cost(k) <= limit) and (accept is None or accept(k)):
            yield k


def smallest_cover(compiled: Iterable[Shape], want: Shape, max_ratio: float | None = None,
                   cost: Callable[[Shape], float] = math.prod, accept: Callable[[Shape], bool] | None = None) -> Shape:
    """The cheapest compiled shape that covers `want` within the bounds of `covers`, else `want` itself
    (the caller compiles it)."""
    return next(covers(compiled, want, max_ratio, cost, accept), tuple(want))
