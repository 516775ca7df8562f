"""Running a recipe on a Ray cluster: ``python -m hvdtrain ray ... recipe NAME ...`` and :func:`run_on_ray`.

Each rank is a Ray actor, placed by one placement group (``--placement pack`` or ``spread``), that starts
``python -m hvdtrain recipe ...`` as a process of its own with Horovod's Gloo environment, as horovodrun starts it over
ssh: the same code path, records, checkpoints and outputs. The driver runs Horovod's rendezvous server and watches
the ranks; the first that fails, or a Ray node that is lost, ends the job, named in one line.

Why not ``horovod.ray.RayExecutor``: it runs the training function inside the actor's process, so a rank that raises
keeps Horovod's background thread and its Gloo connections alive, and the other ranks wait on it instead of failing;
and it groups ranks into hosts by host name, which is the same on every node of a container platform or of namespace
hosts, so local ranks and sizes come out wrong. Here ranks are grouped by Ray node, and a rank is a process that exits.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .basics import die_with_parent
from .config import ConfigError

USAGE = """usage: python -m hvdtrain ray [--address ADDR] --num-workers N [--cpus-per-worker C] [--gpus-per-worker G]
                           [--placement pack|spread] [--min-workers MIN] [--max-workers MAX] [--start-timeout S]
                           [--env NAME[=VALUE] ...] recipe NAME [--option value ...]

Train a recipe on a Ray cluster: N ranks, each a Ray actor holding C CPUs (default 1) and G GPUs (default 0), placed
together by one placement group (pack: as few nodes as fit, the default; spread: over as many nodes as there are).
ADDR is the cluster's GCS address (HOST:6379), 'auto' (RAY_ADDRESS, or the cluster this node belongs to; the default)
or 'local' (a Ray started for this job on this machine). Each rank runs 'python -m hvdtrain recipe NAME ...' in the
driver's working directory with Horovod over Gloo, as under horovodrun; it receives the driver's PYTHONPATH and its
HVDTRAIN_*, HOROVOD_*, NCCL_*, AWS_*, MLFLOW_*, DNNL_*, ONEDNN_*, ATEN_* and OMP_NUM_THREADS variables, and those
named by --env. --start-timeout (default 120 s) bounds the wait for the cluster's resources.
With the recipe's --elastic (PyTorch), ranks follow the cluster's nodes: N to start, at least MIN (default N) and at
most MAX (default N); a rank is placed on any node with room for it (no placement group), a node lost takes its
ranks out of the job, which continues from its last commit, and a node added gives it more."""

FORWARDED_PREFIXES = ("HVDTRAIN_", "HOROVOD_", "NCCL_", "AWS_", "MLFLOW_", "DNNL_", "ONEDNN_", "ATEN_")
FORWARDED_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS")
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
GRACE_SECONDS = 30.0
"""After the first rank fails, how long the others get to stop on their own (each names what it saw) before the
driver ends them."""


class RayJobFailed(RuntimeError):
    """A rank failed, or a Ray node was lost: the message names the rank, the node and the error."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass
class RayJob:
    """Where and how many: ``python -m hvdtrain ray``'s flags."""
    address: str = "auto"
    num_workers: int = 0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement: str = "pack"
    start_timeout: float = 120.0
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    min_workers: int = 0
    """--elastic: the fewest ranks the job runs with (0: --num-workers)."""
    max_workers: int = 0
    """--elastic: the most ranks the job grows to (0: --num-workers)."""

    def check(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers {self.num_workers}: give the number of ranks, at least 1")
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"--cpus-per-worker {self.cpus_per_worker:g}: must be above 0")
        if self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker {self.gpus_per_worker:g}: must be 0 or more")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement {self.placement!r}: choose from {', '.join(PLACEMENTS)}")
        if self.start_timeout <= 0:
            raise ConfigError(f"--start-timeout {self.start_timeout:g}: must be above 0 seconds")
        low, high = self.min_workers or self.num_workers, self.max_workers or self.num_workers
        if not 1 <= low <= self.num_workers <= high:
            raise ConfigError(f"--min-workers {low} / --num-workers {self.num_workers} / --max-workers {high}: "
                              "need 1 <= MIN <= N <= MAX")

    def bundle(self) -> Dict[str, float]:
        out = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            out["GPU"] = float(self.gpus_per_worker)
        return out


_NUMBERS = {"--num-workers": ("num_workers", int), "--cpus-per-worker": ("cpus_per_worker", float),
            "--gpus-per-worker": ("gpus_per_worker", float), "--start-timeout": ("start_timeout", float),
            "--min-workers": ("min_workers", int), "--max-workers": ("max_workers", int)}
_STRINGS = {"--address": "address", "--placement": "placement"}


def parse_args(argv: Sequence[str]) -> Tuple[RayJob, List[str]]:
    """``hvdtrain ray``'s flags, and the ``recipe NAME ...`` command after them."""
    job, rest = RayJob(address=os.environ.get("RAY_ADDRESS", "") or "auto"), list(argv)
    given = set()
    while rest and rest[0] != "recipe":
        flag = rest.pop(0)
        name, eq, value = flag.partition("=")
        given.add(name)
        if name not in _NUMBERS and name not in _STRINGS and name != "--env":
            raise ConfigError(f"ray: unknown option {flag!r}; options: {', '.join([*_NUMBERS, *_STRINGS, '--env'])}"
                              " (then: recipe NAME [--option value ...])")
        if not eq:
            if not rest or rest[0] == "recipe":
                raise ConfigError(f"ray: {name} expects a value after it")
            value = rest.pop(0)
        if name == "--env":
            key, has, val = value.partition("=")
            if not key:
                raise ConfigError(f"ray: --env {value!r}: give NAME or NAME=VALUE")
            job.env[key] = val if has else os.environ.get(key, "")
        elif name in _STRINGS:
            setattr(job, _STRINGS[name], value)
        else:
            field, kind = _NUMBERS[name]
            try:
                setattr(job, field, kind(value))
            except ValueError:
                raise ConfigError(f"ray: {name} {value!r}: expects {'an integer' if kind is int else 'a number'}") \
                    from None
    if not rest:
        raise ConfigError("ray: no command: give 'recipe NAME [--option value ...]' after the ray options")
    if "--num-workers" not in given:
        raise ConfigError("ray: --num-workers N is required (the number of ranks)")
    job.check()
    return job, rest


def check_recipe(command: Sequence[str], job: RayJob) -> bool:
    """The recipe command's flags checked on the driver, before anything starts on the cluster (the recipe's own
    refusals included: --elastic on MXNet); whether the job is elastic."""
    from . import registry
    from .config import parse_overrides
    if len(command) < 2 or command[1].startswith("-"):
        raise ConfigError("ray: recipe needs a NAME: ... recipe NAME [--option value ...]")
    cls = registry.load(command[1])
    cfg = parse_overrides(cls.config_class, list(command[2:]))
    cfg.validate()  # the flags' combinations, as the Trainer checks them on every rank
    elastic = bool(getattr(cfg, "elastic", False))
    if not elastic and (job.min_workers or job.max_workers):
        raise ConfigError("ray: --min-workers and --max-workers are for the recipe's --elastic; without it the job "
                          "runs --num-workers ranks")
    if elastic and job.gpus_per_worker:
        raise ConfigError("ray: --elastic with --gpus-per-worker is not supported yet: give each elastic rank CPUs "
                          "only, or run without --elastic")
    return elastic


def forwarded_env(extra: Dict[str, str]) -> Dict[str, str]:
    """What the driver passes to every rank (see USAGE), then ``extra``."""
    out = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}
    out.update(extra)
    return out


# ------------------------------------------------------------------------------------------------- the rank's actor

class RankActor:
    """One rank: where Ray placed it, then its ``python -m hvdtrain`` process, whose output it passes on with the
    rank's prefix (Ray forwards it to the driver) and whose last lines of stderr it keeps."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.tail: collections.deque = collections.deque(maxlen=40)
        self.error = ""  # its last "hvdtrain: error: ..." line, however long the traceback after it
        self.readers: List[threading.Thread] = []

    def where(self) -> Dict:
        import ray
        ip = ray.util.get_node_ip_address()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "iface": _iface_of(ip),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def start(self, argv: List[str], env: Dict[str, str], cwd: str, rank: int) -> int:
        full = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "OMP_NUM_THREADS"}
        full.update(env)
        # The rank dies when its actor dies (a raylet killed, a node lost), as ssh's children do when the connection
        # drops; its Gloo peers then see the connection close and stop instead of waiting.
        self.proc = subprocess.Popen([sys.executable, *argv], env=full, cwd=cwd if os.path.isdir(cwd) else None,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     preexec_fn=die_with_parent, start_new_session=True)
        for stream, sink, keep in ((self.proc.stdout, sys.stdout, False), (self.proc.stderr, sys.stderr, True)):
            t = threading.Thread(target=self._relay, args=(stream, sink, f"[{rank}]", keep), daemon=True)
            t.start()
            self.readers.append(t)
        return self.proc.pid

    def _relay(self, stream, sink, prefix: str, keep: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if keep:
                self.tail.append(line)
                if "hvdtrain: error:" in line:
                    self.error = line
            print(f"{prefix} {line}", file=sink, flush=True)

    def wait(self) -> Tuple[int, List[str]]:
        rc = self.proc.wait()
        for t in self.readers:
            t.join(timeout=5)
        return rc, [*self.tail, self.error] if self.error else list(self.tail)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _iface_of(ip: str) -> str:
    """The network interface holding ``ip`` ("" if none does): Gloo's HOROVOD_GLOO_IFACE on that node."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return ""


# --------------------------------------------------------------------------------------------------------- the driver

def _connect(address: str):
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, not "[repeated 2x across cluster]"
    import ray
    if address not in ("auto", "local"):
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host or address, int(port or 6379)), timeout=10):
                pass
        except (OSError, ValueError) as e:
            raise ConfigError(f"--address {address}: cannot reach a Ray cluster there ({e}); give the head node's "
                              "HOST:PORT (ray start --head prints it), 'auto' or 'local'") from None
    import logging
    try:
        ray.init(address=None if address == "local" else address, log_to_driver=True, logging_level=logging.ERROR,
                 include_dashboard=False if address == "local" else None, configure_logging=True)
    except ConnectionError as e:
        raise ConfigError(f"--address {address}: no Ray cluster answered ({str(e).splitlines()[0]}); start one with "
                          "'ray start --head', or give its HOST:PORT") from None
    except Exception as e:  # noqa: BLE001 - e.g. an AuthenticationError: the cluster's token is not this driver's
        first = (str(e).strip().splitlines() or [""])[0].split(". ")[0]
        raise ConfigError(f"--address {address}: the Ray cluster refused this driver ({type(e).__name__}: {first}); "
                          "with token authentication give the cluster's token in RAY_AUTH_TOKEN and set "
                          "RAY_AUTH_MODE=token") from None
    return ray


def _check_resources(ray, job: RayJob, needed: int) -> None:
    """One line, before anything is placed, when the cluster could never hold ``needed`` ranks."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = sum(RayNodes(ray, job).find_available_hosts_and_slots().values())
    if total < needed:
        have = ", ".join(f"{n.get('NodeManagerAddress')}: {n.get('Resources', {}).get('CPU', 0):g} CPU "
                         f"{n.get('Resources', {}).get('GPU', 0):g} GPU" for n in nodes)
        raise ConfigError(f"--num-workers {needed} x ({job.cpus_per_worker:g} CPU, {job.gpus_per_worker:g} "
                          f"GPU): the Ray cluster holds {total} such workers ({len(nodes)} nodes: {have}); ask for "
                          "fewer workers or resources, or add nodes")


def assign_ranks(places: List[Dict], first_ip: str = "") -> List[Dict]:
    """Ranks by node, as horovodrun gives them by host: the node at ``first_ip`` (the driver's) first, then the
    others in the order their first worker was placed, the workers of one node consecutive. One dict per worker (in
    ``places`` order): rank, local_rank, local_size, cross_rank, cross_size, hostname (the node's address) and gpus
    (for CUDA_VISIBLE_DEVICES: the node's workers' GPUs in local rank order, so that local rank r's GPU is device r, as
    Horovod's pinning by local rank expects)."""
    nodes: Dict[str, List[int]] = {}
    for i, p in sorted(enumerate(places), key=lambda e: (e[1]["ip"] != first_ip, e[0])):
        nodes.setdefault(p["node_id"], []).append(i)
    out: List[Dict] = [{} for _ in places]
    rank = 0
    for cross_rank, (node, members) in enumerate(nodes.items()):
        gpus = [g for i in members for g in places[i]["gpus"]]
        for local_rank, i in enumerate(members):
            out[i] = {"rank": rank, "local_rank": local_rank, "local_size": len(members), "cross_rank": cross_rank,
                      "hostname": places[i]["ip"], "gpus": ",".join(gpus)}
            rank += 1
    for i, p in enumerate(out):  # cross size: the nodes that have this local rank
        p["cross_size"] = sum(1 for members in nodes.values() if len(members) > p["local_rank"])
    return out


def _rank_env(slot: Dict, size: int, server: Tuple[str, int], iface: str) -> Dict[str, str]:
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": server[0], "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server[1]),
           "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_HOSTNAME": slot["hostname"],
           "HOROVOD_RANK": str(slot["rank"]), "HOROVOD_SIZE": str(size),
           "HOROVOD_LOCAL_RANK": str(slot["local_rank"]), "HOROVOD_LOCAL_SIZE": str(slot["local_size"]),
           "HOROVOD_CROSS_RANK": str(slot["cross_rank"]), "HOROVOD_CROSS_SIZE": str(slot["cross_size"])}
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
        env["NCCL_SOCKET_IFNAME"] = iface
    if slot["gpus"]:
        env["CUDA_VISIBLE_DEVICES"] = slot["gpus"]
    return env


def _rendezvous(slots: List[Dict]):
    """Horovod's Gloo rendezvous server (what horovodrun runs), told each rank's host and local and cross ranks."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(verbose=0)
    port = server.start()
    plan = sorted((SlotInfo(hostname=s["hostname"], rank=s["rank"], local_rank=s["local_rank"],
                            cross_rank=s["cross_rank"], size=len(slots), local_size=s["local_size"],
                            cross_size=s["cross_size"]) for s in slots), key=lambda s: s.rank)
    server.init(plan)
    return server, port


def run(job: RayJob, command: Sequence[str], log=print) -> int:
    """Run ``command`` (``recipe NAME ...``) on ``job.num_workers`` ranks of the Ray cluster; 0 when every rank
    succeeded, else raise :class:`RayJobFailed` naming the rank (or the lost node) and its error."""
    job.check()
    elastic = check_recipe(command, job)
    started = time.monotonic()
    ray = _connect(job.address)
    server = pg = None
    actors: List = []
    try:
        _check_resources(ray, job, (job.min_workers or job.num_workers) if elastic else job.num_workers)
        if elastic:
            return _run_elastic(ray, job, command, started, log)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        pg = placement_group([job.bundle() for _ in range(job.num_workers)], strategy=PLACEMENTS[job.placement])
        ready, _ = ray.wait([pg.ready()], timeout=job.start_timeout)
        if not ready:
            raise ConfigError(f"the Ray cluster did not free {job.num_workers} x {job.bundle()} within "
                              f"--start-timeout {job.start_timeout:g} s (available now: {ray.available_resources()})")
        remote = ray.remote(RankActor)
        actors = [remote.options(num_cpus=job.cpus_per_worker, num_gpus=job.gpus_per_worker, max_concurrency=4,
                                 max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     placement_group=pg, placement_group_bundle_index=i)).remote()
                  for i in range(job.num_workers)]
        places = ray.get([a.where.remote() for a in actors], timeout=job.start_timeout)
        addr = ray.util.get_node_ip_address()
        slots = assign_ranks(places, addr)
        server, port = _rendezvous(slots)
        ray.get([_start_rank(a, command, job, _rank_env(s, len(slots), (addr, port), p["iface"]), s["rank"])
                 for a, s, p in zip(actors, slots, places)], timeout=job.start_timeout)
        nodes = sorted({(s["cross_rank"], s["hostname"]) for s in slots})
        log(f"hvdtrain ray: {len(slots)} ranks on {len(nodes)} node(s) ({', '.join(h for _, h in nodes)}) started "
            f"in {time.monotonic() - started:.1f} s", flush=True)
        _watch(ray, actors, slots, places)
        return 0
    finally:
        for a in actors:
            try:
                ray.get(a.stop.remote(grace=2.0), timeout=15)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)
        if server is not None:
            server.stop()
        ray.shutdown()


def _start_rank(actor, command: Sequence[str], job: RayJob, rank_env: Dict[str, str], rank: int):
    """The rank's ``python -m hvdtrain COMMAND`` in ``actor``, in the driver's working directory, with the variables
    the driver passes on (USAGE) and the rank's Horovod environment; the call's object ref."""
    return actor.start.remote(["-m", "hvdtrain", *command], {**forwarded_env(job.env), **rank_env}, os.getcwd(), rank)


class RayNodes:
    """Horovod's elastic host discovery (``HostDiscovery.find_available_hosts_and_slots``) from the Ray cluster: each
    live node by its address, with as many slots as ranks of the job's size it holds."""

    def __init__(self, ray, job: RayJob):
        self.ray, self.need = ray, job.bundle()

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """Live nodes -> slots. Horovod's elastic driver numbers new hosts in a set's order, not this one's, so rank
        0 may be on any node; when its node is lost, the rank renumbered 0 takes over the records."""
        out = {}
        for node in self.ray.nodes():
            have = node.get("Resources", {})
            slots = min(int(have.get(k, 0.0) / v + 1e-9) for k, v in self.need.items())
            if node.get("Alive") and slots > 0:
                out[node["NodeManagerAddress"]] = slots
        return out


def _run_elastic(ray, job: RayJob, command: Sequence[str], started: float, log) -> int:
    """--elastic on Ray: Horovod's elastic driver (what horovodrun --min-np/--max-np runs), its hosts the Ray
    cluster's live nodes, each rank an actor placed on its node that runs the recipe with HOROVOD_ELASTIC."""
    from horovod.runner.elastic.discovery import HostDiscovery
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.rendezvous import create_rendezvous_handler
    from horovod.runner.http.http_server import RendezvousServer
    discovery = type("RayHostDiscovery", (RayNodes, HostDiscovery), {})(ray, job)
    rendezvous = RendezvousServer(verbose=0)
    driver = ElasticDriver(rendezvous, discovery, job.min_workers or job.num_workers,
                           job.max_workers or job.num_workers, timeout=int(job.start_timeout))
    port = rendezvous.start(create_rendezvous_handler(driver))
    server = (ray.util.get_node_ip_address(), port)
    remote = ray.remote(RankActor)
    failures: List[str] = []

    def create_worker(slot_info, events):
        actor = remote.options(num_cpus=job.cpus_per_worker, max_concurrency=4, max_restarts=0,
                               resources={f"node:{slot_info.hostname}": 0.001}).remote()
        where = f"rank {slot_info.rank} on Ray node {slot_info.hostname}"
        try:
            place = ray.get(actor.where.remote(), timeout=job.start_timeout)
            slot = {"rank": slot_info.rank, "local_rank": slot_info.local_rank, "local_size": slot_info.local_size,
                    "cross_rank": slot_info.cross_rank, "cross_size": slot_info.cross_size,
                    "hostname": slot_info.hostname, "gpus": ""}
            rank_env = {**_rank_env(slot, slot_info.size, server, place["iface"]), "HOROVOD_ELASTIC": "1"}
            ray.get(_start_rank(actor, command, job, rank_env, slot_info.rank), timeout=job.start_timeout)
            done = actor.wait.remote()
            while not ray.wait([done], timeout=1.0)[0]:
                if any(e.is_set() for e in events):  # the driver stops it: the job ended, or its host left
                    ray.get(actor.stop.remote(grace=5.0), timeout=30)
            rc, tail = ray.get(done)
            if rc != 0:
                failures.append(f"{where} exited with status {rc}: {_error_line(tail)}")
            return rc, time.time()
        except Exception as e:  # noqa: BLE001 - the actor died with its node, or never started
            failures.append(f"{where} was lost: {_first_line(e)}")
            return 1, time.time()
        finally:
            ray.kill(actor)

    try:
        driver.wait_for_available_slots(job.min_workers or job.num_workers)
        log(f"hvdtrain ray: elastic, {job.num_workers} ranks to start (between {job.min_workers or job.num_workers} "
            f"and {job.max_workers or job.num_workers}), hosts {discovery.find_available_hosts_and_slots()}, after "
            f"{time.monotonic() - started:.1f} s", flush=True)
        driver.start(job.num_workers, create_worker)
        results = driver.get_results()
    finally:
        driver.stop()
    if results.error_message is not None:
        raise RayJobFailed(f"the elastic job ended: {results.error_message}"
                           + (f"; first: {failures[0]}" if failures else ""))
    for name, (rc, _) in sorted(results.worker_results.items(), key=lambda item: item[1][1]):
        if rc != 0:
            raise RayJobFailed(failures[-1] if failures else f"{name} exited with status {rc}", rc)
    return 0


def _watch(ray, actors, slots, places) -> None:
    """Wait for every rank; at the first failure give the others GRACE_SECONDS to stop on their own, then end them,
    and raise naming the rank whose failure came first (a lost node before the ranks that lost their peers)."""
    pending = {a.wait.remote(): i for i, a in enumerate(actors)}
    failures: List[Tuple[float, int, str, int]] = []  # when, worker, message, exit code
    deadline = None
    while pending:
        timeout = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not done:
            if deadline is not None and time.monotonic() >= deadline:
                break
            continue
        i = pending.pop(done[0])
        slot, place = slots[i], places[i]
        try:
            rc, tail = ray.get(done[0])
        except Exception as e:  # noqa: BLE001 - the actor died: its node was lost, or its process killed
            failures.append((time.monotonic(), i, f"rank {slot['rank']} on Ray node {place['ip']} "
                             f"(node id {place['node_id'][:12]}) was lost: {_first_line(e)}", 1))
        else:
            if rc != 0:
                failures.append((time.monotonic(), i, f"rank {slot['rank']} on Ray node {place['ip']} exited with "
                                 f"status {rc}: {_error_line(tail)}", rc if rc > 0 else 1))
        if failures and deadline is None:
            deadline = time.monotonic() + GRACE_SECONDS
    if failures:
        lost = [f for f in failures if "was lost" in f[2]]
        first = (lost or sorted(failures, key=_blame))[0]
        raise RayJobFailed(first[2], first[3])


def _blame(failure) -> Tuple[int, float]:
    """A rank that failed of itself before one that stopped because its peers did."""
    from .faults import COLLECTIVE_FAILURE_MARKERS
    message = failure[2]
    secondary = "another rank" in message or any(m in message for m in COLLECTIVE_FAILURE_MARKERS)
    return (1 if secondary else 0, failure[0])


def _error_line(tail: List[str]) -> str:
    """The rank's own one-line error (``hvdtrain: error: ...``), else its last line of stderr."""
    for line in reversed(tail):
        if "hvdtrain: error:" in line:
            return line.split("hvdtrain: error:", 1)[1].strip()
    lines = [line for line in tail if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


# ------------------------------------------------------------------------------------------------ the two entry points

def run_on_ray(trainer: Union[str, type], args: Sequence[str] = (), *, num_workers: int, address: str = "auto",
               cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0, placement: str = "pack",
               start_timeout: float = 120.0, env: Optional[Dict[str, str]] = None) -> None:
    """Train ``trainer`` (a recipe name, ``"package.module:Class"``, or a :class:`hvdtrain.Trainer` subclass defined
    in an importable module) with its command-line ``args`` on ``num_workers`` ranks of a Ray cluster, as
    ``python -m hvdtrain ray`` does. Returns when every rank succeeded; raises :class:`RayJobFailed` naming the rank
    and its error, or :class:`hvdtrain.config.ConfigError` for what could never start."""
    if isinstance(trainer, type):
        if trainer.__module__ == "__main__":
            raise ConfigError(f"run_on_ray: {trainer.__name__} is defined in __main__; the ranks import it: move it "
                              "to a module on their PYTHONPATH")
        trainer = f"{trainer.__module__}:{trainer.__qualname__}"
    job = RayJob(address=address, num_workers=num_workers, cpus_per_worker=cpus_per_worker,
                 gpus_per_worker=gpus_per_worker, placement=placement, start_timeout=start_timeout,
                 env=dict(env or {}))
    run(job, ["recipe", trainer, *args])


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    job, command = parse_args(argv)
    if command[0] != "recipe":
        raise ConfigError(f"ray: runs 'recipe NAME ...', not {command[0]!r}")
    try:
        return run(job, command)
    except RayJobFailed as e:
        from .faults import report_line
        report_line(None, f"ray: {e}")
        return e.exit_code
