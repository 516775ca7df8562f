"""hvdtrain on a real Ray cluster: a Ray head on one namespace host and a Ray node on another
(scripts/netns_cluster.sh), with Ray's token authentication as 'ray start' sets it up by default; the driver runs on
the head's host, as a user's would. Records must equal the same job's under horovodrun; failures end the job naming
the rank or the node."""
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

import pytest

from tests.e2e.conftest import read_metrics
from hvdtrain.bench.ray import PORT, ray_env, ray_start
from tests.helpers import (BIN, PY, ROOT, cluster_state, cluster_up, describe, env, horovodrun, hvdtrain, kill_tree,
                           run, why_no_netns)

pytest.importorskip("ray", reason="the ray extra (make install installs it)")

CLUSTER = os.path.join(ROOT, "scripts", "netns_cluster.sh")
TINY = "tests.tiny_recipe:TinyTrainer"
RAY_PORT = PORT
CPUS_PER_NODE = 2


@dataclass
class RayCluster:
    dir: str
    prefix: str
    hosts: dict  # name -> address
    token: str
    temp: str  # Ray's --temp-dir per node under it: short, as its socket paths must be (AF_UNIX: 107 bytes)

    @property
    def address(self) -> str:
        return f"{self.hosts['host0']}:{RAY_PORT}"

    def env(self) -> dict:
        return ray_env(self.token)

    def on(self, host: str, *cmd) -> list:
        return ["bash", CLUSTER, "run", self.dir, host, *cmd]

    def start_node(self, host: str) -> None:
        """``ray start`` on ``host``: the head on host0, a node joining it elsewhere (as ``bench ray`` starts them)."""
        i = int(host[len("host"):])
        r = run(self.on(host, *ray_start(i, self.address, self.hosts[host], CPUS_PER_NODE, self.temp)), timeout=120,
                **self.env())
        assert r.returncode == 0, describe(r)

    def ray(self, *args, timeout: float = 300):
        """``python -m hvdtrain ray --address HEAD ARGS`` on host0, as a user on the head node runs it."""
        return run(self.on("host0", PY, "-m", "hvdtrain", "ray", "--address", self.address, *args), timeout=timeout,
                   **self.env())

    def raylet_pids(self, host: str) -> list:
        ns = f"{self.prefix}h{host[len('host'):]}"
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[0].endswith(b"/raylet"):
                        out.append(int(pid))
            except OSError:
                continue
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("raycluster"))
    with cluster_up(CLUSTER, state, 3, why_no_netns()):  # Ray on host0 and host1; host2 joins the elastic test
        prefix, hosts = cluster_state(state)
        temp = tempfile.mkdtemp(prefix="hvdtrain-ray-", dir="/tmp")
        try:
            c = RayCluster(state, prefix, hosts, secrets.token_hex(32), temp)
            c.start_node("host0")
            c.start_node("host1")
            yield c
        finally:
            for host in hosts:  # each: ray stop on a host without Ray finds nothing to stop
                subprocess.run(c.on(host, os.path.join(BIN, "ray"), "stop", "--force"), capture_output=True,
                               timeout=120)
            shutil.rmtree(temp, ignore_errors=True)


def _hosts_of_ranks(out: str, size: int) -> list:
    hosts = []
    for rank in range(size):
        with open(os.path.join(out, "heartbeats", f"rank-{rank}.json")) as f:
            hosts.append(json.load(f)["addresses"])
    return hosts


MNIST = ("--epochs", "2", "--threads", "1", "--resume", "never")


@pytest.mark.parametrize("framework,np,placement", [("torch", 4, "pack"), ("mxnet", 2, "spread")])
def test_mnist_on_ray_across_hosts_equals_horovodrun(cluster, digits, tmp_path, framework, np, placement):
    """MNIST on the Ray cluster (4 ranks packed two to a node; 2 ranks spread one to a node), every record equal to
    the same job's under horovodrun on localhost; ranks numbered node by node from the driver's."""
    job = ("recipe", "mnist", "--framework", framework, "--data-dir", digits, *MNIST)
    ref = str(tmp_path / "horovodrun")
    r = run(horovodrun(np, *hvdtrain(*job, "--output-dir", ref)), timeout=300)
    assert r.returncode == 0, describe(r)
    out = str(tmp_path / "ray")
    r = cluster.ray("--num-workers", str(np), "--placement", placement, *job, "--output-dir", out)
    assert r.returncode == 0, describe(r)
    assert f"hvdtrain ray: {np} ranks on 2 node(s) ({cluster.hosts['host0']}, {cluster.hosts['host1']})" in r.stdout
    assert "val_accuracy" in r.stdout and "repeated" not in r.stdout, describe(r)
    got, want = read_metrics(out), read_metrics(ref)
    assert [g["epoch"] for g in got] == [w["epoch"] for w in want] == [1, 2]
    for g, w in zip(got, want):
        assert g["world_size"] == np and g["framework"] == framework
        assert g["val_accuracy"] == w["val_accuracy"], (g, w)
        for key in ("train_loss", "val_loss", "lr"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), (key, g, w)
    per_node = np // 2
    assert _hosts_of_ranks(out, np) == [[cluster.hosts["host0"]]] * per_node + [[cluster.hosts["host1"]]] * per_node


def test_a_failing_rank_ends_the_job_naming_rank_node_and_error(cluster, tmp_path):
    out = str(tmp_path / "out")
    r = cluster.ray("--num-workers", "2", "--placement", "spread", "recipe", TINY, "--epochs", "3", "--threads", "1",
                    "--fault", "raise", "--fault-rank", "1", "--fault-step", "3", "--output-dir", out, timeout=120)
    assert r.returncode == 1, describe(r)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hvdtrain: error: ray: rank 1 on Ray node {cluster.hosts['host1']} exited with status 1: ")
    assert "ValueError: injected failure at batch 3" in last, describe(r)
    assert os.path.exists(os.path.join(out, "errors", "rank-1.txt"))


def test_what_cannot_start_is_one_line_before_anything_starts(cluster, tmp_path):
    """Bad flags, a cluster that is not there, too few CPUs, a placement that does not exist, --elastic: exit 2 with
    one line, and nothing placed on the cluster."""
    cases = [
        (("--num-workers", "2", "--placment", "pack", "recipe", TINY), "ray: unknown option '--placment'"),
        (("recipe", TINY), "--num-workers N is required"),
        (("--num-workers", "two", "recipe", TINY), "--num-workers 'two': expects an integer"),
        (("--num-workers", "2", "--placement", "strict", "recipe", TINY), "--placement 'strict': choose from pack"),
        (("--num-workers", "2", "recipe", TINY, "--epochz", "1"), "--epochz"),
        (("--num-workers", "2", "recipe", TINY, "--framework", "mxnet", "--elastic"),
         "--elastic is available on --framework torch only"),
        (("--num-workers", "2", "--min-workers", "1", "recipe", TINY), "are for the recipe's --elastic"),
        (("--num-workers", "2", "--min-workers", "3", "recipe", TINY, "--elastic"), "need 1 <= MIN <= N <= MAX"),
        (("--num-workers", "5", "recipe", TINY), "the Ray cluster holds 4 such workers"),
        (("--num-workers", "2", "--cpus-per-worker", "3", "recipe", TINY), "the Ray cluster holds 0 such workers"),
        (("--num-workers", "1", "--gpus-per-worker", "1", "recipe", TINY), "the Ray cluster holds 0 such workers"),
    ]
    for args, says in cases:
        r = cluster.ray(*args, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (args, describe(r))
        assert "ranks on" not in r.stdout, (args, describe(r))
    # a head that is not there: the address of a host without Ray
    r = run(cluster.on("host0", PY, "-m", "hvdtrain", "ray", "--address", f"{cluster.hosts['host1']}:{RAY_PORT}",
                       "--num-workers", "1", "recipe", TINY), timeout=60, **cluster.env())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "cannot reach a Ray cluster there" in lines[0], describe(r)


DRIVER = """import sys
from hvdtrain import run_on_ray
from tests.tiny_recipe import TinyTrainer
run_on_ray(TinyTrainer, sys.argv[3:], num_workers=2, address=sys.argv[1], placement=sys.argv[2])
print("driver: done", flush=True)
"""


def test_the_python_api_trains_a_trainer_subclass_with_outputs_at_s3(cluster, tmp_path):
    """run_on_ray(TrainerClass, args) from a user's driver script, the outputs at s3:// (an S3 server on host0; the
    driver's AWS_* variables reach every rank), so that they outlive the cluster: records, config and checkpoints."""
    pytest.importorskip("moto.server", reason="moto[server] (the test extra)")
    import s3fs
    addr, port = cluster.hosts["host0"], 9077
    server = subprocess.Popen(cluster.on("host0", PY, "-m", "moto.server", "-H", addr, "-p", str(port)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    creds = {"AWS_ACCESS_KEY_ID": "hvdtrain", "AWS_SECRET_ACCESS_KEY": "hvdtrain", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_ENDPOINT_URL": f"http://{addr}:{port}"}
    try:
        fs = s3fs.S3FileSystem(key=creds["AWS_ACCESS_KEY_ID"], secret=creds["AWS_SECRET_ACCESS_KEY"],
                               endpoint_url=creds["AWS_ENDPOINT_URL"], skip_instance_cache=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                fs.mkdir("ray-runs")
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert server.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
                time.sleep(0.3)
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        url = "s3://ray-runs/tiny"
        r = run(cluster.on("host0", PY, str(script), cluster.address, "spread", "--epochs", "2", "--threads", "1",
                           "--output-dir", url), timeout=240, **cluster.env(), **creds)
        assert r.returncode == 0 and "driver: done" in r.stdout, describe(r)
        records = [json.loads(line) for line in fs.cat_file(url + "/metrics.jsonl").decode().splitlines() if line]
        assert [rec["epoch"] for rec in records] == [1, 2] and records[-1]["world_size"] == 2, records
        assert json.loads(fs.cat_file(url + "/config.json"))["epochs"] == 2
        assert any(p.rsplit("/", 1)[-1].startswith("ckpt-") for p in fs.ls(url + "/checkpoints")), fs.ls(url)
    finally:
        kill_tree(server)


def test_a_lost_node_ends_the_job_naming_it(cluster, tmp_path):
    """The raylet of host1 killed mid-run (the node lost, its rank with it), without --elastic: the job ends naming
    the node, and the rank on host0 does not wait on its lost peer."""
    out = str(tmp_path / "out")
    cmd = cluster.on("host0", PY, "-m", "hvdtrain", "ray", "--address", cluster.address, "--num-workers", "2",
                     "--placement", "spread", "recipe", TINY, "--epochs", "3", "--threads", "1", "--step-sleep", "0.5",
                     "--output-dir", out)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(**cluster.env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "heartbeats", "rank-1.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(2)
        raylets = cluster.raylet_pids("host1")
        assert len(raylets) == 1, raylets
        os.kill(raylets[0], signal.SIGKILL)
        lost = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    ended = time.monotonic() - lost
    assert proc.returncode == 1, (stdout, stderr)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"hvdtrain: error: ray: rank 1 on Ray node {cluster.hosts['host1']} (node id "), stderr
    assert "was lost" in last, last
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")) or len(read_metrics(out)) < 3
    print(f"the job ended {ended:.1f} s after the node was lost")
    cluster.start_node("host1")  # back, for whatever runs after


def _wait_for_records(proc, out, done, timeout=180.0) -> None:
    """Until ``done`` holds of the world sizes in OUTPUT_DIR/metrics.jsonl (its complete lines), the job alive."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(out / "metrics.jsonl") as f:
                sizes = [json.loads(line)["world_size"] for line in f if line.endswith("\n")]
        except FileNotFoundError:
            sizes = []
        if done(sizes):
            return
        assert proc.poll() is None and time.monotonic() < deadline, (sizes, proc.communicate()[0][-6000:])
        time.sleep(0.2)


def test_elastic_on_ray_loses_a_node_continues_and_grows_onto_a_new_one(cluster, tmp_path):
    """--elastic on Ray (PyTorch): 2 ranks, one per node; host1's raylet killed mid-run (the node and its rank lost),
    the survivor continues from the last commit alone; a Ray node started on host2 later, and the job grows back to
    2 ranks on it. As under horovodrun (tests/e2e/test_elastic.py): every epoch recorded once, the learning rate
    following the world size, the model trained. Horovod's elastic driver numbers the hosts in a set's order, so rank
    0 is on either node: when it is on host1, the rank on host0 becomes rank 0 and writes the records from the last
    commit on (Trainer.restore_position)."""
    out = tmp_path / "out"
    cmd = cluster.on("host0", PY, "-m", "hvdtrain", "ray", "--address", cluster.address, "--num-workers", "2",
                     "--min-workers", "1", "--max-workers", "2", "--cpus-per-worker", str(CPUS_PER_NODE), "recipe",
                     TINY, "--elastic", "--epochs", "16", "--commit-every", "2", "--threads", "1", "--step-sleep",
                     "0.2", "--output-dir", str(out))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(**cluster.env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait_for_records(proc, out, lambda sizes: sizes[:1] == [2])  # an epoch on both nodes, on a loaded host too
        (raylet,) = cluster.raylet_pids("host1")
        os.kill(raylet, signal.SIGKILL)
        _wait_for_records(proc, out, lambda sizes: 1 in sizes)  # an epoch on the survivor alone
        cluster.start_node("host2")
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output[-6000:]
    assert "elastic reset: 1 worker(s) now" in output and "elastic reset: 2 worker(s) now" in output, output[-6000:]
    records = read_metrics(str(out))
    sizes = [r["world_size"] for r in records]
    assert [r["epoch"] for r in records] == list(range(1, 17)), records
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    assert all(r["lr"] == pytest.approx(0.01 * r["world_size"]) for r in records), "lr follows the world size"
    assert records[-1]["val_accuracy"] > 0.95
    assert _hosts_of_ranks(str(out), 2)[1] == [cluster.hosts["host2"]], "rank 1 did not end on the node that joined"
    cluster.start_node("host1")  # back, for whatever runs after
