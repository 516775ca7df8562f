"""The collectives of ``bench network``'s step timed alone on the emulated cluster's links (``--collectives-only``:
the calibration of the cost model) and the step's gradients averaged three ways (``--allreduce-paths``)."""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

from . import linkprobe
from .cluster import QUOTA_PERIOD_US, Cluster, _launch, shaped_cluster
from .costmodel import rate_bits
from .prediction import allreduce_link
from .runner import free_port, run_worker

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
                     cpu_quota: float = 0.0, frontends: Sequence[str] = ("mxnet",), rounds: int = 1,
                     cores_per_host: int = 0, quota_period_us: int = QUOTA_PERIOD_US) -> Dict:
    """``--collectives-only``: the same cluster, links and quotas, the collectives alone (a few minutes), through
    each of ``frontends``."""
    elements = gradient_bytes(hidden) // 4
    with shaped_cluster(max(hosts), rate, burst, cpu_quota, cores_per_host, quota_period_us) as cluster:
        link = linkprobe.measure(cluster, rate)
        rows = _collectives_rows(cluster, hosts, hidden, rate, timeout, frontends, rounds, elements)
        # a second size, through the first frontend: what separates the per-message cost from the per-byte ones
        small = _collectives_rows(cluster, hosts, hidden, rate, timeout, frontends[:1], rounds, elements // 8)
    return {"benchmark": "network collectives", "framework": frontends[0], "frontends_timed": list(frontends),
            "rounds": rounds, "model": f"mnist recipe, --hidden {hidden}",
            "gradient_mb": 4 * elements / 1e6, "rate": rate, "cpu_quota_cores": cpu_quota,
            "cpu_quota_period_us": quota_period_us if cpu_quota else None,
            "cores_per_host": cores_per_host, **rows, **link,
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



def gradient_shapes(hidden: int) -> List[Tuple[int, ...]]:
    """The shapes of the benchmark network's gradients (the recipe's, the same on both frameworks)."""
    from .loops import _recipe
    trainer = _recipe("mnist", "torch", 32, 1, ["--hidden", str(hidden)])
    return [tuple(p.shape) for p in trainer.build_torch().parameters()]


def gradient_bytes(hidden: int) -> int:
    """Bytes of float32 gradients of the benchmark's network."""
    return 4 * sum(int(math.prod(s)) for s in gradient_shapes(hidden))



def allreduce_paths(hosts: Sequence[int], rate: str, hidden: int, timeout: float = 600, burst: int = 0,
                    cpu_quota: float = 0.0, rounds: int = 3, cores_per_host: int = 0,
                    quota_period_us: int = QUOTA_PERIOD_US) -> Dict:
    """``--allreduce-paths``: the step's gradients averaged three ways on the same links and quota
    (:data:`hvdtrain.bench.allreduce_worker.PATHS`: Horovod per gradient, Horovod on one flat tensor, c10d's Gloo on
    it), interleaved in one job per host count; seconds and each rank's CPU by thread role per operation."""
    shapes = ",".join("x".join(str(d) for d in s) for s in gradient_shapes(hidden))
    rows = {}
    with shaped_cluster(max(hosts), rate, burst, cpu_quota, cores_per_host, quota_period_us) as cluster:
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
            "cpu_quota_cores": cpu_quota, "cpu_quota_period_us": quota_period_us if cpu_quota else None,
            "cores_per_host": cores_per_host, "repeats": rounds, "rows": rows,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


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
