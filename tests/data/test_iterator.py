"""Sharded, resumable iteration: determinism, host partition of the global batch, exact resume."""
import json

import numpy as np
import pytest

from rexrag_jax.data import ShardedIterator, epoch_permutation, shard_for_host


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_hosts_partition_the_global_batch():
    items = list(range(50))
    hosts = [ShardedIterator(items, 4, seed=3, process_index=p, process_count=3) for p in range(3)]
    assert hosts[0].steps_per_epoch == 50 // 12
    for step in range(10):                            # crosses epoch boundaries (4 steps per epoch)
        batches = [next(h) for h in hosts]
        union = [x for b in batches for x in b]
        assert len(set(union)) == 12                  # disjoint, full
        epoch, pos = divmod(step, 4)
        expected = epoch_permutation(50, 3, epoch)[pos * 12:(pos + 1) * 12]
        assert union == expected.tolist()


def test_global_batch_is_independent_of_host_count():
    items = list(range(40))
    one = ShardedIterator(items, 8, seed=1)
    two = [ShardedIterator(items, 4, seed=1, process_index=p, process_count=2) for p in range(2)]
    for _ in range(7):
        assert next(one) == next(two[0]) + next(two[1])


def test_each_epoch_covers_distinct_items_and_differs():
    items = list(range(30))
    it = ShardedIterator(items, 10, seed=0)
    e0, e1 = sum(_take(it, 3), []), sum(_take(it, 3), [])
    assert sorted(e0) == sorted(e1) == items and e0 != e1
    assert sum(_take(ShardedIterator(items, 10, seed=0, shuffle=False), 3), []) == items


def test_resume_equals_uninterrupted():
    items = [f"q{i}" for i in range(23)]
    ref = ShardedIterator(items, 3, seed=7, process_index=1, process_count=2)
    expected = _take(ref, 9)
    it = ShardedIterator(items, 3, seed=7, process_index=1, process_count=2)
    head = _take(it, 4)
    state = json.loads(json.dumps(it.state()))        # JSON round trip, as saved with a checkpoint
    assert state == {"seed": 7, "epoch": 1, "position": 6, "num_examples": 23}
    resumed = ShardedIterator(items, 3, seed=7, process_index=1, process_count=2).restore(state)
    assert head + _take(resumed, 5) == expected


def test_restore_rejects_mismatch():
    it = ShardedIterator(list(range(10)), 2, seed=1)
    with pytest.raises(ValueError, match="seed"):
        it.restore({"seed": 2, "epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="11 examples"):
        it.restore({"seed": 1, "epoch": 0, "position": 0, "num_examples": 11})
    with pytest.raises(ValueError, match="lacks"):
        it.restore({"seed": 1})


def test_num_epochs_and_bad_arguments():
    it = ShardedIterator(list(range(7)), 3, seed=0, num_epochs=2)
    assert len(list(it)) == 4                         # 2 steps per epoch, remainder dropped
    with pytest.raises(ValueError, match="cannot fill"):
        ShardedIterator(list(range(5)), 3, process_count=2)
    with pytest.raises(ValueError):
        ShardedIterator(list(range(5)), 1, process_index=2, process_count=2)


def test_permutation_is_seeded_numpy():
    assert np.array_equal(epoch_permutation(9, 5, 2), np.random.default_rng([5, 2]).permutation(9))


def test_shard_for_host():
    items = list(range(10))
    shards = [shard_for_host(items, p, 3) for p in range(3)]
    assert sum(shards, []) == items and [len(s) for s in shards] == [3, 3, 4]
