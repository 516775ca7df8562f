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

The pieces, each a module of its own: :mod:`.cluster` (the namespace hosts, their links and CPU quotas),
:mod:`.arms` (what each arm runs), :mod:`.collectives` (the step's collectives timed alone: the calibration),
:mod:`.prediction` (the cost model's prediction from a calibration); this module runs the rounds and reports.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, Sequence

from ..config import ConfigError
from .. import timeline
from . import linkprobe
from .arms import ARMS, _arm, _single, parse_arms
from .cluster import QUOTA_PERIOD_US, check_cores_per_host, check_quota_period, shaped_cluster
from .collectives import (FRONTENDS, _collectives_rows, _print_collectives, _print_paths, allreduce_paths,
                          collectives_only, gradient_bytes)
from .costmodel import rate_bits
from .prediction import _print_prediction, predict, read_calibration
from .runner import check_sizes, compare, write


def network(hosts: Sequence[int], rate: str, hidden: int, rounds: int, steps: int, batch_size: int,
            timeout: float = 600, warmup: int = 10, burst: int = 0, cpu_quota: float = 0.0,
            arms: Sequence[str] = ARMS, journal: str = "", cores_per_host: int = 0, timeline_steps: str = "",
            quota_period_us: int = QUOTA_PERIOD_US) -> Dict:
    """The arms at each host count on the shaped hosts, interleaved over ``rounds`` (each sample also appended to
    ``journal`` as it comes), then the step's collectives alone; a failure of the latter is a warning."""
    recipe_args = ["--hidden", str(hidden)]
    arms = tuple(arms)
    own_base = [a for a in arms if a not in ARMS]  # the PyTorch arms: their own run on one host
    with shaped_cluster(max(hosts), rate, burst, cpu_quota, cores_per_host, quota_period_us) as cluster:
        host_cores = cluster.host_cores()
        link = linkprobe.measure(cluster, rate)
        variants = {}
        if set(arms) & set(ARMS):
            variants["single worker"] = lambda: _single(cluster, steps, warmup, batch_size, recipe_args, timeout)
        for arm in own_base:
            variants[f"{arm} n=1"] = _arm(arm, cluster, 1, steps, warmup, batch_size, recipe_args, timeout,
                                          timeline_steps)
        for n in hosts:
            for arm in arms:
                variants[f"{arm} n={n}"] = _arm(arm, cluster, n, steps, warmup, batch_size, recipe_args, timeout,
                                                timeline_steps)
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
            "cpu_quota_period_us": quota_period_us if cpu_quota else None, "cores_per_host": cores_per_host,
            "host_cores": host_cores, "emulation": emulation(cpu_quota, cores_per_host, quota_period_us),
            "compute_seconds_per_step": batch_size / base,
            "base_arm": arms[0],
            "ideal_seconds_per_step": {  # the bytes each arm's busiest link carries per step, at the rate
                "horovod": {n: 2 * (n - 1) / n * gradient_mb * 8e6 / rate_bits(rate) for n in hosts},
                "ps 1 server": {n: (n - 1) * gradient_mb * 8e6 / rate_bits(rate) for n in hosts}},
            **collectives, **link,
            "timeline_steps": timeline_steps or None,
            "rounds": rounds, "steps": steps, "warmup": warmup, "batch_size": batch_size, "threads_per_rank": 1,
            "arms": list(arms), "variants": res, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _print_timelines(result: Dict) -> None:
    """With --timeline-steps: each hvdtrain variant's Horovod timeline and each DDP variant's bucket times, every
    round's."""
    for name, variant in result["variants"].items():
        for r, sample in enumerate(variant.get("rounds", [])):
            summary = sample.get("timeline")
            if summary:
                ddp = name.startswith("ddp")
                lines = [summary["error"]] if "error" in summary else timeline.describe_summary(
                    summary, "its timed" if ddp else "the timeline's")
                what = "its buckets' allreduces" if ddp else f"Horovod timeline of steps {result['timeline_steps']}"
                print(f"{name}, round {r + 1}, {what}: " + "; ".join(lines))


def _print_link_shares(result: Dict) -> None:
    """Each arm's step against the link's limit (the ring's bytes at the rate) and against what TCP reached on the
    same link both ways at once (the ceiling of an exchange that sends both ways)."""
    both = result.get("link_probe", {}).get("both_ways")
    for row in result["rows"][1:]:
        n = row["hosts"]
        limit = n * result["batch_size"] / result["ideal_seconds_per_step"]["horovod"][n]
        shares = ", ".join(f"{arm} {100 * row[arm]['images_per_sec'] / limit:.0f}%"
                           + (f" ({100 * row[arm]['images_per_sec'] / (limit * both):.0f}%)" if both else "")
                           for arm in result["arms"])
        ceiling = f", {limit * both:.0f} at what TCP reached both ways (in brackets)" if both else ""
        print(f"{n} host(s), the step against the link's limit ({limit:.0f} img/s: the ring's bytes at the rate"
              f"{ceiling}): {shares}")


DEFAULT_QUOTA = 0.4
"""``--cpu-quota`` without ``--cores-per-host``: cores per host under a cgroup quota."""


def emulation(cpu_quota: float, cores_per_host: int, quota_period_us: int = QUOTA_PERIOD_US) -> str:
    """The hosts' CPU in words, as a result and its picture state it."""
    parts = ([f"{cores_per_host} core(s) of its own per host (cpuset)"] if cores_per_host else []) + \
            ([f"a quota of {cpu_quota:g} cores per host in {quota_period_us / 1000:g} ms periods"] if cpu_quota else [])
    return ", ".join(parts) or "the machine's cores shared by every host"


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
    quota = f", {result['emulation']}" if result.get("emulation") else ""
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
    if args.cpu_quota is None:  # a quota by default; none beside cores of its own unless asked for
        args.cpu_quota = 0.0 if args.cores_per_host else DEFAULT_QUOTA
    if args.cpu_quota < 0 or args.burst < 0 or args.warmup < 0 or args.cores_per_host < 0:
        raise ConfigError("--cpu-quota, --cores-per-host, --burst and --warmup must be 0 or more")
    check_cores_per_host(args.cores_per_host)  # before any host is built
    period = int(round(args.quota_period_ms * 1000))
    check_quota_period(args.cpu_quota, period)
    if args.timeline_steps:
        timeline.parse_window(args.timeline_steps)
    if args.allreduce_paths:
        result = allreduce_paths(hosts, args.rate, args.hidden, burst=args.burst, cpu_quota=args.cpu_quota,
                                 rounds=args.rounds, cores_per_host=args.cores_per_host, quota_period_us=period)
        _print_paths(result)
        write(args.output_dir, "paths", result)
        return 0
    if args.collectives_only:
        frontends = [f for f in args.frontends.split(",") if f]
        unknown = [f for f in frontends if f not in FRONTENDS]
        if unknown or not frontends:
            raise ConfigError(f"--frontends {args.frontends!r}: choose from {', '.join(FRONTENDS)}")
        result = collectives_only(hosts, args.rate, args.hidden, burst=args.burst, cpu_quota=args.cpu_quota,
                                  frontends=frontends, rounds=args.rounds, cores_per_host=args.cores_per_host,
                                  quota_period_us=period)
        _print_collectives(result)
        write(args.output_dir, "collectives", result)
        return 0
    calibration = read_calibration(args.predict_from, args.rate, args.cpu_quota, args.cores_per_host,
                                   period) if args.predict_from else None
    arms = parse_arms(args.frameworks)
    journal = os.path.join(args.output_dir, "network.samples.jsonl")
    if os.path.exists(journal):
        os.remove(journal)  # this run's samples only
    print(f"bench: every sample is appended to {journal} as it is measured", flush=True)
    result = network(hosts, args.rate, args.hidden, args.rounds, args.steps, args.batch_size, warmup=args.warmup,
                     burst=args.burst, cpu_quota=args.cpu_quota, arms=arms, journal=journal,
                     cores_per_host=args.cores_per_host, timeline_steps=args.timeline_steps,
                     quota_period_us=period)
    if calibration is not None:
        result["prediction"] = predict(result, calibration)
        _print_prediction(result["prediction"])
    for row in result["rows"]:
        print(f"{row['hosts']} host(s): " + ", ".join(
            f"{arm} {row[arm]['images_per_sec']:.1f} img/s ({100 * row[arm]['efficiency']:.0f}%)"
            for arm in result["arms"]))
    _print_link_shares(result)
    _print_timelines(result)
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
    p.add_argument("--cpu-quota", type=float, default=None,
                   help=f"cores per host (cgroup cpu quota, 0: none; default {DEFAULT_QUOTA:g}, or none with "
                        "--cores-per-host): with all hosts within the machine's cores, the links limit a step, not "
                        "the processors")
    p.add_argument("--quota-period-ms", type=float, default=QUOTA_PERIOD_US / 1000,
                   help="the quota's accounting period (default %(default)g; 1 to 1000, with at least 1 ms of quota "
                        "in it): a host that spent its share of a period waits for the next one, all its threads at "
                        "once; a shorter period is closer to a slower processor that never stops, a real host's")
    p.add_argument("--cores-per-host", type=int, default=0,
                   help="pin each host to this many cores of its own (a cgroup cpuset; 0: none), as a real host "
                        "owns its cores; with more hosts than cores they share them (add --cpu-quota to split one)")
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
                        "torch (hvdtrain on PyTorch), torch-spin and torch-block (the same with horovod.torch's "
                        "spinning wait, with hvdtrain's blocking wait), torch-32k (the same with Gloo's reads "
                        "waking at 32 KiB, the library's default, where hvdtrain chose 4 KiB), "
                        "torch-overlap (the same with --overlap-forward), torch-1group (the same with every gradient "
                        "in one group after the backward pass), torch-1group-overlap (that with --overlap-forward), "
                        "torch-buckets (hvdtrain on PyTorch in DDP's buckets, under a quota too), "
                        "torch-serial (hvdtrain on PyTorch with Horovod running one collective at a time, "
                        "HOROVOD_GLOO_ASYNC_BYTES=0), torch-ring (the same with Horovod's negotiation rounds in "
                        "Gloo's ring, HOROVOD_GLOO_RING_NEGOTIATION=1, where hvdtrain's Horovod uses one exchange), "
                        "ddp (PyTorch DDP under torchrun: default and 1 MB buckets), ddp-timed (DDP's default with "
                        "the comm hook that times its buckets, in every run: the hook's cost), "
                        "horovod-torch (Horovod's PyTorch example, stock settings)")
    p.add_argument("--timeline-steps", default="",
                   help="A:B: every hvdtrain arm records Horovod's timeline of its global steps A to B (of its 128: "
                        "2 epochs of 64) and network.json keeps its summary per round: each collective's negotiation, "
                        "fusion copies and transfer, and how long the link carried transfers per step; the DDP arms "
                        "time each bucket's allreduce over their timed steps (a comm hook doing DDP's default) and "
                        "keep the same summary")
    p.add_argument("--predict-from", default="",
                   help="a collectives.json of --collectives-only at the same --rate, --cpu-quota and "
                        "--cores-per-host (fitted on "
                        "other host counts): print the cost model's step time beside each measured one "
                        "(docs/scaling.md)")
    p.add_argument("--output-dir", default="runs/bench")
