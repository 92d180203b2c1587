"""Deterministic shuffling / sharding over data-parallel hosts with a resumable, JSON-able state.

Epoch e uses the permutation `np.random.default_rng([seed, e]).permutation(N)`. Each step consumes
one *global* batch of G = per_host_batch * process_count consecutive permuted indices; host p takes
the slice [p*B, (p+1)*B) of it. The global batch is therefore the same for any host count with the
same G, every host takes the same number of steps (N // G per epoch; the remainder is dropped, so
SPMD steps stay in lock-step), and the state needs no host information:
    {"seed": int, "epoch": int, "position": global examples consumed in this epoch, "num_examples": N}
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch `epoch`: default_rng([seed, epoch]).permutation(num_examples)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def shard_for_host(items: Sequence, process_index: int, process_count: int) -> list:
    """Contiguous, nearly equal shard (sizes differ by at most one) for evaluation, no dropping."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    n = len(items)
    lo, hi = n * process_index // process_count, n * (process_index + 1) // process_count
    return list(items[lo:hi])


class ShardedIterator:
    """Endless iterator of per-host batches (lists of items); `state()` / `restore()` for checkpoints."""

    def __init__(self, items: Sequence, per_host_batch: int, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1, shuffle: bool = True, num_epochs: int | None = None):
        if per_host_batch <= 0:
            raise ValueError(f"per_host_batch must be positive, got {per_host_batch}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        self.items = items
        self.per_host_batch = per_host_batch
        self.global_batch = per_host_batch * process_count
        if len(items) < self.global_batch:
            raise ValueError(f"{len(items)} examples cannot fill one global batch of {self.global_batch} "
                             f"({per_host_batch} per host x {process_count} hosts)")
        self.seed, self.process_index, self.shuffle, self.num_epochs = seed, process_index, shuffle, num_epochs
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = None, None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.items) // self.global_batch

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            n = len(self.items)
            self._perm = epoch_permutation(n, self.seed, self.epoch) if self.shuffle else np.arange(n)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self):
        return self

    def __next__(self) -> list:
        if self.position + self.global_batch > len(self.items):  # drop the remainder, next epoch
            self.epoch, self.position = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        lo = self.position + self.process_index * self.per_host_batch
        idx = self._order()[lo:lo + self.per_host_batch]
        self.position += self.global_batch
        return [self.items[i] for i in idx]

    def state(self) -> dict:
        return {"seed": int(self.seed), "epoch": int(self.epoch), "position": int(self.position),
                "num_examples": len(self.items)}

    def restore(self, state: dict) -> "ShardedIterator":
        """Continue from `state()`; the seed and dataset size must match (else the order would differ)."""
        missing = {"seed", "epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"iterator state lacks {sorted(missing)}: {state}")
        if int(state["seed"]) != self.seed:
            raise ValueError(f"iterator state has seed {state['seed']}, this iterator uses seed {self.seed}")
        if "num_examples" in state and int(state["num_examples"]) != len(self.items):
            raise ValueError(f"iterator state was saved over {state['num_examples']} examples, "
                             f"this dataset has {len(self.items)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        return self
