"""A job's outputs are its own: the launcher's task count against Horovod's world, and the output directory's lock."""
import json
import os
import subprocess
import sys

import pytest

from hvdtrain import guard
from hvdtrain.config import ConfigError


def test_the_innermost_launcher_declares_the_size():
    assert guard.declared_world_size({}) is None
    assert guard.declared_world_size({"SLURM_STEP_NUM_TASKS": "2"}) == ("SLURM_STEP_NUM_TASKS", 2, "srun")
    # mpirun inside an allocation: its processes also see the srun step of its daemons (one per node)
    assert guard.declared_world_size({"SLURM_STEP_NUM_TASKS": "2", "OMPI_COMM_WORLD_SIZE": "8"})[:2] == \
        ("OMPI_COMM_WORLD_SIZE", 8)
    assert guard.declared_world_size({"HOROVOD_SIZE": "4", "PMI_SIZE": "4"})[0] == "HOROVOD_SIZE"


def test_a_world_the_launcher_did_not_start_is_refused_with_the_cause():
    guard.check_world_size(2, False, {"SLURM_STEP_NUM_TASKS": "2"})
    guard.check_world_size(1, False, {})
    with pytest.raises(ConfigError, match=r"^srun started 2 processes \(SLURM_STEP_NUM_TASKS=2\) but Horovod formed "
                                          r"a world of 1: this Horovod was built without MPI"):
        guard.check_world_size(1, False, {"SLURM_STEP_NUM_TASKS": "2"})
    with pytest.raises(ConfigError, match="Horovod's MPI is not the launcher's"):
        guard.check_world_size(1, True, {"OMPI_COMM_WORLD_SIZE": "2"})


def test_a_live_jobs_output_dir_is_refused_naming_it_and_freed_when_it_ends(tmp_path):
    out = str(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hvdtrain import guard; "
                               "h = guard.lock_output_dir(sys.argv[1], {'SLURM_JOB_ID': '77'}); print('held', "
                               "flush=True); time.sleep(60)", out], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"--output-dir {out} is in use by a running job \(host \S+, pid "
                                              rf"{holder.pid}, job Slurm 77, since "):
            guard.lock_output_dir(out)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    handle = guard.lock_output_dir(out)  # the kernel dropped the killed holder's lock
    with open(os.path.join(out, guard.LOCK_NAME)) as f:
        assert json.load(f)["pid"] == os.getpid()
    handle.close()
