"""Launch the distributed suites (tests/dist) the way Horovod's CI does: 2 ranks, one framework per job; the sharded
update and MXNet's float16 path at 3 ranks too."""
import re

import pytest

from tests.helpers import PY, describe, have_mpirun, horovodrun, mpirun, run

LAUNCHERS = {"horovodrun-gloo": lambda *cmd: horovodrun(2, *cmd), "mpirun": lambda *cmd: mpirun(2, *cmd)}


def _ranks_that_passed(result) -> list:
    """The ranks whose suite passed tests and failed none, by the line each writes at its end (tests/dist/conftest.py:
    one write, so ranks' outputs interleaved by mpirun cannot cut it)."""
    lines = re.findall(r"dist suite rank (\d+): (\d+) passed, (\d+) failed", result.output)
    return sorted(int(rank) for rank, passed, failed in lines if int(passed) > 0 and int(failed) == 0)


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_dist_suite(framework, launcher):
    if launcher == "mpirun" and not have_mpirun():
        pytest.skip("mpirun not installed (apt-get install openmpi-bin libopenmpi-dev)")
    # mpirun changes the controller (MPI's) and the library that moves the bytes: the collectives' files run under
    # it; the Trainer under mpirun is test_mnist's, test_multihost's and test_slurm's.
    files = (["tests/dist"] if launcher != "mpirun" else
             ["tests/dist/test_collectives.py", "tests/dist/test_grouped_allreduce.py"])
    cmd = LAUNCHERS[launcher](PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--framework", framework)
    # The tests' environment waits for horovod.torch's collectives blocking (tests/helpers.py); under mpirun they wait
    # spinning, as hvdtrain does for ranks free to run on every core, so that both waits run the suites.
    spin = {"HOROVOD_SPIN_WAIT": "1"} if launcher == "mpirun" else {}
    result = run(cmd, timeout=240, **spin)
    assert result.returncode == 0, describe(result)
    assert _ranks_that_passed(result) == [0, 1], "both ranks must report their tests passed\n" + describe(result)


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_sharded_and_float16_suites_at_three_ranks(framework):
    # 676 weights over 3 ranks: the padded last shard, and shard boundaries inside other parameters than at 2.
    files = ["tests/dist/test_sharded_optimizer.py"] + (["tests/dist/test_mxnet_fp16.py"] if framework == "mxnet" else [])
    result = run(horovodrun(3, PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--framework", framework),
                 timeout=300)
    assert result.returncode == 0, describe(result)
    assert _ranks_that_passed(result) == [0, 1, 2], describe(result)
