"""``python -m hvdtrain bench network``: Horovod's ring against MXNet's parameter server over rate-limited links.

The MXNet article's comparison (a single parameter server scaled to 38% where Horovod's ring held) is about network
bandwidth, which loopback does not have. This benchmark builds the hosts of ``scripts/netns_cluster.sh`` (one network
namespace per host, joined by a bridge; root only), limits every host's link in both directions with a ``tc tbf``
rate limit (``--burst``: a bucket of two frames by default, so that no burst passes at full speed), limits every
host to ``--cpu-quota`` cores (a cgroup per host: its workers, its server and what its sshd starts), and trains the
same Gluon network with the same fixed batch, one rank per host, in five arms:

- ``horovod``: Horovod's own example loop under ``horovodrun --gloo`` over ssh, with stock Horovod's settings
  (``HOROVOD_IDLE_WAIT=0``); the ring sends and receives 2(n-1)/n of the gradients per host per step;
- ``hvdtrain`` and ``hvdtrain sharded``: ``hvdtrain recipe mnist --synthetic`` itself on MXNet, as a user runs it,
  without and with ``--shard-optimizer`` (the same bytes on the wire, 1/n of the update on each rank);
- ``ps 1 server``: ``kvstore='dist_sync'`` with the scheduler and a single server on host0 (host0's link carries
  every other worker's gradients in and their weights out: (n-1) times the gradients each way);
- ``ps server per host``: one server on every host (MXNet splits each large array across the servers, so each link
  carries about what the ring's does).

Fairness: one baseline for every arm's scaling efficiency (the Gluon loop alone on host0, no Horovod and no kvstore:
img/s(n) / (n x img/s(1))); warm-up steps before the timed ones (the hvdtrain arms: a first epoch of 64 steps);
``--rounds`` interleaved rounds with the median, minimum and maximum; every worker's CPU seconds per timed step, the
servers' and scheduler's per step, and the fraction of the machine's cores that were busy during each variant, so a
run shows whether the cores or the links limited it. After the rounds, the collectives of a step are timed alone on
the same links at each host count (the plain step's allreduce; --shard-optimizer's reduce-scatter and allgather),
against the time their bytes take at the rate. The network is the MNIST recipe's with a wide hidden layer
(``--hidden``, 512 by default: 1.6 M of its 1.63 M parameters, 6.5 MB of gradients per step).
Every namespace, link, cgroup and process is removed at the end, however the run ends; traffic stays between the
namespaces.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..config import ConfigError
from .costmodel import rate_bits
from .ps import run_ps
from .runner import check_sizes, compare, free_port, run_worker, write

CLUSTER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                       "netns_cluster.sh")


QUOTA_PERIOD_US = 10000
"""The CPU quota's accounting period: 10 ms, not the kernel's 100 ms, so that a host that spent its share waits at most
6 ms rather than 60, which would quantise steps of 100-300 ms into whole throttled periods."""


class CpuQuota:
    """A CPU limit per namespace host (cgroup v1 ``cpu`` or cgroup v2 ``cpu.max``): ``cores`` cores for everything
    that runs on the host (its workers, its server, its sshd and what that starts), so that several hosts on one
    machine do not compete for its cores and the links, not the processors, limit a step."""

    def __init__(self, name: str, hosts: int, cores: float):
        v1, v2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            self.root, self.v2 = v1, False
        elif "cpu" in _read(os.path.join(v2, "cgroup.controllers")).split():
            self.root, self.v2 = v2, True
            with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
                f.write("+cpu")
        else:
            raise ConfigError("--cpu-quota needs the cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2 with "
                              "cpu in cgroup.controllers); pass --cpu-quota 0 to run without one")
        period = QUOTA_PERIOD_US
        self.dirs = []
        for i in range(hosts):
            path = os.path.join(self.root, f"{name}-h{i}")
            os.makedirs(path, exist_ok=True)
            self.dirs.append(path)
            if self.v2:
                _write(os.path.join(path, "cpu.max"), f"{int(cores * period)} {period}")
            else:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(cores * period)))

    def procs(self, host: int) -> str:
        return os.path.join(self.dirs[host], "cgroup.procs")

    def add(self, host: int, pid: int) -> None:
        _write(self.procs(host), str(pid))

    def remove(self) -> None:
        for path in self.dirs:
            for _ in range(50):  # the processes the cluster's teardown killed leave the group as they exit
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    time.sleep(0.1)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class Cluster:
    """The namespace hosts of one run: ``prefix(i)`` runs a command on host i (inside its CPU quota, if any)."""

    def __init__(self, state: str, hosts: int, quota: Optional[CpuQuota] = None):
        self.state, self.quota = state, quota
        env = dict(line.strip().split("=", 1) for line in open(os.path.join(state, "env")) if "=" in line)
        self.ns_prefix = env["NETNS_PREFIX"]
        self.addresses = [line.split()[1] for line in open(os.path.join(state, "hosts")) if line.strip()][:hosts]
        if quota is not None:  # each host's sshd, so that what horovodrun starts over ssh is in the host's quota
            for i in range(hosts):
                pids = _run(["ip", "netns", "pids", f"{self.ns_prefix}h{i}"], f"ip netns pids on host{i}").split()
                for pid in pids:
                    quota.add(i, int(pid))

    def prefix(self, host: int) -> List[str]:
        # ip netns exec mounts a /sys without the cgroups: cgroups.sh mounts them again, so that a rank reads its
        # host's quota as in a container (hvdtrain chooses its threads and Horovod's wait by it).
        ns = ["ip", "netns", "exec", f"{self.ns_prefix}h{host}", "sh", os.path.join(self.state, "cgroups.sh")]
        if self.quota is None:
            return ns
        # Into the host's group before entering its namespace.
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self.quota.procs(host), *ns]

    def links(self) -> Iterator[Tuple[List[str], str]]:
        """(command prefix, device) of both ends of every host's link: its own eth0 (what it sends) and its port on
        the bridge (what it receives)."""
        for i in range(len(self.addresses)):
            yield ["ip", "netns", "exec", f"{self.ns_prefix}h{i}"], "eth0"
            yield [], f"{self.ns_prefix}v{i}"


def _run(cmd: Sequence[str], what: str, timeout: float = 600) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench: {what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


@contextlib.contextmanager
def shaped_cluster(hosts: int, rate: str, burst: int = 0, cpu_quota: float = 0.0) -> Iterator[Cluster]:
    """``hosts`` namespace hosts, every link limited to ``rate`` each way (``burst`` bytes of tbf bucket; 0: tc's
    rule of thumb, rate / 100 Hz), each host limited to ``cpu_quota`` cores (0: none); all of it removed on the way
    out."""
    if os.geteuid() != 0:
        raise ConfigError("bench network needs root (network namespaces and tc)")
    if not os.path.exists(CLUSTER):
        raise ConfigError(f"bench network needs the repository's scripts/netns_cluster.sh (not found at {CLUSTER})")
    burst = burst or max(32 * 1024, int(rate_bits(rate) / 8 / 100))
    # A kill (SIGTERM) unwinds like Ctrl-C, so the namespaces and links go with the run.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    quota = None
    with tempfile.TemporaryDirectory(prefix="hvdtrain-net-") as state:
        try:
            _run(["bash", CLUSTER, "up", state, str(hosts)], "netns_cluster.sh up")
            if cpu_quota:
                quota = CpuQuota(f"hvdtrain-net-{os.getpid()}", hosts, cpu_quota)
            cluster = Cluster(state, hosts, quota)
            for prefix, dev in cluster.links():
                _run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                      "latency", "50ms"], f"tc on {dev}")
            print(f"bench: {hosts} hosts up, every link limited to {rate} each way (tc tbf, burst {burst} bytes)"
                  + (f", each host to {cpu_quota:g} cores" if cpu_quota else ""), flush=True)
            yield cluster
        finally:
            subprocess.run(["bash", CLUSTER, "down", state], capture_output=True, timeout=120)
            if quota is not None:
                quota.remove()
            signal.signal(signal.SIGTERM, previous)


def _launch(cluster: Cluster, n: int, command: Sequence[str]) -> List[str]:
    """horovodrun on host0 over the first ``n`` hosts, one rank each, running ``command``. Over several hosts their
    interface is named (as DDP's arm names it to c10d): horovodrun's own search for it starts a task service on every
    host and has each probe the others, which at 8 hosts of 0.25 cores outran its 30 s start-up limit; the limit is
    raised too, for the ssh start-ups that remain. (On host0 alone horovodrun wants the loopback, not eth0.)"""
    binary = os.path.dirname(sys.executable)
    hosts = ",".join(f"host{i}:1" for i in range(n))
    path = os.pathsep.join([os.path.join(cluster.state, "bin"), binary, os.environ.get("PATH", "")])
    nic = ["--network-interfaces", "eth0"] if n > 1 else []
    return [*cluster.prefix(0), "env", f"PATH={path}", os.path.join(binary, "horovodrun"), "-np", str(n), "-H", hosts,
            "--gloo", *nic, "--start-timeout", str(START_TIMEOUT), sys.executable, *command]


START_TIMEOUT = 180
"""Seconds horovodrun may take to start the bench's ranks (its default, 30, is for hosts with whole cores)."""


def _rank_cpu(result: str) -> Dict:
    """The workers' CPU seconds per timed step, by rank, in all and by thread role, and their wall seconds per step
    by phase where the loop times them (hvdtrain.bench.loops writes RESULT.rankN)."""
    rows = []
    for path in sorted(glob.glob(result + ".rank*")):
        with open(path) as f:
            row = json.load(f)
        rows.append((row["rank"], row["cpu_seconds_per_step"], row.get("thread_cpu_per_step") or {},
                     row.get("phase_seconds_per_step") or {}, row.get("thread_wakeups_per_step") or {}))
    rows.sort(key=lambda r: r[0])
    roles = rows[0][2] if rows else {}
    phases = rows[0][3] if rows else {}
    return {"worker_cpu_per_step": [r[1] for r in rows],
            "thread_cpu_per_step": {role: [r[2].get(role, 0.0) for r in rows] for role in roles},
            "phase_seconds_per_step": {phase: [r[3].get(phase, 0.0) for r in rows] for phase in phases},
            "thread_wakeups_per_step": {role: [r[4].get(role, 0.0) for r in rows] for role in roles if role != "ended"}}


def _single(cluster: Cluster, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
            timeout: float) -> Dict:
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        cmd = [*cluster.prefix(0), sys.executable, "-m", "hvdtrain.bench.loops", "single-mxnet", "--recipe", "mnist",
               "--steps", str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads", "1",
               "--result", result, "--", *recipe_args]
        ips = run_worker(cmd, result, timeout, "the single worker", {"OMP_NUM_THREADS": "1"})["images_per_sec"]
        return {"images_per_sec": float(ips), **_rank_cpu(result)}


STOCK_HOROVOD = {"OMP_NUM_THREADS": "1", "HOROVOD_IDLE_WAIT": "0", "HOROVOD_SPIN_WAIT": "1"}
"""Stock Horovod 0.28.1's behaviour in hvdtrain's build (scripts/patch_horovod.py): its background loop negotiates
every cycle (fixes 3 off) and horovod.torch waits for a collective by spinning (fix 5 off)."""


def _horovod(cluster: Cluster, n: int, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
             timeout: float, loop: str = "horovod-mxnet") -> Dict:
    """Horovod's own example loop (``horovod-mxnet`` or ``horovod-torch``), as stock Horovod runs it."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        cmd = _launch(cluster, n, ["-m", "hvdtrain.bench.loops", loop, "--recipe", "mnist", "--steps",
                                   str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads",
                                   "1", "--result", result, "--", *recipe_args])
        ips = run_worker(cmd, result, timeout, f"{loop} on {n} host(s)", STOCK_HOROVOD)["images_per_sec"]
        return {"images_per_sec": float(ips), **_rank_cpu(result)}


def _ddp(cluster: Cluster, n: int, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
         timeout: float, bucket_cap_mb: Optional[float] = None) -> Dict:
    """PyTorch DDP as its documentation runs it on several machines: ``torchrun --nnodes n --node-rank i
    --master-addr host0`` on every host (inside its namespace and quota), c10d's Gloo backend on the hosts' eth0,
    the same model, batch and loop as Horovod's (``hvdtrain.bench.loops ddp-torch``); ``bucket_cap_mb``: DDP's
    gradient bucket size (None: its default, 25 MB)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        loop = ["-m", "hvdtrain.bench.loops", "ddp-torch", "--recipe", "mnist", "--steps", str(steps), "--warmup",
                str(warmup), "--batch-size", str(batch_size), "--threads", "1", "--result", result]
        if bucket_cap_mb is not None:
            loop += ["--bucket-cap-mb", f"{bucket_cap_mb:g}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        procs = []
        try:
            for i in range(n):
                cmd = [*cluster.prefix(i), torchrun, "--nnodes", str(n), "--nproc-per-node", "1", "--node-rank",
                       str(i), "--master-addr", cluster.addresses[0], "--master-port", port, *loop, "--",
                       *recipe_args]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True, env=env))
            deadline = time.monotonic() + timeout
            outputs = []
            for i, proc in enumerate(procs):
                try:
                    outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"bench: ddp on {n} host(s) did not finish within {timeout:.0f}s") from None
                if proc.returncode != 0:
                    lines = outputs[-1].strip().splitlines()
                    raise RuntimeError(f"bench: ddp on {n} host(s) failed on host{i} (exit {proc.returncode}): "
                                       + " | ".join(lines[-3:]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        with open(result) as f:
            ips = json.load(f)["images_per_sec"]
        return {"images_per_sec": float(ips), **_rank_cpu(result)}


def _hvdtrain(cluster: Cluster, n: int, batch_size: int, recipe_args: Sequence[str], timeout: float,
              extra: Sequence[str] = (), framework: str = "mxnet", env: Optional[Dict[str, str]] = None) -> Dict:
    """hvdtrain itself (``recipe mnist --synthetic`` on ``framework``, its own Horovod settings unless ``env`` sets
    them): 2 epochs of 64 steps, the first the warm-up, the img/s of the second."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        cmd = _launch(cluster, n, ["-m", "hvdtrain", "recipe", "mnist", "--framework", framework, "--synthetic",
                                   "--epochs", "2", "--warmup-epochs", "0", "--batch-size", str(batch_size),
                                   "--threads", "1", "--precision", "fp32", "--resume", "never", "--output-dir", out,
                                   *recipe_args, *extra])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        metrics = os.path.join(out, "metrics.jsonl")
        if proc.returncode != 0 or not os.path.exists(metrics):
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            raise RuntimeError(f"bench: hvdtrain on {n} host(s) failed (exit {proc.returncode}): "
                               + " | ".join(lines[-3:]))
        with open(metrics) as f:
            last = json.loads(f.readlines()[-1])
        return {"images_per_sec": float(last["images_per_sec"]), "worker_cpu_per_step": last["cpu_seconds_per_step"],
                "thread_cpu_per_step": last.get("thread_cpu_per_step", {}), "phase_seconds": last.get("phase_seconds")}


FRONTENDS = {"mxnet": ("mxnet", {}), "torch": ("torch", {"HOROVOD_SPIN_WAIT": "0"}),
             "torch-spin": ("torch", {"HOROVOD_SPIN_WAIT": "1"})}
"""How the collectives can be timed: through horovod.mxnet (which waits on MXNet's engine), through horovod.torch
with hvdtrain's blocking wait (scripts/patch_horovod.py, fix 5), or with horovod.torch 0.28.1's spinning wait."""


def _collectives(cluster: Cluster, n: int, elements: int, timeout: float,
                 frontend: str = "mxnet") -> Tuple[Dict[str, float], Dict[str, float]]:
    """Seconds per operation of the collectives a step sends, each timed on its own on the same links (the plain
    step's allreduce of the gradients, and --shard-optimizer's reduce-scatter of them and allgather of one shard),
    and rank 0's CPU seconds per operation, through ``frontend`` (:data:`FRONTENDS`)."""
    framework, env = FRONTENDS[frontend]
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        cmd = _launch(cluster, n, ["-m", "hvdtrain.bench.allreduce_worker", "horovod", "shard", "--elements",
                                   str(elements), "--framework", framework, "--rounds", "10", "--result", result])
        row = run_worker(cmd, result, timeout, f"the collectives on {n} host(s) through {frontend}",
                         {"OMP_NUM_THREADS": "1", "HOROVOD_IDLE_WAIT": "1", **env})
        return {op: row[op] for op in ("allreduce", "reducescatter", "allgather")}, row["cpu_seconds"]


def _collectives_rows(cluster: Cluster, hosts: Sequence[int], hidden: int, rate: str, timeout: float,
                      frontends: Sequence[str] = ("mxnet",), rounds: int = 1, elements: int = 0) -> Dict:
    """The step's collectives alone on the links at each host count, and the time their bytes take at the rate: the
    ring allreduce sends and receives 2(n-1)/n of the gradients per host, the reduce-scatter and the allgather
    (n-1)/n each. Through each of ``frontends``, interleaved over ``rounds`` (the median per operation); the first
    frontend's figures are also the top-level ``collectives_seconds``. ``elements``: another vector size than the
    network's gradients."""
    elements = elements or gradient_bytes(hidden) // 4
    samples: Dict[str, Dict[int, List]] = {fe: {n: [] for n in hosts} for fe in frontends}
    for _ in range(rounds):
        for n in hosts:
            for fe in frontends:
                samples[fe][n].append(_collectives(cluster, n, elements, timeout, fe))
    per = {fe: {"collectives_seconds": {n: _median_ops([t[0] for t in samples[fe][n]]) for n in hosts},
                "collectives_cpu_seconds": {n: _median_ops([t[1] for t in samples[fe][n]]) for n in hosts},
                "samples": {n: [t[0] for t in samples[fe][n]] for n in hosts}} for fe in frontends}
    link = {n: (n - 1) / n * elements * 4 * 8 / rate_bits(rate) for n in hosts}
    first = per[frontends[0]]
    out = {"collectives_seconds": first["collectives_seconds"],
           "collectives_cpu_seconds": first["collectives_cpu_seconds"],  # rank 0's process, per operation
           "collectives_ideal_seconds": {n: {"allreduce": 2 * link[n], "reducescatter": link[n], "allgather": link[n]}
                                         for n in hosts}}
    if len(frontends) > 1:
        out["frontends"] = per
    return out


def _median_ops(rows: List[Dict[str, float]]) -> Dict[str, float]:
    return {op: statistics.median(r[op] for r in rows) for op in rows[0]}


def collectives_only(hosts: Sequence[int], rate: str, hidden: int, timeout: float = 600, burst: int = 0,
                     cpu_quota: float = 0.0, frontends: Sequence[str] = ("mxnet",), rounds: int = 1) -> Dict:
    """``--collectives-only``: the same cluster, links and quotas, the collectives alone (a few minutes), through
    each of ``frontends``."""
    elements = gradient_bytes(hidden) // 4
    with shaped_cluster(max(hosts), rate, burst, cpu_quota) as cluster:
        rows = _collectives_rows(cluster, hosts, hidden, rate, timeout, frontends, rounds, elements)
        # a second size, through the first frontend: what separates the per-message cost from the per-byte ones
        small = _collectives_rows(cluster, hosts, hidden, rate, timeout, frontends[:1], rounds, elements // 8)
    return {"benchmark": "network collectives", "framework": frontends[0], "frontends_timed": list(frontends),
            "rounds": rounds, "model": f"mnist recipe, --hidden {hidden}",
            "gradient_mb": 4 * elements / 1e6, "rate": rate, "cpu_quota_cores": cpu_quota, **rows,
            "calibration": calibrate({4 * elements: rows, 4 * (elements // 8): small}, rate),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def calibrate(timed: Dict[int, Dict], rate: str) -> Dict:
    """The links' alpha, beta and gamma (:func:`hvdtrain.bench.costmodel.fit_link`) from the collectives timed at
    each vector size in bytes (``_collectives_rows`` results), every host count and operation."""
    from .costmodel import fit_link
    samples = [(op, nbytes, int(n), seconds) for nbytes, rows in timed.items()
               for n, ops in rows["collectives_seconds"].items() for op, seconds in ops.items()]
    fit = fit_link(samples)
    return {**fit, "sizes_bytes": sorted(timed), "samples": len(samples), "beta_at_rate": 8.0 / rate_bits(rate),
            "timings": [list(s) for s in samples]}  # (operation, bytes, hosts, seconds): to refit elsewhere


def _print_collectives(result: Dict) -> None:
    if "collectives_seconds" not in result:  # not measured (a failure, warned of)
        return
    cal = result.get("calibration")
    if cal:
        sizes = ", ".join(f"{b / 1e6:.2f} MB" for b in cal["sizes_bytes"])
        mbit = f"{8e-6 / cal['beta']:.0f} Mbit/s" if cal["beta"] > 0 else "unresolved"
        print(f"calibration ({cal['samples']} timed collectives, sizes {sizes}): "
              f"alpha {1e6 * cal['alpha']:.0f} us per message, beta {1e9 * cal['beta']:.2f} ns per byte "
              f"({mbit}; the rate alone: {1e9 * cal['beta_at_rate']:.2f}), gamma "
              f"{1e9 * cal['gamma']:.2f} ns per byte reduced; the fit's largest error "
              f"{100 * cal['max_relative_error']:.0f}%", flush=True)
        ring = allreduce_link(cal)
        if ring:
            print(f"the allreduces alone (Horovod's arms): alpha {1e6 * ring['alpha']:.0f} us per message, "
                  f"2 beta + gamma {1e9 * (2 * ring['beta'] + ring['gamma']):.2f} ns per byte; the fit's largest "
                  f"error {100 * ring['max_relative_error']:.0f}%", flush=True)
    timed = result.get("frontends") or {result.get("framework", "mxnet"): result}
    for fe, res in timed.items():
        via = f" through {fe}" if "frontends" in result else ""
        for n, ops in res["collectives_seconds"].items():
            ideal = result["collectives_ideal_seconds"][n]
            print(f"{n} host(s), the step's collectives alone{via}: " + ", ".join(
                f"{op} {1e3 * t:.0f} ms ({100 * ideal[op] / t:.0f}% of the link, "
                f"{1e3 * res['collectives_cpu_seconds'][n][op]:.0f} ms CPU)" for op, t in ops.items())
                + f"; reduce-scatter + allgather / allreduce "
                  f"{(ops['reducescatter'] + ops['allgather']) / ops['allreduce']:.2f}", flush=True)


def _ps(cluster: Cluster, n: int, servers: int, steps: int, warmup: int, batch_size: int,
        recipe_args: Sequence[str], timeout: float) -> Dict:
    def place(role: str, index: int):
        host = 0 if role == "scheduler" else index  # server j on host j, worker i on host i
        return cluster.prefix(host), cluster.addresses[host], "eth0"
    return run_ps("mnist", n, servers, 1, steps, batch_size, timeout, place, recipe_args, warmup=warmup, details=True)


def gradient_shapes(hidden: int) -> List[Tuple[int, ...]]:
    """The shapes of the benchmark network's gradients (the recipe's, the same on both frameworks)."""
    from .loops import _recipe
    trainer = _recipe("mnist", "torch", 32, 1, ["--hidden", str(hidden)])
    return [tuple(p.shape) for p in trainer.build_torch().parameters()]


def gradient_bytes(hidden: int) -> int:
    """Bytes of float32 gradients of the benchmark's network."""
    return 4 * sum(int(math.prod(s)) for s in gradient_shapes(hidden))


def allreduce_paths(hosts: Sequence[int], rate: str, hidden: int, timeout: float = 600, burst: int = 0,
                    cpu_quota: float = 0.0, rounds: int = 3) -> Dict:
    """``--allreduce-paths``: the step's gradients averaged three ways on the same links and quota
    (:data:`hvdtrain.bench.allreduce_worker.PATHS`: Horovod per gradient, Horovod on one flat tensor, c10d's Gloo on
    it), interleaved in one job per host count; seconds and each rank's CPU by thread role per operation."""
    shapes = ",".join("x".join(str(d) for d in s) for s in gradient_shapes(hidden))
    rows = {}
    with shaped_cluster(max(hosts), rate, burst, cpu_quota) as cluster:
        for n in hosts:
            with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
                result = os.path.join(out, "result.json")
                cmd = _launch(cluster, n, ["-m", "hvdtrain.bench.allreduce_worker", "horovod", "paths", "--shapes",
                                           shapes, "--master", f"{cluster.addresses[0]}:{free_port()}", "--rounds",
                                           "5", "--repeats", str(rounds), "--result", result])
                rows[n] = run_worker(cmd, result, timeout, f"the allreduce paths on {n} host(s)",
                                     {"OMP_NUM_THREADS": "1", "HOROVOD_IDLE_WAIT": "1", "HOROVOD_SPIN_WAIT": "0",
                                      "GLOO_SOCKET_IFNAME": "eth0"})
    return {"benchmark": "network allreduce paths", "model": f"mnist recipe, --hidden {hidden}", "rate": rate,
            "cpu_quota_cores": cpu_quota, "repeats": rounds, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _print_paths(result: Dict) -> None:
    for n, row in result["rows"].items():
        for path, seconds in row["seconds"].items():
            per_rank = [cpu[path] for cpu in row["thread_cpu_per_op"]]
            span = {role: (min(r[role] for r in per_rank), max(r[role] for r in per_rank))
                    for role in ("main", "horovod", "transport", "ended")}
            roles = ", ".join(f"{role} {1e3 * lo:.0f}-{1e3 * hi:.0f}" for role, (lo, hi) in span.items() if hi > 0)
            total = [sum(r.values()) for r in per_rank]
            woken = [w[path]["transport"] for w in row.get("thread_wakeups_per_op", [])]
            wakeups = f", transport wake-ups {min(woken):.0f}-{max(woken):.0f}" if woken else ""
            print(f"{n} host(s), {path} ({row['tensors'] if path == 'horovod gradients' else 1} tensor(s), "
                  f"{row['bytes'] / 1e6:.2f} MB): {1e3 * seconds:.0f} ms, CPU per operation "
                  f"{1e3 * min(total):.0f}-{1e3 * max(total):.0f} ms over the ranks ({roles}{wakeups})", flush=True)


ARMS = ("horovod", "hvdtrain", "hvdtrain sharded", "ps 1 server", "ps server per host")
"""The MXNet arms: horovod: Horovod's example loop, stock settings; hvdtrain: the recipe under hvdtrain; hvdtrain
sharded: with --shard-optimizer; ps: MXNet's parameter server (kvstore dist_sync) with one server on host0 or one on
every host. Their scaling efficiency is taken against one baseline, the Gluon loop alone on one host."""
TORCH_ARM = "hvdtrain torch"
DDP_TUNED_BUCKET_MB = 1.0
"""The tuned DDP arm's bucket size. The 6.5 MB of gradients fit one default 25 MB bucket, which DDP sends only when
the whole backward pass is done; 1 MB buckets start sending while it runs."""
ARM_GROUPS = {
    "mxnet": ARMS,
    "hvdtrain-mxnet": ("hvdtrain",),
    "torch": (TORCH_ARM,),
    "torch-spin": (f"{TORCH_ARM} spin",),
    "ddp": ("ddp", f"ddp bucket {DDP_TUNED_BUCKET_MB:g}mb"),
    "horovod-torch": ("horovod torch",),
}
"""What ``--frameworks`` names: every MXNet arm, hvdtrain on MXNet alone, hvdtrain on PyTorch (and with horovod.torch's
spinning wait, what every rank of this benchmark used before its hosts showed their quota), PyTorch DDP under
torchrun (its default bucket and a tuned one), and Horovod's own PyTorch example loop with stock settings. The
PyTorch arms' efficiency is each against its own run on one host."""


def parse_arms(text: str) -> Tuple[str, ...]:
    """The arms ``--frameworks`` names (comma-separated groups of :data:`ARM_GROUPS`), in order, each once; a
    ConfigError naming the bad group otherwise."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in groups if g not in ARM_GROUPS]
    if bad or not groups:
        raise ConfigError(f"--frameworks {text!r}: {'unknown ' + ', '.join(bad) if bad else 'none given'}; choose "
                          f"from {', '.join(ARM_GROUPS)} (comma-separated)")
    arms: List[str] = []
    for g in groups:
        arms += [a for a in ARM_GROUPS[g] if a not in arms]
    return tuple(arms)


def _arm(name: str, cluster: Cluster, n: int, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
         timeout: float):
    """A zero-argument run of arm ``name`` on ``n`` hosts."""
    common = (cluster, n, steps, warmup, batch_size, recipe_args, timeout)
    runs = {
        "horovod": lambda: _horovod(*common),
        "hvdtrain": lambda: _hvdtrain(cluster, n, batch_size, recipe_args, timeout),
        "hvdtrain sharded": lambda: _hvdtrain(cluster, n, batch_size, recipe_args, timeout, ["--shard-optimizer"]),
        "ps 1 server": lambda: _ps(cluster, n, 1, steps, warmup, batch_size, recipe_args, timeout),
        "ps server per host": lambda: _ps(cluster, n, n, steps, warmup, batch_size, recipe_args, timeout),
        TORCH_ARM: lambda: _hvdtrain(cluster, n, batch_size, recipe_args, timeout, framework="torch"),
        f"{TORCH_ARM} spin": lambda: _hvdtrain(cluster, n, batch_size, recipe_args, timeout, framework="torch",
                                               env={"HOROVOD_SPIN_WAIT": "1"}),
        "ddp": lambda: _ddp(*common),
        f"ddp bucket {DDP_TUNED_BUCKET_MB:g}mb": lambda: _ddp(*common, bucket_cap_mb=DDP_TUNED_BUCKET_MB),
        "horovod torch": lambda: _horovod(*common, loop="horovod-torch"),
    }
    return runs[name]


def network(hosts: Sequence[int], rate: str, hidden: int, rounds: int, steps: int, batch_size: int,
            timeout: float = 600, warmup: int = 10, burst: int = 0, cpu_quota: float = 0.0,
            arms: Sequence[str] = ARMS, journal: str = "") -> Dict:
    """The arms at each host count on the shaped hosts, interleaved over ``rounds`` (each sample also appended to
    ``journal`` as it comes), then the step's collectives alone; a failure of the latter is a warning."""
    recipe_args = ["--hidden", str(hidden)]
    arms = tuple(arms)
    own_base = [a for a in arms if a not in ARMS]  # the PyTorch arms: their own run on one host
    with shaped_cluster(max(hosts), rate, burst, cpu_quota) as cluster:
        variants = {}
        if set(arms) & set(ARMS):
            variants["single worker"] = lambda: _single(cluster, steps, warmup, batch_size, recipe_args, timeout)
        for arm in own_base:
            variants[f"{arm} n=1"] = _arm(arm, cluster, 1, steps, warmup, batch_size, recipe_args, timeout)
        for n in hosts:
            for arm in arms:
                variants[f"{arm} n={n}"] = _arm(arm, cluster, n, steps, warmup, batch_size, recipe_args, timeout)
        res = compare(variants, rounds, journal)
        try:
            collectives = _collectives_rows(cluster, hosts, hidden, rate, timeout)
        except RuntimeError as e:  # the arms' hours of samples are kept: the collectives are an addendum
            print(f"hvdtrain: warning: {e}; network.json is written without the collectives alone",
                  file=sys.stderr, flush=True)
            collectives = {"collectives_error": str(e)}
    ips = {k: v["images_per_sec"] for k, v in res.items()}
    # One baseline for every MXNet arm: the Gluon loop alone, no Horovod, no kvstore; a PyTorch arm's: its own host.
    bases = {arm: ips[f"{arm} n=1"] if arm in own_base else ips["single worker"] for arm in arms}
    base = bases[arms[0]]
    rows = [{"hosts": 1, **{arm: {"images_per_sec": bases[arm], "efficiency": 1.0} for arm in arms}}]
    for n in hosts:
        rows.append({"hosts": n, **{arm: {"images_per_sec": ips[f"{arm} n={n}"],
                                          "efficiency": ips[f"{arm} n={n}"] / (n * bases[arm]),
                                          "spread": [res[f"{arm} n={n}"]["min"], res[f"{arm} n={n}"]["max"]]}
                                    for arm in arms}})
    gradient_mb = gradient_bytes(hidden) / 1e6
    return {"benchmark": "network", "framework": "mxnet", "model": f"mnist recipe, --hidden {hidden}", "hidden": hidden,
            "gradient_mb": gradient_mb, "rate": rate, "rate_bits_per_sec": rate_bits(rate),
            "burst_bytes": burst or max(32 * 1024, int(rate_bits(rate) / 8 / 100)), "cpu_quota_cores": cpu_quota,
            "cpu_quota_period_us": QUOTA_PERIOD_US if cpu_quota else None,
            "compute_seconds_per_step": batch_size / base,
            "base_arm": arms[0],
            "ideal_seconds_per_step": {  # the bytes each arm's busiest link carries per step, at the rate
                "horovod": {n: 2 * (n - 1) / n * gradient_mb * 8e6 / rate_bits(rate) for n in hosts},
                "ps 1 server": {n: (n - 1) * gradient_mb * 8e6 / rate_bits(rate) for n in hosts}},
            **collectives,
            "rounds": rounds, "steps": steps, "warmup": warmup, "batch_size": batch_size, "threads_per_rank": 1,
            "arms": list(arms), "variants": res, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def read_calibration(path: str, rate: str, cpu_quota: float) -> Dict:
    """The ``calibration`` of a collectives.json, checked to be of the same links and quota."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--predict-from {path}: cannot read it ({e})")
    if "calibration" not in data:
        raise ConfigError(f"--predict-from {path}: no calibration in it; write one with --collectives-only")
    if rate_bits(data["rate"]) != rate_bits(rate) or float(data.get("cpu_quota_cores") or 0) != float(cpu_quota):
        raise ConfigError(f"--predict-from {path}: calibrated at {data['rate']} and "
                          f"{data.get('cpu_quota_cores') or 0:g} cores per host, not {rate} and {cpu_quota:g}; "
                          f"calibrate at the same --rate and --cpu-quota")
    cpu = {int(n): ops["allreduce"] for n, ops in (data.get("collectives_cpu_seconds") or {}).items()}
    return {**data["calibration"], "hosts": sorted(int(n) for n in data["collectives_seconds"]),
            "allreduce_cpu_seconds": cpu, "allreduce_link": allreduce_link(data["calibration"])}


def allreduce_link(calibration: Dict) -> Optional[Dict[str, float]]:
    """alpha, beta and gamma fitted to the calibration's allreduces alone (None with fewer than 3 of them): the link
    as Horovod's arms use it. The fit over every operation also weighs Gloo's reduce-scatter and allgather through
    Horovod, which scale otherwise on these hosts (at 200 Mbit/s and 0.25 cores: the reduce-scatter took as long on 3
    hosts as the allreduce, 407 against 423 ms), and its error on the allreduce itself reached 43%."""
    from .costmodel import fit_link
    timed = [tuple(t) for t in calibration.get("timings") or [] if t[0] == "allreduce"]
    return fit_link(timed) if len(timed) >= 3 else None


def _median_worker_cpu(variant: Dict) -> Optional[float]:
    """The median over rounds of a variant's mean worker CPU seconds per step (None where not recorded)."""
    per_round = [statistics.mean(r["worker_cpu_per_step"]) for r in variant.get("rounds", [])
                 if r.get("worker_cpu_per_step")]
    return statistics.median(per_round) if per_round else None


def predict(result: Dict, calibration: Dict) -> List[Dict]:
    """The cost model's step time and img/s for each measured arm and host count: the links from ``calibration``
    (fitted to collectives on other host counts; for Horovod's arms to its allreduces alone, :func:`allreduce_link`,
    whose beta and gamma come out as one sum, which is all a ring allreduce's cost uses), one worker's compute from
    this run's single-worker arm, when each gradient is ready from the network's PyTorch twin on this machine
    (:func:`hvdtrain.bench.profile.measure`), the gradients in the groups each backend sends on the CPU (MXNet's
    inherits the base's one group).

    Under a CPU quota the hvdtrain arms are predicted twice: with the links alone (``links_only_*``), and with the
    host's CPU shared by the compute and the collectives (:class:`hvdtrain.bench.costmodel.HostCpu`: the one worker's
    measured CPU per step, and an allreduce's CPU fitted to the calibration's collectives, timed alone on other host
    counts), the step being the longer of the two; ``predicted_*`` and ``error`` are the latter's. The parameter
    server arms keep the links alone (their servers' CPU is not modelled)."""
    from .costmodel import HostCpu, Link, fit_cpu, horovod_step, ps_step, ring_allreduce
    from .profile import measure
    from ..backends.base import Backend
    from ..backends.torch import TorchBackend
    from ..backends.torch_groups import plan_sizes
    link = Link(calibration["alpha"], calibration["beta"], calibration["gamma"])
    fitted = calibration.get("allreduce_link")
    ring = Link(fitted["alpha"], fitted["beta"], fitted["gamma"]) if fitted else link  # Horovod's arms: allreduces
    batch = result["batch_size"]
    profile = measure("mnist", batch_size=batch, hidden=result["hidden"])
    one = result["rows"][0]
    mxnet = [a for a in ARMS if a in one]
    compute = profile.scaled(batch / one[mxnet[0]]["images_per_sec"]) if mxnet else None  # the single worker's step
    torch = profile.scaled(batch / one[TORCH_ARM]["images_per_sec"]) if TORCH_ARM in one else None
    # hvdtrain's arms send their gradients in groups on the CPU (--allreduce-groups auto): MXNet's one group after
    # the backward pass, PyTorch's DDP buckets (the first leaves during it); stock Horovod's one per gradient.
    sizes = [int(b) for b, _ in profile.gradients]
    hvdtrain_arm = {arm: c.in_groups(plan_sizes(sizes, backend.cpu_allreduce_groups)) if c is not None else None
                    for arm, c, backend in (("hvdtrain", compute, Backend), (TORCH_ARM, torch, TorchBackend))}
    cores, cpu_fit = float(result.get("cpu_quota_cores") or 0), calibration.get("allreduce_cpu_seconds")
    host_cpu = {}
    if cores and cpu_fit:
        per_message, per_pass = fit_cpu(cpu_fit)
        for arm, variant in (("hvdtrain", "single worker"), (TORCH_ARM, f"{TORCH_ARM} n=1")):
            alone = _median_worker_cpu(result["variants"].get(variant, {}))
            if alone is not None:
                host_cpu[arm] = HostCpu(cores, alone, per_message, per_pass)
    rows = []
    for row in result["rows"][1:]:
        n = row["hosts"]
        # The run's own allreduce alone at n hosts (timed after its arms), where it was: the step predicted again
        # with the link scaled to it separates the links' extrapolation from the step's model (a diagnosis only).
        alone = (result.get("collectives_seconds") or {}).get(str(n), {}).get("allreduce")
        extrapolated = ring_allreduce(profile.gradient_bytes, n, ring)
        k = alone / extrapolated if alone else None
        for arm in ("hvdtrain", "ps 1 server", "ps server per host", TORCH_ARM):
            if arm not in row:
                continue

            def step(cpu=None, scale=1.0, arm=arm):
                if arm.startswith("ps"):
                    return ps_step(compute, n, 1, 1 if arm == "ps 1 server" else n, link)
                on = Link(ring.alpha * scale, ring.beta * scale, ring.gamma * scale)
                return horovod_step(hvdtrain_arm[arm], n, 1, on, cpu=cpu)

            links, res = step(), step(host_cpu.get(arm))
            single = torch if arm == TORCH_ARM else compute
            measured = result["variants"][f"{arm} n={n}"]["images_per_sec"]
            predicted, links_only = n * batch / res["seconds"], n * batch / links["seconds"]
            out = {"hosts": n, "arm": arm, "predicted_images_per_sec": predicted,
                   "measured_images_per_sec": measured, "error": predicted / measured - 1,
                   "predicted_efficiency": single.seconds / res["seconds"],
                   "measured_efficiency": row[arm]["efficiency"],
                   "links_only_images_per_sec": links_only, "links_only_error": links_only / measured - 1,
                   "cpu_bound": bool(res.get("cpu_bound")), "calibrated_on_hosts": calibration["hosts"],
                   "link_fitted_to": "allreduce" if fitted and not arm.startswith("ps") else "every collective"}
            if k and not arm.startswith("ps"):
                again = n * batch / step(host_cpu.get(arm), k)["seconds"]
                out.update({"allreduce_alone_seconds": {"extrapolated": extrapolated, "measured": alone},
                            "error_with_the_measured_allreduce": again / measured - 1})
            rows.append(out)
    return rows


def _print_prediction(rows: List[Dict]) -> None:
    for r in rows:
        cpu = (f"; the links alone {r['links_only_images_per_sec']:.1f} ({100 * r['links_only_error']:+.0f}%)"
               + (", the host's CPU the bound" if r["cpu_bound"] else "")) if "links_only_error" in r else ""
        print(f"{r['hosts']} host(s), {r['arm']}: predicted {r['predicted_images_per_sec']:.1f} img/s "
              f"({100 * r['predicted_efficiency']:.0f}%), measured {r['measured_images_per_sec']:.1f} "
              f"({100 * r['measured_efficiency']:.0f}%): {100 * r['error']:+.0f}%{cpu}", flush=True)
        if "allreduce_alone_seconds" in r:
            a = r["allreduce_alone_seconds"]
            print(f"  the allreduce alone: extrapolated {1e3 * a['extrapolated']:.0f} ms, measured "
                  f"{1e3 * a['measured']:.0f} ms; with the measured one the step would be "
                  f"{100 * r['error_with_the_measured_allreduce']:+.0f}% off", flush=True)


def plot(result: Dict, path: str) -> None:
    """The article's picture: images/s against hosts as bars per arm, scaling efficiency as lines against 100%."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    hosts = [r["hosts"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.8))
    arms = result.get("arms", ARMS)
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        ax.bar([x + (i - (len(arms) - 1) / 2) * width for x in range(len(rows))],
               [r[arm]["images_per_sec"] for r in rows], width, label=f"{arm} (img/s)", alpha=0.6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([str(h) for h in hosts])
    quota = f", {result['cpu_quota_cores']:g} cores per host" if result.get("cpu_quota_cores") else ""
    ax.set_xlabel(f"hosts (one rank each), links limited to {result['rate']}{quota}\n"
                  f"efficiency against one single-worker baseline", fontsize=9)
    ax.set_ylabel("images / s (global)")
    eff = ax.twinx()
    for arm, marker in zip(arms, "osd^v*"):
        eff.plot(range(len(rows)), [100 * r[arm]["efficiency"] for r in rows], marker=marker, label=f"{arm} (%)")
    eff.plot(range(len(rows)), [100] * len(rows), "k:", linewidth=1)
    eff.set_ylim(0, 110)
    eff.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"Horovod ring vs parameter server, {result['model']} ({result['gradient_mb']:.1f} MB gradients)",
                 fontsize=9)
    lines = ax.get_legend_handles_labels()
    more = eff.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.24),
              ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> int:
    check_sizes(rounds=args.rounds, steps=args.steps, batch_size=args.batch_size, hidden=args.hidden)
    hosts = sorted({int(h) for h in args.hosts.split(",")})
    if not hosts or hosts[0] < 2:
        raise ConfigError(f"--hosts {args.hosts!r}: give host counts of at least 2, e.g. 2,3,4")
    rate_bits(args.rate)
    if args.cpu_quota < 0 or args.burst < 0 or args.warmup < 0:
        raise ConfigError("--cpu-quota, --burst and --warmup must be 0 or more")
    if args.allreduce_paths:
        result = allreduce_paths(hosts, args.rate, args.hidden, burst=args.burst, cpu_quota=args.cpu_quota,
                                 rounds=args.rounds)
        _print_paths(result)
        write(args.output_dir, "paths", result)
        return 0
    if args.collectives_only:
        frontends = [f for f in args.frontends.split(",") if f]
        unknown = [f for f in frontends if f not in FRONTENDS]
        if unknown or not frontends:
            raise ConfigError(f"--frontends {args.frontends!r}: choose from {', '.join(FRONTENDS)}")
        result = collectives_only(hosts, args.rate, args.hidden, burst=args.burst, cpu_quota=args.cpu_quota,
                                  frontends=frontends, rounds=args.rounds)
        _print_collectives(result)
        write(args.output_dir, "collectives", result)
        return 0
    calibration = read_calibration(args.predict_from, args.rate, args.cpu_quota) if args.predict_from else None
    arms = parse_arms(args.frameworks)
    journal = os.path.join(args.output_dir, "network.samples.jsonl")
    if os.path.exists(journal):
        os.remove(journal)  # this run's samples only
    print(f"bench: every sample is appended to {journal} as it is measured", flush=True)
    result = network(hosts, args.rate, args.hidden, args.rounds, args.steps, args.batch_size, warmup=args.warmup,
                     burst=args.burst, cpu_quota=args.cpu_quota, arms=arms, journal=journal)
    if calibration is not None:
        result["prediction"] = predict(result, calibration)
        _print_prediction(result["prediction"])
    for row in result["rows"]:
        print(f"{row['hosts']} host(s): " + ", ".join(
            f"{arm} {row[arm]['images_per_sec']:.1f} img/s ({100 * row[arm]['efficiency']:.0f}%)"
            for arm in result["arms"]))
    _print_collectives(result)
    busy = {k: v.get("machine_busy") for k, v in result["variants"].items()}
    print("machine busy (fraction of all cores, median per variant): "
          + ", ".join(f"{k} {v:.2f}" for k, v in busy.items() if v is not None))
    write(args.output_dir, "network", result, lambda path: plot(result, path))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("network", help="Horovod's ring against MXNet's parameter server over rate-limited links "
                                       "between namespace hosts (root)")
    p.add_argument("--hosts", default="2,3,4", help="host counts to run, comma-separated (each at least 2)")
    p.add_argument("--rate", default="500mbit", help="every link's limit each way, in tc's syntax")
    p.add_argument("--hidden", type=int, default=512, help="the network's hidden units (its gradient size)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median, min and max reported)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run of the bare loops")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    p.add_argument("--burst", type=int, default=3028,
                   help="tbf bucket in bytes (default two 1514-byte frames; 0: rate / 100 Hz)")
    p.add_argument("--cpu-quota", type=float, default=0.4,
                   help="cores per host (cgroup cpu quota, 0: none): with all hosts within the machine's cores, "
                        "the links limit a step, not the processors")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--collectives-only", action="store_true",
                   help="time the step's collectives alone on the same links (allreduce; --shard-optimizer's "
                        "reduce-scatter and allgather), no training arms")
    p.add_argument("--allreduce-paths", action="store_true",
                   help="time the step's gradients averaged three ways on the same links, with each rank's CPU by "
                        "thread: Horovod per gradient (fused), Horovod on one flat tensor, c10d's Gloo on it")
    p.add_argument("--frontends", default="mxnet",
                   help="with --collectives-only: the Horovod frontends to time them through, comma-separated, "
                        "interleaved over --rounds: mxnet, torch (hvdtrain's blocking wait), torch-spin "
                        "(horovod.torch 0.28.1's spinning wait)")
    p.add_argument("--frameworks", default="mxnet",
                   help="the arms, comma-separated: mxnet (its five arms), hvdtrain-mxnet (hvdtrain on MXNet alone), "
                        "torch (hvdtrain on PyTorch), torch-spin (the same with horovod.torch's spinning wait), "
                        "ddp (PyTorch DDP under torchrun: default and 1 MB buckets), "
                        "horovod-torch (Horovod's PyTorch example, stock settings)")
    p.add_argument("--predict-from", default="",
                   help="a collectives.json of --collectives-only at the same --rate and --cpu-quota (fitted on "
                        "other host counts): print the cost model's step time beside each measured one "
                        "(docs/scaling.md)")
    p.add_argument("--output-dir", default="runs/bench")
