"""The emulated cluster of the network benchmarks (``bench network``, ``bench shards``) and of tests: the namespace
hosts of ``scripts/netns_cluster.sh``, every link limited with ``tc tbf``, each host optionally held to a CPU quota
(a cgroup) or to cores of its own (a cpuset), and ``horovodrun`` launched on them. Root only; everything is removed on the way out."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..config import ConfigError
from .costmodel import rate_bits

CLUSTER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                       "netns_cluster.sh")


QUOTA_PERIOD_US = 10000
"""The CPU quota's accounting period by default (``--quota-period-ms``): 10 ms, not the kernel's 100 ms, so that a
host that spent its share waits at most 6 ms rather than 60, which would quantise steps of 100-300 ms into whole
throttled periods."""

MIN_QUOTA_US = 1000
"""The kernel's shortest period and shortest quota (CFS bandwidth refuses less than 1 ms of either)."""


def check_quota_period(cores: float, period_us: int) -> None:
    """A ConfigError unless a quota of ``cores`` per ``period_us`` is one the kernel takes (period 1 ms to 1 s, the
    quota in it at least 1 ms)."""
    if not MIN_QUOTA_US <= period_us <= 1000000:
        raise ConfigError(f"--quota-period-ms {period_us / 1000:g}: give 1 to 1000 ms")
    if cores and cores * period_us < MIN_QUOTA_US:
        raise ConfigError(f"--quota-period-ms {period_us / 1000:g} with --cpu-quota {cores:g}: the kernel wants at "
                          f"least 1 ms of quota a period; give --quota-period-ms "
                          f"{MIN_QUOTA_US / cores / 1000:g} or more")


class _HostGroups:
    """A cgroup per namespace host under one controller (v1, or v2 with the controller enabled for the children);
    what runs on host i goes into group i."""

    def __init__(self, name: str, hosts: int, controller: str, v1_file: str, flag: str):
        v1, v2 = f"/sys/fs/cgroup/{controller}", "/sys/fs/cgroup"
        if os.path.exists(os.path.join(v1, v1_file)):
            self.root, self.v2 = v1, False
        elif controller in _read(os.path.join(v2, "cgroup.controllers")).split():
            self.root, self.v2 = v2, True
            with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
                f.write(f"+{controller}")
        else:
            raise ConfigError(f"{flag} needs the cgroup {controller} controller (/sys/fs/cgroup/{controller} or cgroup "
                              f"v2 with {controller} in cgroup.controllers); pass {flag} 0 to run without one")
        self.dirs = [os.path.join(self.root, f"{name}-h{i}") for i in range(hosts)]
        for path in self.dirs:
            os.makedirs(path, exist_ok=True)

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


class CpuQuota(_HostGroups):
    """A CPU limit per namespace host (cgroup v1 ``cpu`` or cgroup v2 ``cpu.max``): ``cores`` cores for everything
    that runs on the host (its workers, its server, its sshd and what that starts), so that several hosts on one
    machine do not compete for its cores and the links, not the processors, limit a step."""

    def __init__(self, name: str, hosts: int, cores: float, period: int = QUOTA_PERIOD_US):
        check_quota_period(cores, period)
        super().__init__(name, hosts, "cpu", "cpu.cfs_quota_us", "--cpu-quota")
        for path in self.dirs:
            if self.v2:
                _write(os.path.join(path, "cpu.max"), f"{int(cores * period)} {period}")
            else:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(cores * period)))


def check_cores_per_host(per_host: int) -> List[int]:
    """The cores this process may run on, sorted; a ConfigError when ``per_host`` asks for more than that."""
    cores = sorted(os.sched_getaffinity(0))
    if per_host > len(cores):
        raise ConfigError(f"--cores-per-host {per_host}: this process may run on {len(cores)} core(s) only")
    return cores


class CpuSet(_HostGroups):
    """Cores of its own per namespace host (a cgroup ``cpuset``, v1 or v2): host i runs on ``per_host`` cores of
    this process's affinity, consecutive, host after host, wrapping round when the hosts ask for more cores than
    there are (then hosts share cores, as ``shared`` says). Unlike a quota, which lets every thread of a host run on
    any core and throttles them all once the host's share of a period is spent, a cpuset gives a host whole cores
    that nothing else runs on: what a real host that owns its cores sees, and its affinity shows it."""

    def __init__(self, name: str, hosts: int, per_host: int):
        cores = check_cores_per_host(per_host)
        super().__init__(name, hosts, "cpuset", "cpuset.cpus", "--cores-per-host")
        self.cores = [[cores[(i * per_host + j) % len(cores)] for j in range(per_host)] for i in range(hosts)]
        self.shared = hosts * per_host > len(cores)
        mems = _read(os.path.join(self.root, "cpuset.mems" if not self.v2 else "cpuset.mems.effective")).strip()
        for path, mine in zip(self.dirs, self.cores):
            _write(os.path.join(path, "cpuset.cpus"), ",".join(map(str, mine)))
            if mems:
                _write(os.path.join(path, "cpuset.mems"), mems)

    def describe(self) -> str:
        per = ", ".join(f"host{i} on {','.join(map(str, c))}" for i, c in enumerate(self.cores))
        return f"cores of its own per host ({per}{'; hosts share cores' if self.shared else ''})"


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
    """The namespace hosts of one run: ``prefix(i)`` runs a command on host i (inside its CPU quota and cpuset, if
    any)."""

    def __init__(self, state: str, hosts: int, *groups: Optional[_HostGroups]):
        self.state = state
        self.groups = [g for g in groups if g is not None]
        env = dict(line.strip().split("=", 1) for line in open(os.path.join(state, "env")) if "=" in line)
        self.ns_prefix = env["NETNS_PREFIX"]
        self.addresses = [line.split()[1] for line in open(os.path.join(state, "hosts")) if line.strip()][:hosts]
        for i in range(hosts if self.groups else 0):  # each host's sshd, so that what horovodrun starts over ssh
            pids = _run(["ip", "netns", "pids", f"{self.ns_prefix}h{i}"], f"ip netns pids on host{i}").split()
            for pid in pids:  # is in the host's groups
                for group in self.groups:
                    group.add(i, int(pid))

    def prefix(self, host: int) -> List[str]:
        # ip netns exec mounts a /sys without the cgroups: cgroups.sh mounts them again, so that a rank reads its
        # host's quota as in a container (hvdtrain chooses its threads and Horovod's wait by it).
        ns = ["ip", "netns", "exec", f"{self.ns_prefix}h{host}", "sh", os.path.join(self.state, "cgroups.sh")]
        if not self.groups:
            return ns
        # Into the host's groups before entering its namespace.
        files = [g.procs(host) for g in self.groups]
        script = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(files))) + f' && shift {len(files)} && exec "$@"'
        return ["sh", "-c", script, "sh", *files, *ns]

    def host_cores(self) -> Optional[List[List[int]]]:
        """The cores each host is pinned to, or None where the hosts share the machine's."""
        return next((g.cores for g in self.groups if isinstance(g, CpuSet)), None)

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


QUEUE_MS = 50.0
"""The tbf queue of every link, in milliseconds at its rate."""


@contextlib.contextmanager
def shaped_cluster(hosts: int, rate: str, burst: int = 0, cpu_quota: float = 0.0,
                   cores_per_host: int = 0, quota_period_us: int = QUOTA_PERIOD_US) -> Iterator[Cluster]:
    """``hosts`` namespace hosts, every link limited to ``rate`` each way (``burst`` bytes of tbf bucket; 0: tc's
    rule of thumb, rate / 100 Hz), each host limited to ``cpu_quota`` cores (0: none) in periods of
    ``quota_period_us`` and pinned to
    ``cores_per_host`` cores of its own (:class:`CpuSet`; 0: none); all of it removed on the way out."""
    if os.geteuid() != 0:
        raise ConfigError("bench network needs root (network namespaces and tc)")
    if not os.path.exists(CLUSTER):
        raise ConfigError(f"bench network needs the repository's scripts/netns_cluster.sh (not found at {CLUSTER})")
    burst = burst or max(32 * 1024, int(rate_bits(rate) / 8 / 100))
    # A kill (SIGTERM) unwinds like Ctrl-C, so the namespaces and links go with the run.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    groups: List[_HostGroups] = []
    with tempfile.TemporaryDirectory(prefix="hvdtrain-net-") as state:
        try:
            _run(["bash", CLUSTER, "up", state, str(hosts)], "netns_cluster.sh up")
            if cpu_quota:
                groups.append(CpuQuota(f"hvdtrain-net-{os.getpid()}", hosts, cpu_quota, quota_period_us))
            if cores_per_host:
                groups.append(CpuSet(f"hvdtrain-net-{os.getpid()}", hosts, cores_per_host))
            cluster = Cluster(state, hosts, *groups)
            for prefix, dev in cluster.links():
                _run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                      "latency", f"{QUEUE_MS:g}ms"], f"tc on {dev}")
            print(f"bench: {hosts} hosts up, every link limited to {rate} each way (tc tbf, burst {burst} bytes)"
                  + (f", each host to {cpu_quota:g} cores in {quota_period_us / 1000:g} ms periods"
                     if cpu_quota else "")
                  + "".join(f", {g.describe()}" for g in groups if isinstance(g, CpuSet)), flush=True)
            yield cluster
        finally:
            subprocess.run(["bash", CLUSTER, "down", state], capture_output=True, timeout=120)
            for group in groups:
                group.remove()
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


def run_records(cmd: Sequence[str], out: str, timeout: float, env: Dict[str, str], what: str) -> List[Dict]:
    """Run a training launch (``cmd``, writing its records to ``out``) and return the records of its metrics.jsonl;
    RuntimeError naming ``what`` with the last lines of its output when it failed."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, start_new_session=True,
                          env=dict(os.environ, **env))
    metrics = os.path.join(out, "metrics.jsonl")
    if proc.returncode != 0 or not os.path.exists(metrics):
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        raise RuntimeError(f"bench: {what} failed (exit {proc.returncode}): " + " | ".join(lines[-3:]))
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]
