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


def _beat(out, phase="train", age=0.0, host="other-host"):
    beats = os.path.join(out, "heartbeats")
    os.makedirs(beats, exist_ok=True)
    path = os.path.join(beats, "rank-0.json")
    with open(path, "w") as f:
        json.dump({"rank": 0, "phase": phase, "pid": 4242, "host": host}, f)
    stamp = os.stat(path).st_mtime - age
    os.utime(path, (stamp, stamp))


def test_a_filesystem_without_locks_is_not_taken_for_a_live_job(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = str(tmp_path / "out")
    guard.lock_output_dir(out).close()  # taken, with a warning naming why the lock cannot guard it
    assert "filesystem without file locks (No locks available)" in capsys.readouterr().err
    _beat(out)  # but a job whose rank 0 heartbeat is fresh still holds it
    with pytest.raises(ConfigError, match=r"is in use by a running job \(host other-host, pid 4242, its rank 0 "
                                          r"heartbeat 0 s old"):
        guard.lock_output_dir(out)


def test_a_node_local_lock_does_not_hide_a_job_on_another_host(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    with open(os.path.join(out, guard.LOCK_NAME), "w") as f:  # last taken on another host, whose flock we cannot see
        json.dump({"host": "other-host", "pid": 4242}, f)
    _beat(out)
    with pytest.raises(ConfigError, match="this filesystem's locks do not reach that host"):
        guard.lock_output_dir(out)
    _beat(out, phase="done")  # that job finished
    guard.lock_output_dir(out).close()
    with open(os.path.join(out, guard.LOCK_NAME), "w") as f:
        json.dump({"host": "other-host", "pid": 4242}, f)
    _beat(out, age=guard.LEASE_SECONDS + 5)  # or died: its heartbeat went stale
    guard.lock_output_dir(out).close()
