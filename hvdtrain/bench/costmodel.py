"""A cost model of one data-parallel step: Horovod's ring allreduce (flat or hierarchical) with tensor fusion and the
overlap of the backward pass, and MXNet's parameter server; pure Python, no framework. docs/scaling.md states its
assumptions and checks it against measured runs and published figures.

Link costs (the alpha-beta-gamma model of collective communication):

- ``alpha``: seconds per message (latency, software included), ``beta``: seconds per byte on the link, ``gamma``:
  seconds per byte to reduce (add) what arrives.
- Ring allreduce of ``n`` bytes over ``p`` ranks: ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma`` (a
  reduce-scatter, ``(p-1) alpha + (p-1)/p n (beta + gamma)``, then an allgather, ``(p-1) alpha + (p-1)/p n beta``).
  A ring is as fast as its slowest link: with several ranks per host, the host's network link.
- Hierarchical (``HOROVOD_HIERARCHICAL_ALLREDUCE``): a reduce-scatter among the ``r`` ranks of a host over the local
  path, an allreduce of each rank's 1/r across the ``h`` hosts (the host's r rings share its link: ``n`` bytes per
  host in all), an allgather on the local path.
- Parameter server (MXNet ``dist_sync``): every worker pushes its gradients and pulls the weights; large arrays are
  split evenly over the ``s`` servers. The busiest host link sets the time: a server's host receives ``n/s`` from
  every remote worker and sends as much back; a worker's host sends ``n`` out and takes ``n`` in, less its own
  server's share when one runs there. With several ranks per host, the host's ranks are reduced locally first (the
  kvstore's device aggregation), so one push per host.

Tensor fusion and overlap (:func:`horovod_step`): gradients become ready during the backward pass (their ready times
are measured from the recipe's own backward on the machine at hand, as fractions of it); Horovod's background thread
wakes every ``cycle_time``, fuses the tensors ready by then into buffers of at most ``fusion_threshold`` bytes and
allreduces them one after another; the step ends when the backward pass and the last allreduce are both done, then
the optimizer runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import ConfigError


def rate_bits(rate: str, flag: str = "--rate") -> float:
    """tc's rate syntax (``500mbit``, ``1gbit``, ``100kbit``) in bits per second; a ConfigError naming ``flag``."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                value = float(rate[:-len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * scale
    raise ConfigError(f"{flag} {rate!r}: give a rate in tc's syntax, e.g. 500mbit or 1gbit")


@dataclass(frozen=True)
class Link:
    """The costs of one kind of link: seconds per message, per byte sent, per byte reduced."""
    alpha: float
    beta: float
    gamma: float = 0.0

    @classmethod
    def from_rate(cls, bits_per_second: float, alpha: float, gamma: float = 0.0) -> "Link":
        return cls(alpha, 8.0 / bits_per_second, gamma)


def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Seconds of a ring allreduce of ``nbytes`` over ``p`` ranks."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + (p - 1) / p * nbytes * (2 * link.beta + link.gamma)


def reduce_scatter(nbytes: float, p: int, link: Link) -> float:
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * (link.beta + link.gamma)


def allgather(nbytes: float, p: int, link: Link) -> float:
    """An allgather whose result is ``nbytes`` (each rank contributes nbytes / p)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta


COLLECTIVES = {"allreduce": ring_allreduce, "reducescatter": reduce_scatter, "allgather": allgather}


def features(op: str, nbytes: float, p: int) -> Tuple[float, float, float]:
    """The coefficients of (alpha, beta, gamma) in the cost of ``op``: the model is linear in them."""
    k = (p - 1) / p * nbytes
    return {"allreduce": (2.0 * (p - 1), 2 * k, k), "reducescatter": (float(p - 1), k, k),
            "allgather": (float(p - 1), k, 0.0)}[op]


def fit_link(samples: Sequence[Tuple[str, float, int, float]]) -> Dict[str, float]:
    """alpha, beta and gamma from timed collectives ``(op, nbytes, ranks, seconds)`` by least squares on relative
    error (each sample weighted by 1/seconds, so a 10 ms and a 1 s sample count alike). The allgather (no reduction)
    beside the allreduce or the reduce-scatter is what separates beta from gamma; at least two sizes or rank counts
    separate alpha from them. A coefficient the data cannot resolve comes out near 0, never negative."""
    import numpy as np
    if len(samples) < 3:
        raise ValueError("fit_link: give at least 3 timed collectives")
    a = np.array([features(op, n, p) for op, n, p, _ in samples], dtype=np.float64)
    t = np.array([s for *_, s in samples], dtype=np.float64)
    w = 1.0 / t
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    active = list(range(3))
    while True:  # non-negative least squares by elimination: drop a negative coefficient and refit
        coef = np.zeros(3)
        sol, *_ = np.linalg.lstsq((a[:, active] / scale[active]) * w[:, None], t * w, rcond=None)
        coef[active] = sol / scale[active]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    predicted = a @ coef
    return {"alpha": float(coef[0]), "beta": float(coef[1]), "gamma": float(coef[2]),
            "max_relative_error": float(np.max(np.abs(predicted - t) / t))}


@dataclass(frozen=True)
class HostCpu:
    """A host whose CPU carries both the compute and the collectives (no GPU, no offload): ``cores`` (its quota), the
    CPU seconds of one rank's step without communication (``compute``), and the CPU seconds of one allreduce of the
    step's gradients as ``per_message * (p-1) + per_pass * (p-1)/p`` on ``p`` ranks (fitted by :func:`fit_cpu` to
    collectives timed alone: Horovod's background thread, Gloo's copies and reduction, TCP). A step cannot take less
    than all of that CPU at the quota's rate."""
    cores: float
    compute: float
    per_message: float
    per_pass: float

    def allreduce(self, ranks: int) -> float:
        return self.per_message * (ranks - 1) + self.per_pass * (ranks - 1) / ranks if ranks > 1 else 0.0

    def step(self, ranks: int, per_host: int = 1) -> float:
        """The least step time the host's CPU allows: its ranks' compute and collectives CPU over its cores."""
        return per_host * (self.compute + self.allreduce(ranks)) / self.cores


def fit_cpu(cpu_per_allreduce: Dict[int, float]) -> Tuple[float, float]:
    """(per_message, per_pass) of :class:`HostCpu` from one allreduce's CPU seconds at several rank counts, by
    non-negative least squares on relative error (one count alone: all of it per pass)."""
    import numpy as np
    ranks = sorted(int(p) for p in cpu_per_allreduce if int(p) > 1)
    if not ranks:
        raise ValueError("fit_cpu: give the CPU of an allreduce on 2 ranks or more")
    t = np.array([cpu_per_allreduce[p] if p in cpu_per_allreduce else cpu_per_allreduce[str(p)] for p in ranks])
    a = np.array([[p - 1, (p - 1) / p] for p in ranks], dtype=np.float64) / t[:, None]
    best = None
    for cols in ([0, 1], [0], [1]):  # every subset of the two, the best non-negative fit
        if len(ranks) < len(cols):
            continue
        sol, *_ = np.linalg.lstsq(a[:, cols], np.ones(len(ranks)), rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(2)
        coef[cols] = sol
        err = float(np.abs(a @ coef - 1).max())
        if best is None or err < best[0]:
            best = (err, coef)
    return float(best[1][0]), float(best[1][1])


def flat_allreduce(nbytes: float, hosts: int, per_host: int, net: Link, local: Optional[Link] = None) -> float:
    """A flat ring over ``hosts x per_host`` ranks ordered by host: every host's link carries the ring's traffic,
    so the network link sets the per-byte cost; each of the ring's steps is a message on the slowest link."""
    p = hosts * per_host
    if hosts <= 1:
        return ring_allreduce(nbytes, p, local or net)
    return ring_allreduce(nbytes, p, net)


def hierarchical_allreduce(nbytes: float, hosts: int, per_host: int, net: Link, local: Link) -> float:
    """Reduce-scatter on the host, allreduce of each rank's 1/r across hosts (r rings sharing the host's link), and
    allgather on the host."""
    inside = reduce_scatter(nbytes, per_host, local) + allgather(nbytes, per_host, local)
    across = 2 * (hosts - 1) * net.alpha + (hosts - 1) / hosts * nbytes * (2 * net.beta + net.gamma / per_host)
    return inside + (across if hosts > 1 else 0.0)


@dataclass
class Gradient:
    nbytes: float
    ready: float
    """Seconds after the backward pass began when it is ready."""


def fuse(gradients: Sequence[Gradient], cycle_time: float, threshold: float, cost) -> Tuple[float, List[float]]:
    """Horovod's background thread over one backward pass: every ``cycle_time`` it takes the gradients ready by then
    in buffers of at most ``threshold`` bytes (a larger tensor alone) and allreduces them one after another
    (``cost(nbytes)`` seconds each). Returns when the last allreduce ends (seconds after the backward began) and the
    size of every message."""
    pending = sorted(gradients, key=lambda g: g.ready)
    now, sizes, i = 0.0, [], 0
    while i < len(pending):
        now = max(now, pending[i].ready)
        now = math.ceil(now / cycle_time - 1e-9) * cycle_time if cycle_time > 0 else now  # the next cycle
        batch = []
        while i < len(pending) and pending[i].ready <= now + 1e-12:
            batch.append(pending[i].nbytes)
            i += 1
        buffer = 0.0
        for nbytes in batch:
            if buffer and buffer + nbytes > threshold:
                now += cost(buffer)
                sizes.append(buffer)
                buffer = 0.0
            buffer += nbytes
        if buffer:
            now += cost(buffer)
            sizes.append(buffer)
    return now, sizes


@dataclass
class Compute:
    """One rank's step without communication: forward, backward, optimizer (seconds), and when each gradient is
    ready as a fraction of the backward pass (with its bytes)."""
    forward: float
    backward: float
    update: float
    gradients: List[Tuple[float, float]]
    """(bytes, fraction of the backward pass when ready), in any order."""

    @property
    def seconds(self) -> float:
        return self.forward + self.backward + self.update

    def scaled(self, seconds: float) -> "Compute":
        """The same profile with the step taking ``seconds`` (another device: its measured rate, same proportions)."""
        k = seconds / self.seconds
        return Compute(self.forward * k, self.backward * k, self.update * k, self.gradients)

    @property
    def gradient_bytes(self) -> float:
        return sum(b for b, _ in self.gradients)

    def in_groups(self, groups: Sequence[Sequence[int]]) -> "Compute":
        """The same step with its gradients sent in ``groups`` (indices into :attr:`gradients`, as hvdtrain's
        ``--allreduce-groups`` forms them): each group one tensor of their bytes, ready with its last gradient."""
        return Compute(self.forward, self.backward, self.update,
                       [(sum(self.gradients[i][0] for i in g), max(self.gradients[i][1] for i in g)) for g in groups])


def horovod_step(compute: Compute, hosts: int, per_host: int, net: Link, local: Optional[Link] = None,
                 cycle_time: float = 1e-3, threshold: float = 128 * 2 ** 20, hierarchical: bool = False,
                 overlap: bool = True, cpu: Optional[HostCpu] = None) -> Dict[str, float]:
    """Seconds of one step with Horovod's allreduce on ``hosts`` hosts of ``per_host`` ranks; with ``overlap``
    False every allreduce waits for the end of the backward pass. ``cpu``: the host's CPU is shared by the compute
    and the collectives, and the step is at least what that CPU allows (``cpu_bound`` says which limit set it)."""
    local = local or net

    def cost(nbytes: float) -> float:
        if hierarchical and per_host > 1:
            return hierarchical_allreduce(nbytes, hosts, per_host, net, local)
        return flat_allreduce(nbytes, hosts, per_host, net, local)

    grads = [Gradient(b, (f if overlap else 1.0) * compute.backward) for b, f in compute.gradients]
    if hosts * per_host <= 1:
        done, sizes = compute.backward, []
    else:
        done, sizes = fuse(grads, cycle_time, threshold, cost)
    comm_total = sum(cost(s) for s in sizes)
    step = compute.forward + max(compute.backward, done) + compute.update
    links = step
    if cpu is not None:
        step = max(step, cpu.step(hosts * per_host, per_host))
    return {"seconds": step, "exposed_communication": step - compute.seconds, "communication": comm_total,
            "messages": len(sizes), "links_seconds": links, "cpu_bound": step > links}


def ps_step(compute: Compute, hosts: int, per_host: int, servers: int, net: Link, colocated: bool = True,
            overlap: bool = True) -> Dict[str, float]:
    """Seconds of one step on MXNet's parameter server with ``servers`` servers. ``colocated``: server j runs on
    worker host j (as the n-server layout does); else the servers have hosts of their own. Each gradient is pushed
    when ready and pulled back after the servers have every worker's (the transfer of each array overlaps the rest of
    the backward pass with ``overlap``); the busiest host link sets the bandwidth term; per array, a push and a pull
    message to each server."""
    n = compute.gradient_bytes
    workers = hosts  # a host's ranks (per_host of them) are aggregated locally: one push per host
    if workers <= 1:  # one host: the kvstore's local aggregation, no network
        return {"seconds": compute.seconds, "exposed_communication": 0.0, "communication": 0.0, "messages": 0}
    share = n / servers
    # Bytes per byte of gradient on the busiest host's link, in one direction: during an array's push alone
    # (``push``), and per array once pushes and pulls of successive arrays overlap (``steady``: the push and the pull
    # directions added where they share a direction).
    if colocated:
        # a host with a server: pushes in from the other workers, its worker's pushes out to the other servers; the
        # pull reverses both
        push = max((workers - 1) * share, (servers - 1) * share)
        steady = (workers - 1) * share + (servers - 1) * share
        if servers < workers:  # a host without a server: n out in the push, n in in the pull
            push, steady = max(push, n), max(steady, n)
    else:
        push = steady = max(workers * share, n)
    push, steady = push / n, steady / n

    def cost(nbytes: float) -> float:  # one array: a push and a pull, the servers' sums of every worker's share
        return 2 * net.alpha + steady * nbytes * net.beta + workers * nbytes / servers * net.gamma

    grads = [Gradient(b, (f if overlap else 1.0) * compute.backward) for b, f in compute.gradients]
    done, sizes = fuse(grads, 0.0, 0.0, cost)
    if sizes:
        # The last array's pull overlaps no later push: with one server, host0's link receives every push, then
        # sends every pull, so one array alone takes 2(h-1) n beta, not (h-1) n beta.
        done += max(0.0, 2 * push - steady) * sizes[-1] * net.beta
    step = compute.forward + max(compute.backward, done) + compute.update
    return {"seconds": step, "exposed_communication": step - compute.seconds,
            "communication": sum(cost(b) for b in sizes), "messages": len(sizes)}


def efficiency(single_step: float, step: float) -> float:
    """Scaling efficiency with a fixed batch per rank: the single rank's step time over the step time at scale."""
    return single_step / step
