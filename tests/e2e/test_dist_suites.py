"""Launch the distributed suites (tests/dist) the way Horovod's CI does: 2 ranks, one framework per job; the sharded
update and MXNet's float16 path at 3 ranks too."""
import pytest

from tests.helpers import PY, describe, have_mpirun, horovodrun, mpirun, run

LAUNCHERS = {"horovodrun-gloo": lambda *cmd: horovodrun(2, *cmd), "mpirun": lambda *cmd: mpirun(2, *cmd)}


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
    assert result.output.count(" passed") >= 2, "both ranks must report their tests passed\n" + describe(result)
    assert " failed" not in result.output, describe(result)


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_sharded_and_float16_suites_at_three_ranks(framework):
    # 676 weights over 3 ranks: the padded last shard, and shard boundaries inside other parameters than at 2.
    files = ["tests/dist/test_sharded_optimizer.py"] + (["tests/dist/test_mxnet_fp16.py"] if framework == "mxnet" else [])
    result = run(horovodrun(3, PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--framework", framework),
                 timeout=300)
    assert result.returncode == 0, describe(result)
    assert result.output.count(" passed") >= 3 and " failed" not in result.output, describe(result)
