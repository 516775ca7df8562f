"""Two jobs never write one output directory: a launcher's tasks that Horovod did not join into one world stop before
writing anything, and a second job aimed at a live job's --output-dir is refused."""
import os
import subprocess
import time

from tests.helpers import describe, env, hvdtrain, kill_tree, run

TINY = ["recipe", "tests.tiny_recipe:TinyTrainer", "--epochs", "1", "--resume", "never"]


def test_tasks_of_a_slurm_step_that_horovod_runs_as_separate_jobs_stop_before_writing(tmp_path):
    # What srun gives each task of a 2-task step, and a Horovod that uses Gloo without a rendezvous (as one built
    # without MPI does): each task would be rank 0 of a world of 1.
    out = tmp_path / "out"
    procs = [subprocess.Popen(hvdtrain(*TINY, "--framework", "torch", "--output-dir", str(out)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                              env=env(SLURM_STEP_NUM_TASKS=2, SLURM_NTASKS=2, SLURM_PROCID=i, SLURM_LOCALID=i,
                                      HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo"))
             for i in (0, 1)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 2, (p.returncode, stdout, stderr)
        assert ("hvdtrain: error: srun started 2 processes (SLURM_STEP_NUM_TASKS=2) but Horovod formed a world of 1"
                in stderr), stderr
    assert not out.exists(), os.listdir(out)  # stopped before the output directory was even created


def test_a_second_job_on_a_live_jobs_output_dir_is_refused(tmp_path):
    out, gate = str(tmp_path / "out"), tmp_path / "running"
    gate.touch()
    # The first job sleeps 0.5 s a step for as long as the gate exists (30 epochs would take 2 minutes), so it is
    # still running however long the second takes to start; without the gate its epochs take a moment each.
    first = subprocess.Popen(hvdtrain(*TINY, "--framework", "torch", "--output-dir", out, "--epochs", "30",
                                      "--step-sleep", "0.5", "--sleep-while", str(gate)), env=env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "config.json")) and first.poll() is None:
            assert time.monotonic() < deadline, "the first job never started"
            time.sleep(0.5)
        second = run(hvdtrain(*TINY, "--framework", "mxnet", "--output-dir", out), timeout=120)
        assert first.poll() is None, "the first job ended before the second started: the test proves nothing"
        assert second.returncode == 2, describe(second)
        assert "is in use by a running job (host" in second.stderr and f"pid {first.pid}," in second.stderr, \
            describe(second)
        gate.unlink()  # let the first job finish: its outputs are its own
        assert first.wait(timeout=120) == 0, first.stdout.read()
    finally:
        kill_tree(first)
    with open(os.path.join(out, "config.json")) as f:
        assert '"framework": "torch"' in f.read()
    third = run(hvdtrain(*TINY, "--framework", "torch", "--output-dir", out, "--max-steps", "1"), timeout=120)
    assert third.returncode == 0, describe(third)  # the lock went with the first job
