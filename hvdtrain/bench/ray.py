"""``python -m hvdtrain bench ray``: the same training launched by ``hvdtrain ray`` on a Ray cluster and by
``horovodrun`` over ssh, on the same namespace hosts, one rank per host.

The hosts of ``bench network`` (``scripts/netns_cluster.sh``, root only; links unshaped unless ``--rate`` says
otherwise); a Ray head on host0 and a Ray node on every other host (``ray start``, token authentication as Ray sets it
up, ``--num-cpus 1`` each). Each round launches the recipe (MNIST on the embedded digits by default) once each way,
in alternating order, from host0. The figures, per arm: the steady img/s (the mean of the epochs after the first),
the launch's wall time, and its wall time outside the epochs (start-up, the last evaluation and the shutdown: what
the launcher adds is the difference between the arms); and the ratio of Ray's steady img/s to horovodrun's with the
spread of the rounds' ratios. The Ray cluster's own start, once, is reported beside them.
"""
from __future__ import annotations

import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from ..config import ConfigError
from .cluster import _launch, _run, run_records, shaped_cluster
from .runner import check_sizes, compare, save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PORT = 6390
ARMS = ("horovodrun", "ray")


def ray_start(index: int, head: str, address: str, cpus: int, temp: str) -> List[str]:
    """``ray start`` for namespace host ``index`` at ``address``: the head on host0 (GCS at ``head``), a node
    joining it elsewhere; Ray's files under ``temp``/hostN (a short path: Ray's sockets live there)."""
    where = ["--head", "--port", head.rpartition(":")[2], "--include-dashboard", "false"] if index == 0 \
        else ["--address", head]
    return [os.path.join(os.path.dirname(sys.executable), "ray"), "start", *where, "--node-ip-address", address,
            "--num-cpus", str(cpus), "--object-store-memory", str(100 * 2**20), "--disable-usage-stats",
            "--temp-dir", os.path.join(temp, f"host{index}")]


def ray_env(token: str) -> Dict[str, str]:
    """Ray's token authentication, on for the head, the nodes and the driver alike."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def _digits(out: str) -> str:
    path = os.path.join(out, "digits")
    if not os.path.exists(os.path.join(path, "train-labels-idx1-ubyte")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_digits_mnist.py"), path], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def run(args) -> int:
    check_sizes(rounds=args.rounds, hosts=args.hosts)
    if args.epochs < 2:
        raise ConfigError("--epochs must be at least 2 (the steady rate is that of the epochs after the first)")
    if os.geteuid() != 0:
        raise ConfigError("bench ray needs root (network namespaces)")
    os.makedirs(args.output_dir, exist_ok=True)
    data = args.data_dir or _digits(args.output_dir)
    job = ["recipe", args.recipe, "--framework", args.framework, "--data-dir", data, "--epochs", str(args.epochs),
           "--threads", "1", "--resume", "never", *args.recipe_args]
    env = ray_env(secrets.token_hex(32))
    temp = tempfile.mkdtemp(prefix="hvdtrain-ray-", dir="/tmp")
    try:
        with shaped_cluster(args.hosts, args.rate) as cluster:
            head = f"{cluster.addresses[0]}:{PORT}"
            started = time.monotonic()
            for i, address in enumerate(cluster.addresses):
                _run(["env", *(f"{k}={v}" for k, v in env.items()), *cluster.prefix(i),
                      *ray_start(i, head, address, 1, temp)], f"ray start on host{i}")
            ray_up = time.monotonic() - started
            print(f"bench: a Ray cluster of {args.hosts} nodes up in {ray_up:.1f} s", flush=True)

            def arm(kind: str):
                with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
                    if kind == "horovodrun":
                        cmd = _launch(cluster, args.hosts, ["-m", "hvdtrain", *job, "--output-dir", out])
                    else:
                        cmd = [*cluster.prefix(0), sys.executable, "-m", "hvdtrain", "ray", "--address", head,
                               "--num-workers", str(args.hosts), "--placement", "spread", *job, "--output-dir", out]
                    began = time.monotonic()
                    records = run_records(cmd, out, args.timeout, {**env, "PYTHONPATH": ROOT}, f"the {kind} launch")
                    wall = time.monotonic() - began
                return {"images_per_sec": statistics.mean(float(r["images_per_sec"]) for r in records[1:]),
                        "wall_seconds": wall,
                        "outside_epochs_seconds": wall - sum(float(r["epoch_seconds"]) for r in records)}
            res = compare({kind: (lambda kind=kind: arm(kind)) for kind in ARMS}, args.rounds)
            for i in range(args.hosts):
                subprocess.run([*cluster.prefix(i), os.path.join(os.path.dirname(sys.executable), "ray"), "stop",
                                "--force"], capture_output=True, timeout=120)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    ratios = sorted(r["images_per_sec"] / h["images_per_sec"]
                    for r, h in zip(res["ray"]["rounds"], res["horovodrun"]["rounds"]))

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in res[kind]["rounds"])
    result = {"benchmark": "ray", "hosts": args.hosts, "rate": args.rate, "recipe": args.recipe,
              "framework": args.framework, "epochs": args.epochs, "rounds": args.rounds, "variants": res,
              "ray_cluster_start_seconds": ray_up,
              "steady_ray_over_horovodrun": res["ray"]["images_per_sec"] / res["horovodrun"]["images_per_sec"],
              "steady_ratio_min": ratios[0], "steady_ratio_max": ratios[-1],
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"{'launcher':11s} {'steady img/s (min-max)':>26s} {'wall s':>8s} {'outside epochs s':>17s}")
    for kind in ARMS:
        v = res[kind]
        print(f"{kind:11s} {v['images_per_sec']:12.1f} ({v['min']:.1f}-{v['max']:.1f})".ljust(38)
              + f"{median(kind, 'wall_seconds'):8.1f} {median(kind, 'outside_epochs_seconds'):17.1f}")
    print(f"steady img/s, ray / horovodrun: {result['steady_ray_over_horovodrun']:.3f} (rounds "
          f"{ratios[0]:.3f}-{ratios[-1]:.3f}); the Ray cluster itself started in {ray_up:.1f} s")
    save(args.output_dir, "ray", result, {f"{args.hosts} hosts": res},
         f"{args.recipe} on {args.hosts} hosts: hvdtrain ray against horovodrun, steady img/s")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ray", help="the same training under hvdtrain ray on a Ray cluster and under horovodrun, "
                                   "on namespace hosts: start-up and steady img/s (root)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="10gbit", help="each host's link, each way (tc's units)")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--framework", default="torch", choices=("torch", "mxnet"))
    p.add_argument("--data-dir", default="", help="the recipe's data (default: the embedded digits, written once)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds a launch may take")
    p.add_argument("--output-dir", default="runs/bench/ray")
    p.add_argument("recipe_args", nargs="*", help="more of the recipe's flags, after --")
