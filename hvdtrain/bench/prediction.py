"""``bench network --predict-from``: the cost model's step time and img/s for each measured arm, from a calibration
of the same links (:mod:`hvdtrain.bench.collectives`)."""
from __future__ import annotations

import json
import statistics
from typing import Dict, List, Optional

from ..config import ConfigError
from .arms import ARMS, TORCH_ARM
from .cluster import QUOTA_PERIOD_US
from .costmodel import rate_bits

def read_calibration(path: str, rate: str, cpu_quota: float, cores_per_host: int = 0,
                     quota_period_us: int = QUOTA_PERIOD_US) -> Dict:
    """The ``calibration`` of a collectives.json, checked to be of the same links and emulation (quota, its period
    and cores per host: a calibration on hosts that own their cores does not predict hosts under a quota, nor the
    reverse)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--predict-from {path}: cannot read it ({e})")
    if "calibration" not in data:
        raise ConfigError(f"--predict-from {path}: no calibration in it; write one with --collectives-only")
    theirs = (data.get("rate", ""), float(data.get("cpu_quota_cores") or 0), int(data.get("cores_per_host") or 0))
    if (rate_bits(theirs[0]) != rate_bits(rate) or theirs[1] != float(cpu_quota)
            or theirs[2] != int(cores_per_host)):
        raise ConfigError(f"--predict-from {path}: calibrated at {theirs[0]}, {theirs[1]:g} cores per host of quota "
                          f"and {theirs[2]} cores of its own per host, not {rate}, {cpu_quota:g} and "
                          f"{cores_per_host}; calibrate at the same --rate, --cpu-quota and --cores-per-host")
    period = int(data.get("cpu_quota_period_us") or QUOTA_PERIOD_US)  # files before the flag: the default's
    if cpu_quota and period != quota_period_us:
        raise ConfigError(f"--predict-from {path}: calibrated under a quota in {period / 1000:g} ms periods, not "
                          f"{quota_period_us / 1000:g}; calibrate at the same --quota-period-ms")
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
    # the backward pass, PyTorch's DDP buckets (the first leaves during it), or one group where a quota leaves the
    # host's one rank less than a core (Backend.allreduce_groups); stock Horovod's one per gradient.
    sizes = [int(b) for b, _ in profile.gradients]
    below = 0 < float(result.get("cpu_quota_cores") or 0) < 1
    hvdtrain_arm = {arm: c.in_groups(plan_sizes(sizes, backend.cpu_groups(below))) if c is not None else None
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
