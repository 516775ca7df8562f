"""Where each rank's part of a sharded optimizer update lies (``--shard-optimizer``): pure arithmetic, no framework.

The parameters are laid end to end in one flat vector, ordered by parameter group (the groups that differ in weight
decay: --no-wd) so that each group is one contiguous run. The vector is padded to a multiple of the world size and cut
into ``size`` equal shards; rank r updates shard r. A step is then

    reduce-scatter the flat gradient (average)  ->  rank r holds the averaged gradient of its shard
    update its shard of the weights and its shard of the optimizer state, with the recipe's own optimizer
    allgather the updated shards                ->  every rank holds every updated weight

which puts the same bytes on the wire as one ring allreduce (a ring allreduce *is* a reduce-scatter and an
allgather) while each rank runs 1/size of the update and keeps 1/size of the optimizer state: what PyTorch's
ZeroRedundancyOptimizer (ZeRO stage 1) does. The optimizers hvdtrain uses (SGD, Nesterov, Adam; weight decay) update
each element from that element alone, so the sharded update is the plain one element for element.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple


@dataclass(frozen=True)
class Segment:
    """The part of one parameter inside this rank's shard: elements [start, stop) of the flattened parameter sit at
    ``at`` .. ``at + stop - start`` of the shard."""
    param: int
    start: int
    stop: int
    at: int


class ShardLayout:
    """The flat layout of parameters of ``sizes`` elements (in flat order), each in group ``groups[i]`` (groups
    contiguous in that order), cut into ``world`` shards; the view of rank ``rank``."""

    def __init__(self, sizes: Sequence[int], groups: Sequence[int], world: int, rank: int):
        if len(sizes) != len(groups):
            raise ValueError("one group per parameter")
        if list(groups) != sorted(groups):
            raise ValueError("parameters must be ordered by group (each group one contiguous run)")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.sizes, self.groups, self.world, self.rank = list(sizes), list(groups), world, rank
        self.offsets: List[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.total = total
        self.shard = -(-total // world) if total else 0  # ceil: every shard the same length
        self.padded = self.shard * world
        self.lo = min(rank * self.shard, total)
        self.hi = min((rank + 1) * self.shard, total)

    def segments(self) -> List[Segment]:
        """The parameters (parts of them) in this rank's shard, in flat order."""
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(offset, self.lo), min(offset + n, self.hi)
            if a < b:
                out.append(Segment(i, a - offset, b - offset, a - self.lo))
        return out

    def group_ranges(self, n_groups: int) -> List[Tuple[int, int]]:
        """For each group 0..n_groups-1, the range [a, b) of this rank's shard that its parameters occupy (a == b:
        none of the group is here)."""
        ranges = []
        for g in range(n_groups):
            members = [i for i, gi in enumerate(self.groups) if gi == g]
            if not members:
                ranges.append((0, 0))
                continue
            start = self.offsets[members[0]]
            stop = self.offsets[members[-1]] + self.sizes[members[-1]]
            a, b = max(start, self.lo) - self.lo, min(stop, self.hi) - self.lo
            ranges.append((a, b) if a < b else (0, 0))
        return ranges

    def param_slices(self) -> Iterator[Tuple[int, int, int]]:
        """(parameter, start, stop) of every parameter in the whole padded flat vector (what an allgather returns)."""
        for i, (offset, n) in enumerate(zip(self.offsets, self.sizes)):
            yield i, offset, offset + n
