"""The sharded optimizer's layout (hvdtrain.shard): every element updated by exactly one rank, groups contiguous."""
import pytest

from hvdtrain import ConfigError, TrainConfig
from hvdtrain.shard import ShardLayout


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_element_lies_in_exactly_one_shard(world):
    sizes, groups = [512, 32, 128, 4, 1, 9], [0, 0, 0, 1, 1, 1]
    seen = {i: [0] * n for i, n in enumerate(sizes)}
    for rank in range(world):
        layout = ShardLayout(sizes, groups, world, rank)
        assert layout.padded == layout.shard * world >= layout.total == sum(sizes)
        at = 0
        for s in layout.segments():  # in flat order, packed from the shard's start
            assert s.at == at
            at += s.stop - s.start
            for k in range(s.start, s.stop):
                seen[s.param][k] += 1
        assert at == layout.hi - layout.lo
        ranges = layout.group_ranges(2)  # each group one contiguous range; together the whole shard, in order
        filled = [r for r in ranges if r[0] < r[1]]
        assert [a for a, _ in filled] == sorted(a for a, _ in filled)
        assert sum(b - a for a, b in filled) == at
    assert all(count == [1] * len(count) for count in seen.values())


def test_groups_must_be_contiguous():
    with pytest.raises(ValueError, match="ordered by group"):
        ShardLayout([1, 2, 3], [0, 1, 0], 2, 0)


@pytest.mark.parametrize("other", [dict(adasum=True), dict(elastic=True), dict(allreduce_groups=2)])
def test_refused_with_options_that_need_the_whole_state(other):
    with pytest.raises(ConfigError, match="--shard-optimizer cannot be combined"):
        TrainConfig(shard_optimizer=True, **other).validate()
