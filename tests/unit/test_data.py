import numpy as np
import pytest

from hvdtrain.data import ArrayDataset, ShardSampler, array_batches, steps_per_epoch


@pytest.mark.parametrize("n, size", [(10, 2), (11, 2), (1797, 3), (5, 4), (3, 8)])
def test_training_shards_have_equal_length_and_cover_everything(n, size):
    shards = [ShardSampler(n, r, size, shuffle=True, seed=7) for r in range(size)]
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1, "every rank must run the same number of steps"
    seen = np.concatenate([s.indices() for s in shards])
    assert len(seen) == len(shards[0]) * size
    assert set(seen.tolist()) == set(range(n))
    for s in shards:
        assert len(list(s)) == len(s)


@pytest.mark.parametrize("n, size", [(10, 3), (359, 2), (2, 4)])
def test_eval_shards_are_disjoint_and_complete(n, size):
    shards = [ShardSampler(n, r, size, shuffle=False, pad=False) for r in range(size)]
    seen = np.concatenate([s.indices() for s in shards])
    assert sorted(seen.tolist()) == list(range(n))
    assert sum(len(s) for s in shards) == n


def test_epochs_reshuffle_the_same_way_on_every_rank():
    a = ShardSampler(100, 0, 2, seed=1)
    b = ShardSampler(100, 1, 2, seed=1)
    first = (a.indices().copy(), b.indices().copy())
    a.set_epoch(1)
    b.set_epoch(1)
    assert not np.array_equal(first[0], a.indices())
    assert set(a.indices().tolist()) | set(b.indices().tolist()) == set(range(100))


def test_array_batches_and_transform():
    x = np.arange(10, dtype=np.float32)
    y = np.arange(10)
    ds = ArrayDataset(x, y, transform=lambda a, b: (a * 2, b))
    batches = list(array_batches(ds, [9, 8, 7, 6, 5], 2, drop_last=True))
    assert len(batches) == 2
    np.testing.assert_array_equal(batches[0][0], [18, 16])
    assert len(list(array_batches(ds, range(5), 2, drop_last=False))) == 3
    assert steps_per_epoch(719, 32) == 22


def test_unequal_arrays_are_refused():
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros(3), np.zeros(4))
