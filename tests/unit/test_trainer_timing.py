"""The epoch record's throughput and epoch time are the job's: the slowest rank's, not rank 0's."""
import pytest

from hvdtrain.phases import PHASES, PhaseTimer, epoch_timing


class TwoRanks:
    """A stand-in backend whose allgather returns rank 0's row and a slower rank 1's."""
    asynchronous = False

    def __init__(self, slower: float):
        self.slower = slower

    def allgather_floats(self, values):
        return [list(values), [v * self.slower for v in values]]


def test_timing_takes_the_slowest_rank():
    timing, slowest = epoch_timing(PhaseTimer(), TwoRanks(slower=3.0), profiled=False, steps=4, train_seconds=2.0,
                                   epoch_seconds=2.5, cpu_seconds=1.0)
    assert slowest == {"train_seconds": 6.0, "epoch_seconds": 7.5}
    assert timing["step_seconds"] == pytest.approx((0.5 + 1.5) / 2)  # the mean of each rank's own time per step
    assert set(timing["phase_seconds"]) == set(PHASES)
    assert timing["cpu_seconds_per_step"] == [0.25, 0.75]  # every rank's own, by rank
    assert "thread_cpu_per_step" not in timing  # none measured


def test_thread_cpu_is_gathered_per_role_and_rank():
    from hvdtrain.threads import ROLES
    seconds = {role: 0.0 for role in ROLES}
    seconds.update(main=0.8, horovod=0.2)
    timing, _ = epoch_timing(PhaseTimer(), TwoRanks(slower=2.0), profiled=False, steps=4, train_seconds=2.0,
                             epoch_seconds=2.5, cpu_seconds=1.0, threads=seconds)
    assert list(timing["thread_cpu_per_step"]) == list(ROLES)
    assert timing["thread_cpu_per_step"]["main"] == [0.2, 0.4]  # per step, by rank
    assert timing["thread_cpu_per_step"]["horovod"] == [0.05, 0.1]
