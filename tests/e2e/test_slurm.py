"""A real Slurm cluster (scripts/slurm_cluster.sh: slurmctld and two slurmd on network-namespace hosts, one munged):
the shipped sbatch script, mpirun inside salloc, horovodrun over the allocation's hosts, and a node failure with a
requeue. What docs/cluster.md's Slurm section shows is what runs here. Skipped, with the reason, without root or
network namespaces; Slurm and MUNGE are installed from Debian's packages when missing.
"""
import json
import os
import shutil
import subprocess
import time

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import (BIN, PY, ROOT, cluster_up, describe, horovodrun, hvdtrain, hvdtrain_processes, kill_tree,
                           run, why_no_netns)
from tests.helpers import env as env_for_tests

SLURM = os.path.join(ROOT, "scripts", "slurm_cluster.sh")
SBATCH = os.path.join("scripts", "cluster", "slurm_train.sbatch")
TINY = "tests.tiny_recipe:TinyTrainer"
MPI_ENV = ["-mca", "pml", "ob1", "-mca", "btl", "^openib", "-mca", "btl_tcp_if_include", "eth0",
           "-mca", "oob_tcp_if_include", "eth0", "-x", "PATH", "-x", "PYTHONPATH"]


def _why_not() -> str:
    why = why_no_netns()
    if not why and shutil.which("nsenter") is None:
        why = "needs util-linux (nsenter)"
    if not why and shutil.which("mpirun") is None:
        why = "needs Open MPI (srun --mpi=pmix starts MPI ranks)"
    return why


class Slurm:
    def __init__(self, state: str):
        self.state = state

    def run(self, *cmd, timeout: float = 240, **env):
        """``cmd`` on host0, the login node, with SLURM_CONF set and the venv and the hosts' ssh first in PATH."""
        path = f"{self.state}/net/bin{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        return run(["bash", SLURM, "run", self.state, *cmd], timeout=timeout, PATH=path, **env)

    def node(self, host: str, action: str) -> None:
        subprocess.run(["bash", SLURM, "node", self.state, host, action], check=True, timeout=60)

    def jobs(self) -> str:
        return self.run("squeue", "-h", "-o", "%i %T %R", timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("slurm"))
    with cluster_up(SLURM, state, 2, _why_not()):
        yield Slurm(state)
    assert not os.path.exists(os.path.join(state, "slurm.conf")) and not os.path.exists(f"{state}/spool")


def sbatch(slurm, name: str, out: str, cpus: int, env: dict, timeout: float = 240):
    """The shipped script, unchanged, on 2 nodes x 1 task; waits for the job (and any requeue) to end."""
    log = f"{out}.log"
    result = slurm.run("sbatch", "--wait", "-N", "2", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "-J", name,
                       f"--output={log}", SBATCH, timeout=timeout, OUTPUT=out, **env)
    text = open(log).read() if os.path.exists(log) else ""
    return result, text


def test_sbatch_script_trains_across_two_nodes_as_on_localhost(slurm, digits, tmp_path):
    # The script's defaults (MXNet; --precision auto, fp32 on MXNet's CPU; the interface found from the route to the
    # first node) on the MNIST-format digits, 1 core per task.
    args = ["--data-dir", digits, "--epochs", "3"]
    out = str(tmp_path / "slurm")
    result, log = sbatch(slurm, "mnist", out, 1, {"RECIPE": "mnist", "DATA": digits, "EPOCHS": "3"})
    assert result.returncode == 0, describe(result) + log
    assert "on host[0-1]: mnist --framework mxnet --precision auto" in log, log
    assert "slurm_train: interface between nodes: eth0" in log, log
    local = str(tmp_path / "local")
    ref = run(horovodrun(2, *hvdtrain("recipe", "mnist", "--framework", "mxnet", *args, "--output-dir", local)),
              timeout=240)
    assert ref.returncode == 0, describe(ref)
    got, want = read_metrics(out), read_metrics(local)
    assert [r["epoch"] for r in got] == [1, 2, 3] and got[-1]["world_size"] == 2
    assert got[-1]["val_accuracy"] == want[-1]["val_accuracy"] >= 0.8, (got[-1], want[-1])
    assert got[-1]["train_loss"] == pytest.approx(want[-1]["train_loss"], rel=1e-5)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["threads_per_rank"] == 1  # --cpus-per-task=1: one core, bound


def test_mpirun_inside_salloc_and_horovodrun_over_its_hosts(slurm, tmp_path):
    out = str(tmp_path / "mpirun")
    r = slurm.run("salloc", "-N", "2", "--ntasks-per-node=1", "mpirun", "-np", "2", "-bind-to", "none",
                  *MPI_ENV, PY, "-m", "hvdtrain", "recipe", TINY, "--epochs", "2", "--output-dir", out,
                  OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    assert r.returncode == 0 and read_metrics(out)[-1]["world_size"] == 2, describe(r)
    out = str(tmp_path / "horovodrun")
    r = slurm.run("salloc", "-N", "2", "--ntasks-per-node=1", "bash", "-c",
                  f"horovodrun -np $SLURM_NTASKS -H $(scripts/cluster/slurm_hosts.sh) --gloo --network-interfaces "
                  f"eth0 {PY} -m hvdtrain recipe {TINY} --epochs 2 --output-dir {out}")
    assert r.returncode == 0 and read_metrics(out)[-1]["world_size"] == 2, describe(r)


def test_node_failure_ends_the_job_naming_the_node_and_the_requeue_resumes(slurm, tmp_path):
    # 2 cores per task: each rank uses both (what Slurm allots, on nodes that emulate 2 cores each). Steps take 2 s
    # while the file "slow" exists, so that host1's slurmd is killed mid-run and Slurm notices before the job ends;
    # Slurm then declares host1 down, cancels the job on host0 and requeues it (--requeue); with host1 back, the job
    # continues from the newest checkpoint at full speed.
    out = str(tmp_path / "requeued")
    slow = tmp_path / "slow"
    slow.touch()
    env = {"RECIPE": TINY, "FRAMEWORK": "torch", "EPOCHS": "6",
           "EXTRA": f"--step-sleep 2 --sleep-while {slow}"}
    job = subprocess.Popen(["bash", SLURM, "run", slurm.state, "sbatch", "--wait", "-N", "2", "--ntasks-per-node=1",
                            "--cpus-per-task=2", "-J", "requeued", f"--output={out}.log", SBATCH],
                           env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OUTPUT": out, **env},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{out}/metrics.jsonl") or not read_metrics(out):
            assert time.monotonic() < deadline and job.poll() is None, \
                f"the job never finished an epoch:\n{_job_log(out)}"
            time.sleep(0.5)
        slurm.node("host1", "kill")
        # while Slurm notices (about 30 s), the same job uninterrupted on localhost, for the final accuracy
        local = str(tmp_path / "uninterrupted")
        reference = subprocess.Popen(horovodrun(2, *hvdtrain("recipe", TINY, "--epochs", "6", "--output-dir", local)),
                                     cwd=ROOT, env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        deadline = time.monotonic() + 90
        while "PENDING" not in slurm.jobs():
            assert time.monotonic() < deadline, f"the job was not requeued: {slurm.jobs()}\n{_job_log(out)}"
            time.sleep(0.2)
        # Held until host1 is back and its old step gone (released below): Slurm's requeue delay alone let it start
        # 7 s after the failure on a loaded machine, beside the old step, which then killed it (exit 143).
        job_id = slurm.jobs().split()[0]
        held = slurm.run("scontrol", "hold", job_id, timeout=30)
        assert held.returncode == 0, describe(held)
        log = _job_log(out)
        assert "Node failure on host1" in log and "DUE TO NODE FAILURE" in log, log
        # slurmstepd ends the step's tasks on host0 with SIGTERM and, KillWait (5 s) later, SIGKILL; srun waits up to
        # 7 s for the step: 30 s is far above both, far below a rank left hanging
        deadline = time.monotonic() + 30
        while left := _hvdtrain_processes(slurm.state, "host0"):
            assert time.monotonic() < deadline, f"left running on host0, the node that did not fail: {left}\n{log}"
            time.sleep(0.5)
        slow.unlink()
        slurm.node("host1", "start")
        # host1 registers again (ReturnToService=2), and its slurmd ends the job's old step there (its ranks went on
        # without a slurmd). The requeued job starts only after both (held above, released below): a new step 4.0
        # launched beside the old one fails on the old one's sockets.
        deadline = time.monotonic() + 60
        while (left := _hvdtrain_processes(slurm.state, "host1", also=(f"slurmstepd: [{job_id}.",))) or \
                slurm.run("sinfo", "-h", "-n", "host1", "-o", "%T", timeout=30).stdout.strip() != "idle":
            assert time.monotonic() < deadline, f"host1 is not back, or its old step still runs: {left}"
            time.sleep(0.5)
        released = slurm.run("scontrol", "release", job_id, timeout=30)
        assert released.returncode == 0, describe(released)
        slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", timeout=30)  # skip Slurm's requeue delay
        output, _ = job.communicate(timeout=180)
        ref_output, _ = reference.communicate(timeout=180)
    except BaseException:
        print(f"squeue: {slurm.jobs()}\n{_job_log(out)}")  # shown by pytest with the failure
        subprocess.run(["bash", SLURM, "run", slurm.state, "scancel", "-n", "requeued"], timeout=30)
        for p in (job, locals().get("reference")):
            if p is not None:
                kill_tree(p)
        raise
    assert job.returncode == 0, output
    assert reference.returncode == 0, ref_output
    log = _job_log(out)
    assert "(restart 1)" in log and "hvdtrain: resuming from" in log and "hvdtrain: done" in log, log
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == list(range(1, 7)), log
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["threads_per_rank"] == 2
    reference_records = read_metrics(local)
    assert records[-1]["val_accuracy"] == reference_records[-1]["val_accuracy"], (records, reference_records, log)


def _job_log(out: str) -> str:
    return open(f"{out}.log").read() if os.path.exists(f"{out}.log") else f"(no {out}.log yet)"


def _hvdtrain_processes(state: str, host: str, also: tuple = ()) -> dict:
    with open(os.path.join(state, "net", "env")) as f:
        prefix = dict(line.strip().split("=", 1) for line in f if "=" in line)["NETNS_PREFIX"]
    return hvdtrain_processes(f"{prefix}h{host[len('host'):]}", also)


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_a_failed_bring_up_takes_down_all_it_started(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "slurmd").write_text("#!/bin/sh\necho 'slurmd: fake: refusing to start' >&2\nexit 1\n")
    (fake / "slurmd").chmod(0o755)
    state = tmp_path / "cluster"
    before = _namespaces()
    munge_before = os.path.exists("/etc/munge")
    up = run(["bash", SLURM, "up", str(state), "2"], timeout=300, UP_TIMEOUT=3,
             PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert up.returncode != 0 and "slurmd did not start on host0" in up.stderr, describe(up)
    assert "bring-up failed: taking down what it started" in up.stderr
    after = _namespaces()
    assert after - before == set(), after - before  # no namespace host left
    left = subprocess.run(["pgrep", "-af", f"{state}/slurm.conf"], capture_output=True, text=True).stdout
    assert left == "", left  # no slurmctld
    assert subprocess.run(["pgrep", "-af", f"{state}/munged"], capture_output=True, text=True).stdout == ""
    for name in ("slurm.conf", "spool", "state", "tmpfs", "munge-created", "net/env"):
        assert not (state / name).exists(), name
    if not munge_before:
        assert not os.path.exists("/etc/munge"), "the MUNGE key and directory it created"
