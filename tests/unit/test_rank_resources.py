"""What each rank may use: threads from the cores it may run on (and the ranks that share them), and one GPU."""
import pytest

from hvdtrain.backends import resources
from hvdtrain.backends.resources import cpu_threads_per_rank, decode_cores, encode_cores, estimated_threads

EIGHT = frozenset(range(8))


def test_ranks_that_share_every_core_split_them():
    # horovodrun or mpirun --bind-to none: 4 ranks, each may run anywhere on 8 cores
    assert cpu_threads_per_rank(EIGHT, [EIGHT] * 4) == 2


def test_ranks_bound_to_cores_of_their_own_use_all_of_them():
    # srun --cpu-bind=cores --cpus-per-task=8 on a 32-core node: each of 4 tasks owns 8 cores
    mine = frozenset(range(8, 16))
    host = [frozenset(range(i * 8, i * 8 + 8)) for i in range(4)]
    assert cpu_threads_per_rank(mine, host) == 8
    assert cpu_threads_per_rank(mine, host, slurm_cpus=8) == 8


def test_ranks_bound_to_the_same_socket_split_it():
    # mpirun --bind-to socket, 2 ranks per 16-core socket
    socket0 = frozenset(range(16))
    assert cpu_threads_per_rank(socket0, [socket0, socket0, frozenset(range(16, 32))]) == 8


def test_slurm_cpus_per_task_caps_and_threads_flag_wins():
    assert cpu_threads_per_rank(frozenset(range(32)), [frozenset(range(32))], slurm_cpus=6) == 6
    assert cpu_threads_per_rank(EIGHT, [EIGHT] * 4, requested=3) == 3
    assert cpu_threads_per_rank(frozenset({0}), [EIGHT] * 16) == 1, "never fewer than one"


def test_core_sets_travel_exactly_as_floats():
    cores = frozenset({0, 1, 31, 32, 63, 100, 1023})
    words = encode_cores(cores)
    assert all(w == int(w) and w < 2 ** 32 for w in words)
    assert decode_cores(words) == cores


@pytest.mark.parametrize("affinity, local_size, expected", [
    (range(16), 4, 4),      # unbound: the whole machine, shared by the host's 4 ranks
    (range(4, 8), 4, 4),    # bound by the launcher to 4 cores of its own
])
def test_estimate_before_the_ranks_can_talk(monkeypatch, affinity, local_size, expected):
    monkeypatch.setattr(resources.os, "sched_getaffinity", lambda pid: set(affinity), raising=False)
    monkeypatch.setattr(resources.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert estimated_threads(local_size) == expected
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    assert estimated_threads(local_size) == 2


def test_one_rank_per_gpu_by_local_rank():
    from hvdtrain.backends.resources import gpu_for_rank
    from hvdtrain.config import ConfigError
    assert [gpu_for_rank(r, 4, 4, None) for r in range(4)] == [0, 1, 2, 3]
    assert gpu_for_rank(3, 4, 1, "5") == 0, "a launcher that gives each rank one GPU of its own"
    with pytest.raises(ConfigError, match="4 ranks on this host but 2 GPU"):
        gpu_for_rank(2, 4, 2, None)
    with pytest.raises(ConfigError, match="one rank per GPU"):
        gpu_for_rank(1, 2, 1, None)  # two ranks on one GPU
