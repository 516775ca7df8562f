"""Several hosts for real: two network namespaces joined by a bridge, each with its own sshd and address
(scripts/netns_cluster.sh). Jobs are launched over ssh by horovodrun (Gloo) and by mpirun, from inside host0, as a
user would from a login node; results must equal a localhost run of the same command.
"""
import json
import os
import subprocess
import time
from dataclasses import dataclass

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import (BIN, PY, ROOT, cluster_state, cluster_up, describe, env, horovodrun, hvdtrain,
                           hvdtrain_processes, kill_tree, run, why_no_netns)

CLUSTER = os.path.join(ROOT, "scripts", "netns_cluster.sh")
TINY = "tests.tiny_recipe:TinyTrainer"
TRAIN = ("--epochs", "3", "--threads", "1")  # one thread per rank: the two "hosts" share this machine's cores


def isa_caps() -> list:
    """mpirun's -x for the variables that decide the ranks' kernels and precision, where set: an ISA cap (a processor
    without AVX-512 simulated) or HVDTRAIN_AUTO_PRECISION (auto's outcome forced), which mpirun would not pass to the
    other hosts' ranks; they would then compute otherwise than the localhost reference."""
    return [arg for var in ("DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "HVDTRAIN_AUTO_PRECISION")
            if var in os.environ for arg in ("-x", var)]


@dataclass
class Cluster:
    dir: str
    prefix: str
    hosts: dict  # name -> address

    def env(self) -> dict:
        return {"PATH": f"{self.dir}/bin{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

    def command(self, *cmd) -> list:
        """``cmd`` run inside host0's network namespace."""
        return ["bash", CLUSTER, "run", self.dir, "host0", *cmd]

    def launch(self, *cmd, timeout: float = 240):
        return run(self.command(*cmd), timeout=timeout, **self.env())

    def mpirun(self, np: int, hosts: list, *cmd) -> list:
        return ["mpirun", "-np", str(np), *hosts, "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1",
                "-mca", "btl", "^openib", "-mca", "plm_rsh_agent", f"{self.dir}/bin/ssh",
                "-mca", "btl_tcp_if_include", "eth0", "-mca", "oob_tcp_if_include", "eth0",
                "-x", "PATH", "-x", "PYTHONPATH", *isa_caps(), *cmd]

    def python_processes(self, host: str) -> dict:
        return hvdtrain_processes(f"{self.prefix}h{host[len('host'):]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("cluster"))
    with cluster_up(CLUSTER, state, 2, why_no_netns()):
        yield Cluster(state, *cluster_state(state))


_references = {}


def localhost_reference(framework: str, tmp_path_factory) -> list:
    """The same tiny job on localhost, once per framework."""
    if framework not in _references:
        out = str(tmp_path_factory.mktemp(f"local-{framework}"))
        r = run(horovodrun(2, *hvdtrain("recipe", TINY, "--framework", framework, *TRAIN, "--output-dir", out)),
                timeout=180)
        assert r.returncode == 0, describe(r)
        _references[framework] = read_metrics(out)
    return _references[framework]


def assert_same_training(records: list, reference: list) -> None:
    assert [r["epoch"] for r in records] == [r["epoch"] for r in reference]
    for got, want in zip(records, reference):
        assert got["world_size"] == 2
        assert got["val_accuracy"] == want["val_accuracy"], (got, want)
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5), (got, want)


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_horovodrun_over_ssh_trains_as_on_localhost(cluster, tmp_path, tmp_path_factory, framework):
    out = str(tmp_path / "out")
    r = cluster.launch(os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "host0:1,host1:1", "--gloo",
                       "--network-interfaces", "eth0",
                       *hvdtrain("recipe", TINY, "--framework", framework, *TRAIN, "--output-dir", out))
    assert r.returncode == 0, describe(r)
    assert_same_training(read_metrics(out), localhost_reference(framework, tmp_path_factory))
    beats = {}
    for rank in (0, 1):
        with open(os.path.join(out, "heartbeats", f"rank-{rank}.json")) as f:
            beats[rank] = json.load(f)
    # Each rank ran on its own host, and only the interface given to --network-interfaces carries its address.
    assert [beats[0]["host"], beats[1]["host"]] == ["host0", "host1"]
    assert [beats[0]["addresses"], beats[1]["addresses"]] == [[cluster.hosts["host0"]], [cluster.hosts["host1"]]]


def test_mpirun_across_hosts(cluster, tmp_path, tmp_path_factory):
    """The PyTorch article's mpirun command, across the two hosts."""
    out = str(tmp_path / "out")
    r = cluster.launch(*cluster.mpirun(2, ["-H", "host0:1,host1:1"], *hvdtrain("recipe", TINY, "--framework", "torch",
                                                                                *TRAIN, "--output-dir", out)))
    assert r.returncode == 0, describe(r)
    assert_same_training(read_metrics(out), localhost_reference("torch", tmp_path_factory))


def test_mpirun_script_with_a_hostfile(cluster, tmp_path, tmp_path_factory):
    """scripts/cluster/mpirun.sh, as a user runs it: a hostfile, the interface, and the recipe's flags."""
    out = str(tmp_path / "out")
    r = run(cluster.command("bash", os.path.join(ROOT, "scripts", "cluster", "mpirun.sh"),
                            os.path.join(cluster.dir, "hostfile"), "2", TINY, "--framework", "mxnet", *TRAIN,
                            "--output-dir", out),
            timeout=240, IFACE="eth0", PYTHON=PY, MPIRUN_EXTRA=f"-mca plm_rsh_agent {cluster.dir}/bin/ssh",
            **cluster.env())
    assert r.returncode == 0, describe(r)
    assert_same_training(read_metrics(out), localhost_reference("mxnet", tmp_path_factory))


def test_doctor_on_every_host(cluster):
    r = cluster.launch("bash", os.path.join(ROOT, "scripts", "cluster", "doctor_all_hosts.sh"),
                       os.path.join(cluster.dir, "hostfile"))
    assert r.returncode == 0, describe(r)
    assert "host0: ok" in r.stdout and "host1: ok" in r.stdout and "every host passed" in r.stdout


LAYOUT = ("import json, os, horovod.torch as hvd; hvd.init(); "
          "print('LAYOUT ' + json.dumps(dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), "
          "local_size=hvd.local_size(), cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(), "
          "host=os.environ.get('HOROVOD_HOSTNAME'), iface=os.environ.get('HOROVOD_GLOO_IFACE'))), flush=True)")


def test_two_hosts_with_two_slots_each_number_their_ranks(cluster):
    r = cluster.launch(os.path.join(BIN, "horovodrun"), "-np", "4", "-H", "host0:2,host1:2", "--gloo",
                       "--network-interfaces", "eth0", PY, "-c", LAYOUT)
    assert r.returncode == 0, describe(r)
    layout = [json.loads(line.split("LAYOUT ", 1)[1]) for line in r.stdout.splitlines() if "LAYOUT " in line]
    assert sorted(p["rank"] for p in layout) == [0, 1, 2, 3]
    for p in layout:
        host = p["rank"] // 2  # horovodrun fills host0's slots first
        assert p["host"] == f"host{host}" and p["iface"] == "eth0", p
        assert (p["size"], p["local_size"], p["cross_size"]) == (4, 2, 2), p
        assert (p["local_rank"], p["cross_rank"]) == (p["rank"] % 2, host), p


def test_a_host_cut_off_mid_run_fails_fast_and_is_named(cluster, tmp_path):
    out = tmp_path / "out"
    stall = 15
    cmd = cluster.command(os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "host0:1,host1:1", "--gloo",
                          *hvdtrain("recipe", TINY, "--epochs", "500", "--threads", "1", "--step-sleep", "0.05",
                                    "--stall-timeout", str(stall), "--output-dir", str(out)))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(**cluster.env()), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    link = f"{cluster.prefix}v1"
    try:
        beat = out / "heartbeats" / "rank-1.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # training is under way on both hosts
            try:
                if json.loads(beat.read_text())["step"] >= 8:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("the job never got going")
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        cut = time.monotonic()
        output, _ = proc.communicate(timeout=stall + 60)
        took = time.monotonic() - cut
    except (subprocess.TimeoutExpired, AssertionError):
        kill_tree(proc)
        raise
    finally:
        subprocess.run(["ip", "link", "set", link, "up"])
    assert proc.returncode != 0, output[-4000:]
    assert took < stall + 30, f"took {took:.0f}s to fail"
    assert f"cannot reach rank 1 on host1 ({cluster.hosts['host1']}) from rank 0 on host0" in output, output[-4000:]
    # The worker on the cut-off host ends by itself (its own collective timeout): nothing is left running there.
    deadline = time.monotonic() + stall + 15
    while cluster.python_processes("host1") and time.monotonic() < deadline:
        time.sleep(1)
    assert not cluster.python_processes("host1")
