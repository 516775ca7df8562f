"""``python -m hvdtrain bench scaling|overhead|ddp|ps|allreduce|input``: throughput measured side by side.

``scaling``: throughput of a recipe at np = 1, 2, ....

Each round launches the recipe once per world size, in interleaved order (np=1, np=2, ..., then again), so that
drift of a shared machine spreads over all sizes alike; the report gives the median and the spread of the rounds.
Every rank gets the same number of CPU threads at every size (cores / max np), so np=1 and np=N use the same cores
per rank and the comparison measures scaling, not thread counts. Scaling efficiency = img/s(np) / (np x img/s(1)),
the figure both source articles report. Writes ``scaling.json`` and ``scaling.png`` (bars: img/s per np; line:
efficiency against the ideal 100%).

``overhead``: the hvdtrain Trainer against a hand-written Horovod loop (:mod:`hvdtrain.bench_loops`) with the same
model, batch, optimizer and threads, at np = 1..N; the figure is step time hvdtrain / step time bare (target <= 1.03).
``ddp``: the bare Horovod loop under ``horovodrun --gloo`` against PyTorch's DistributedDataParallel under ``torchrun``
with the gloo backend (and hvdtrain beside them); the figure is throughput Horovod / DDP. ``ps``: the bare Horovod
Gluon loop against the same loop on MXNet's parameter server (kvstore dist_sync, 1 and 2 servers on loopback), with
the scaling efficiency of each. ``allreduce``: bus bandwidth per message size (:mod:`hvdtrain.bench_allreduce`) and
ResNet-50's 161 gradients under several fusion thresholds and cycle times. ``input``: the recipe's loader alone
against training on real and on synthetic data. Every comparison interleaves its variants within each round (A B C,
then C B A) and reports median, min and max per variant.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

from .config import ConfigError


def _run_once(recipe: str, framework: str, np_: int, threads: int, steps: int, extra: List[str],
              timeout: float) -> float:
    """Global img/s of one short run of ``recipe`` on ``np_`` local workers."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        cmd = [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, "-m", "hvdtrain",
               "recipe", recipe, "--framework", framework, "--epochs", "1", "--warmup-epochs", "0",
               "--max-steps", str(steps), "--threads", str(threads), "--resume", "never", "--output-dir", out,
               *extra]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"bench: np={np_} did not finish within {timeout:.0f}s: {' '.join(cmd)}") from None
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            cause = [line.split("hvdtrain: error: ", 1)[1] for line in lines if "hvdtrain: error: " in line][:1]
            raise RuntimeError(f"bench: np={np_} failed (exit {proc.returncode}): " + " | ".join(cause or lines[-3:]))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return float(json.loads(f.readlines()[-1])["images_per_sec"])


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _threads_per_rank(np_: int) -> int:
    """The same threads per rank in every variant and at every size: the cores divided by the most ranks run."""
    return max(1, _cores() // np_)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_loop(loop: str, recipe: str, np_: int, threads: int, steps: int, batch_size: int, timeout: float) -> float:
    """Global img/s of one run of a bare loop (hvdtrain.bench_loops) on ``np_`` local workers."""
    binary = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        args = ["--recipe", recipe, "--steps", str(steps), "--batch-size", str(batch_size), "--threads", str(threads),
                "--result", result]
        if loop == "ddp-torch":
            cmd = [os.path.join(binary, "torchrun"), "--nproc_per_node", str(np_), "--master_addr", "127.0.0.1",
                   "--master_port", str(_free_port()), "-m", "hvdtrain.bench_loops", loop, *args]
        else:
            cmd = [os.path.join(binary, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                   sys.executable, "-m", "hvdtrain.bench_loops", loop, *args]
        out_json = _run_worker(cmd, result, timeout, f"{loop} np={np_}", {"OMP_NUM_THREADS": str(threads)})
        return float(out_json["images_per_sec"])


def compare(variants: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, Dict]:
    """Each variant once per round, in alternating order; median, min, max and samples of its img/s."""
    names = list(variants)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(variants[name]())
            print(f"bench: round {r + 1}/{rounds} {name}: {samples[name][-1]:.1f} img/s", flush=True)
    return {n: {"images_per_sec": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
            for n, s in samples.items()}


def overhead(recipe: str, framework: str, max_np: int, rounds: int, steps: int, batch_size: int,
             timeout: float = 600) -> Dict:
    """hvdtrain against the bare Horovod loop of the same framework, at np = 1..max_np."""
    threads = _threads_per_rank(max_np)
    extra = ["--synthetic", "--batch-size", str(batch_size)]
    rows = []
    for n in range(1, max_np + 1):
        res = compare({
            "hvdtrain": lambda n=n: _run_once(recipe, framework, n, threads, steps, extra, timeout),
            "bare": lambda n=n: _run_loop(f"horovod-{framework}", recipe, n, threads, steps, batch_size, timeout),
        }, rounds)
        ratio = res["bare"]["images_per_sec"] / res["hvdtrain"]["images_per_sec"]
        rows.append({"np": n, "variants": res, "step_time_ratio": ratio, "within_target": ratio <= 1.03})
    return {"benchmark": "overhead", "recipe": recipe, "framework": framework, "threads_per_rank": threads,
            "cores": _cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "target": 1.03,
            "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def ddp(recipe: str, np_: int, rounds: int, steps: int, batch_size: int, timeout: float = 600) -> Dict:
    """Horovod (bare loop, Gloo) against PyTorch DDP (gloo), with hvdtrain beside them, at ``np_`` workers."""
    threads = _threads_per_rank(np_)
    extra = ["--synthetic", "--batch-size", str(batch_size)]
    res = compare({
        "horovod": lambda: _run_loop("horovod-torch", recipe, np_, threads, steps, batch_size, timeout),
        "ddp": lambda: _run_loop("ddp-torch", recipe, np_, threads, steps, batch_size, timeout),
        "hvdtrain": lambda: _run_once(recipe, "torch", np_, threads, steps, extra, timeout),
    }, rounds)
    return {"benchmark": "ddp", "recipe": recipe, "framework": "torch", "np": np_, "threads_per_rank": threads,
            "cores": _cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "variants": res,
            "horovod_over_ddp": res["horovod"]["images_per_sec"] / res["ddp"]["images_per_sec"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _run_ps(recipe: str, workers: int, servers: int, threads: int, steps: int, batch_size: int,
            timeout: float) -> float:
    """Global img/s of the bare Gluon loop on MXNet's parameter server: a scheduler, ``servers`` servers and
    ``workers`` workers on loopback, each in its own session so that none outlives the run (a stale scheduler or
    server on the port breaks the next run)."""
    import signal
    base = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(_free_port()),
                DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers), DMLC_NODE_HOST="127.0.0.1",
                DMLC_INTERFACE="lo", OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        procs = []
        try:
            for role in ["scheduler"] + ["server"] * servers:  # MXNet starts the role when imported
                procs.append(subprocess.Popen([sys.executable, "-c", "import mxnet"], env=dict(base, DMLC_ROLE=role),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                              start_new_session=True))
            workers_ = [subprocess.Popen([sys.executable, "-m", "hvdtrain.bench_loops", "ps-mxnet", "--recipe",
                                          recipe, "--steps", str(steps), "--batch-size", str(batch_size), "--threads",
                                          str(threads), "--result", result],
                                         env=dict(base, DMLC_ROLE="worker"), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
                        for _ in range(workers)]
            procs += workers_
            deadline = time.monotonic() + timeout
            for w in workers_:
                try:
                    w.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"bench: parameter server with {workers} worker(s), {servers} server(s) did "
                                       f"not finish within {timeout:.0f}s") from None
            bad = [w for w in workers_ if w.returncode != 0]
            if bad or not os.path.exists(result):
                lines = (bad[0].stdout.read() if bad else "").strip().splitlines()
                raise RuntimeError(f"bench: parameter server worker failed: " + " | ".join(lines[-3:]))
            with open(result) as f:
                return float(json.load(f)["images_per_sec"])
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except OSError:
                        pass
                p.wait()


def parameter_server(recipe: str, np_: int, rounds: int, steps: int, batch_size: int, timeout: float = 600) -> Dict:
    """Horovod (bare Gluon loop) against MXNet's parameter server with 1 and 2 servers, at 1 and ``np_`` workers."""
    threads = _threads_per_rank(np_)
    res = compare({
        "horovod np=1": lambda: _run_loop("horovod-mxnet", recipe, 1, threads, steps, batch_size, timeout),
        f"horovod np={np_}": lambda: _run_loop("horovod-mxnet", recipe, np_, threads, steps, batch_size, timeout),
        "ps 1 server np=1": lambda: _run_ps(recipe, 1, 1, threads, steps, batch_size, timeout),
        f"ps 1 server np={np_}": lambda: _run_ps(recipe, np_, 1, threads, steps, batch_size, timeout),
        f"ps 2 servers np={np_}": lambda: _run_ps(recipe, np_, 2, threads, steps, batch_size, timeout),
    }, rounds)
    med = {k: v["images_per_sec"] for k, v in res.items()}
    return {"benchmark": "ps", "recipe": recipe, "framework": "mxnet", "np": np_, "threads_per_rank": threads,
            "cores": _cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "variants": res,
            "horovod_over_ps_1_server": med[f"horovod np={np_}"] / med[f"ps 1 server np={np_}"],
            "horovod_over_ps_2_servers": med[f"horovod np={np_}"] / med[f"ps 2 servers np={np_}"],
            "efficiency": {"horovod": med[f"horovod np={np_}"] / (np_ * med["horovod np=1"]),
                           "ps 1 server": med[f"ps 1 server np={np_}"] / (np_ * med["ps 1 server np=1"]),
                           "ps 2 servers": med[f"ps 2 servers np={np_}"] / (np_ * med["ps 1 server np=1"])},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def input_pipeline(recipe: str, framework: str, np_: int, rounds: int, steps: int, recipe_args: List[str],
                   timeout: float = 600) -> Dict:
    """The recipe's loader alone against training on real data and on --synthetic data, interleaved."""
    threads = _threads_per_rank(np_)

    def loader_alone() -> float:
        with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
            result = os.path.join(out, "result.json")
            cmd = [sys.executable, "-m", "hvdtrain.bench_loops", "loader", "--recipe", recipe, "--steps", str(steps),
                   "--result", result, "--", "--framework", framework, "--threads", str(threads), *recipe_args]
            return float(_run_worker(cmd, result, timeout, "loader", {})["images_per_sec"])

    res = compare({
        "loader": loader_alone,
        "train-real": lambda: _run_once(recipe, framework, np_, threads, steps, recipe_args, timeout),
        "train-synthetic": lambda: _run_once(recipe, framework, np_, threads, steps, [*recipe_args, "--synthetic"],
                                             timeout),
    }, rounds)
    real, synthetic, loader = (res[k]["images_per_sec"] for k in ("train-real", "train-synthetic", "loader"))
    # The loader alone is one process; np processes each run one.
    headroom = loader * np_ / synthetic
    return {"benchmark": "input", "recipe": recipe, "framework": framework, "np": np_, "threads_per_rank": threads,
            "cores": _cores(), "rounds": rounds, "steps": steps, "recipe_args": recipe_args, "variants": res,
            "real_over_synthetic": real / synthetic, "loader_headroom": headroom,
            "loader_bound": headroom < 1.0, "target": 0.95,
            "within_target": (real / synthetic >= 0.95) if headroom >= 1.5 else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def plot_compare(groups: Dict[str, Dict[str, Dict]], title: str, path: str) -> None:
    """Grouped bars (median img/s, min-max whiskers): one group per key of ``groups``, one bar per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(next(iter(groups.values())))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(names):
        xs = [g + i * width for g in range(len(groups))]
        rows = [groups[k][name] for k in groups]
        ax.bar(xs, [r["images_per_sec"] for r in rows], width, label=name,
               yerr=[[r["images_per_sec"] - r["min"] for r in rows], [r["max"] - r["images_per_sec"] for r in rows]],
               capsize=3)
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(list(groups))
    ax.set_ylabel("images / s (global, median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_worker(cmd: List[str], result: str, timeout: float, what: str, env: Dict[str, str]) -> Dict:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                              env=dict(os.environ, **env))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench: {what} did not finish within {timeout:.0f}s") from None
    if proc.returncode != 0 or not os.path.exists(result):
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        raise RuntimeError(f"bench: {what} failed (exit {proc.returncode}): " + " | ".join(lines[-3:]))
    with open(result) as f:
        return json.load(f)


def _allreduce_cmd(variant: str, np_: int, args: List[str]) -> List[str]:
    binary = os.path.dirname(sys.executable)
    worker = ["-m", "hvdtrain.bench_allreduce"]
    if variant == "horovod-gloo":
        return [os.path.join(binary, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                sys.executable, *worker, "horovod", *args]
    if variant == "horovod-mpi":
        return ["mpirun", "-np", str(np_), "-H", f"localhost:{np_}", "-bind-to", "none", "-map-by", "slot",
                "-mca", "pml", "ob1", "-mca", "btl", "^openib", "-x", "PATH", "-x", "PYTHONPATH",
                sys.executable, *worker, "horovod", *args]
    if variant == "torch-gloo":
        return [os.path.join(binary, "torchrun"), "--nproc_per_node", str(np_), "--master_addr", "127.0.0.1",
                "--master_port", str(_free_port()), *worker, "torch", *args]
    return [sys.executable, *worker, "memcpy", *args]


FUSION_GRID = [(0, 1.0), (8 << 20, 1.0), (32 << 20, 1.0), (128 << 20, 1.0), (0, 10.0), (32 << 20, 10.0),
               (128 << 20, 10.0)]
"""(HOROVOD_FUSION_THRESHOLD bytes, HOROVOD_CYCLE_TIME ms) tried on ResNet-50's gradients; Horovod's (and so
hvdtrain's) default is 128 MB and 1 ms."""
DEFAULT_FUSION = (128 << 20, 1.0)


def allreduce(np_: int, rounds: int, sizes: List[int], fusion_rounds: int, grid=None, timeout: float = 600) -> Dict:
    """Bus bandwidth per message size for Horovod on Gloo and on MPI, torch.distributed on Gloo and memcpy; then
    ResNet-50's 161 gradients under each fusion threshold and cycle time of :data:`FUSION_GRID`."""
    import shutil
    variants = ["horovod-gloo"] + (["horovod-mpi"] if shutil.which("mpirun") else []) + ["torch-gloo", "memcpy"]
    size_arg = ["--sizes", ",".join(map(str, sizes))]
    samples: Dict[str, List[Dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        for r in range(rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
                samples[v].append(_run_worker(_allreduce_cmd(v, np_, [*size_arg, "sizes", "--result", result]),
                                              result, timeout, f"allreduce {v}", env))
                print(f"bench: round {r + 1}/{rounds} {v}: " + ", ".join(
                    f"{row['bytes'] >> 10}K {row['busbw_gbps']:.2f} GB/s" for row in samples[v][-1]["rows"]),
                    flush=True)
        rows = []
        for i, nbytes in enumerate(sizes):
            row: Dict = {"bytes": nbytes}
            for v in variants:
                secs = [s["rows"][i]["seconds"] for s in samples[v]]
                med = statistics.median(secs)
                factor = 2 * (np_ - 1) / np_ if v != "memcpy" and np_ > 1 else 1.0
                row[v] = {"seconds": med, "min": min(secs), "max": max(secs),
                          "algbw_gbps": nbytes / med / 1e9, "busbw_gbps": nbytes / med / 1e9 * factor}
            rows.append(row)
        fusion: Dict[str, List[float]] = {}
        names = {f"{t >> 20}MB/{c:g}ms": (t, c) for t, c in (grid or FUSION_GRID)}
        order = list(names)
        for r in range(fusion_rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                t, c = names[name]
                env = {"HOROVOD_FUSION_THRESHOLD": str(t), "HOROVOD_CYCLE_TIME": str(c), "OMP_NUM_THREADS": "1"}
                res = _run_worker(_allreduce_cmd("horovod-gloo", np_, ["resnet50", "--result", result]), result,
                                  timeout, f"resnet50 allreduce {name}", env)
                fusion.setdefault(name, []).append(res["seconds"])
                print(f"bench: round {r + 1}/{fusion_rounds} fusion {name}: {1000 * res['seconds']:.1f} ms",
                      flush=True)
    settings = [{"setting": n, "fusion_threshold_bytes": names[n][0], "cycle_time_ms": names[n][1],
                 "seconds": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
                for n, s in fusion.items()]
    best = min(settings, key=lambda s: s["seconds"])
    default = next(s for s in settings if (s["fusion_threshold_bytes"], s["cycle_time_ms"]) == DEFAULT_FUSION)
    return {"benchmark": "allreduce", "np": np_, "rounds": rounds, "variants": variants, "rows": rows,
            "resnet50": {"tensors": 161, "bytes": 25557032 * 4, "settings": settings, "best": best["setting"],
                         "default": default["setting"], "default_over_best": default["seconds"] / best["seconds"],
                         "within_target": default["seconds"] <= 1.10 * best["seconds"]},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def plot_allreduce(result: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    sizes = [r["bytes"] for r in result["rows"]]
    for v in result["variants"]:
        left.plot(sizes, [r[v]["busbw_gbps"] for r in result["rows"]], "o-", label=v)
    left.set_xscale("log", base=2)
    left.set_xlabel("message size (bytes)")
    left.set_ylabel("bus bandwidth (GB/s, median)")
    left.set_title(f"allreduce, np={result['np']}")
    left.legend()
    settings = result["resnet50"]["settings"]
    colors = ["#DD8452" if s["setting"] == result["resnet50"]["default"] else "#4C72B0" for s in settings]
    right.bar([s["setting"] for s in settings], [1000 * s["seconds"] for s in settings], color=colors,
              yerr=[[1000 * (s["seconds"] - s["min"]) for s in settings],
                    [1000 * (s["max"] - s["seconds"]) for s in settings]], capsize=3)
    right.set_ylabel("ms per round of 161 gradients (median)")
    right.set_title("ResNet-50 gradients: fusion threshold / cycle time (orange: default)")
    right.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scaling(recipe: str, framework: str, max_np: int, rounds: int, steps: int, extra: List[str],
            timeout: float = 600) -> Dict:
    """Interleaved rounds over np = 1..max_np; median, spread and efficiency per np."""
    cores = _cores()
    threads = _threads_per_rank(max_np)
    sizes = list(range(1, max_np + 1))
    samples: Dict[int, List[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):  # A B, then B A: no size always runs first
            samples[n].append(_run_once(recipe, framework, n, threads, steps, extra, timeout))
            print(f"bench: round {r + 1}/{rounds} np={n}: {samples[n][-1]:.1f} img/s", flush=True)
    base = statistics.median(samples[1])
    rows = []
    for n in sizes:
        med = statistics.median(samples[n])
        rows.append({"np": n, "images_per_sec": med, "per_worker": med / n, "min": min(samples[n]),
                     "max": max(samples[n]), "samples": samples[n], "efficiency": med / (n * base)})
    return {"benchmark": "scaling", "recipe": recipe, "framework": framework, "threads_per_rank": threads,
            "cores": cores, "rounds": rounds, "steps": steps, "extra_args": extra, "rows": rows,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def plot_scaling(result: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    nps = [r["np"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(n) for n in nps], [r["images_per_sec"] for r in rows], color="#4C72B0",
           yerr=[[r["images_per_sec"] - r["min"] for r in rows], [r["max"] - r["images_per_sec"] for r in rows]],
           capsize=4)
    ax.set_xlabel("workers (np)")
    ax.set_ylabel("images / s (global, median)")
    eff = ax.twinx()
    eff.plot([str(n) for n in nps], [100 * r["efficiency"] for r in rows], "o-", color="#DD8452", label="efficiency")
    eff.plot([str(n) for n in nps], [100] * len(nps), "--", color="grey", label="ideal")
    eff.set_ylim(0, 120)
    eff.set_ylabel("scaling efficiency (%)")
    eff.legend(loc="lower right")
    ax.set_title(f"{result['recipe']} on {result['framework']}, {result['threads_per_rank']} thread(s) per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain bench",
                                     description="Measure hvdtrain side by side; see docs in hvdtrain/bench.py.")
    sub = parser.add_subparsers(dest="what", required=True)
    sc = sub.add_parser("scaling", help="throughput and scaling efficiency at np = 1..N")
    sc.add_argument("--recipe", default="mnist")
    sc.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    sc.add_argument("--max-np", type=int, default=2)
    sc.add_argument("--rounds", type=int, default=3)
    sc.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    sc.add_argument("--real-data", action="store_true", help="the recipe's data instead of --synthetic")
    sc.add_argument("--output-dir", default="runs/bench")
    sc.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: more options for the recipe")
    ov = sub.add_parser("overhead", help="the hvdtrain Trainer against a bare Horovod loop, np = 1..N")
    ov.add_argument("--recipe", default="mnist")
    ov.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    ov.add_argument("--max-np", type=int, default=2)
    dd = sub.add_parser("ddp", help="Horovod against PyTorch DistributedDataParallel (both on Gloo)")
    ps = sub.add_parser("ps", help="Horovod against MXNet's parameter server (kvstore dist_sync, 1 and 2 servers)")
    for p in (dd, ps):
        p.add_argument("--recipe", default="mnist")
        p.add_argument("--np", type=int, default=2)
    for p in (ov, dd, ps):
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
        p.add_argument("--batch-size", type=int, default=32, help="per worker")
        p.add_argument("--output-dir", default="runs/bench")
    ar = sub.add_parser("allreduce", help="allreduce bandwidth (Horovod Gloo/MPI, torch.distributed, memcpy) and "
                                          "fusion settings on ResNet-50's gradients")
    ar.add_argument("--np", type=int, default=2)
    ar.add_argument("--rounds", type=int, default=3)
    ar.add_argument("--fusion-rounds", type=int, default=2)
    ar.add_argument("--sizes", default="4096,65536,1048576,16777216,134217728", help="bytes, comma-separated")
    ar.add_argument("--fusion", default="", help="settings to try as MB/ms pairs, e.g. 0/1,128/1 (default: a grid "
                                                  "around Horovod's default 128/1, which is always included)")
    ar.add_argument("--output-dir", default="runs/bench")
    ip = sub.add_parser("input", help="the input pipeline alone against training on real and synthetic data")
    ip.add_argument("--recipe", default="imagenet")
    ip.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    ip.add_argument("--np", type=int, default=1)
    ip.add_argument("--rounds", type=int, default=3)
    ip.add_argument("--steps", type=int, default=30, help="batches per run")
    ip.add_argument("--output-dir", default="runs/bench")
    ip.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: the recipe's options (--data-dir ...)")
    args = parser.parse_args(argv)
    if args.what == "input":
        return _main_input(args)
    if args.what == "ps":
        return _main_ps(args)
    if args.what == "allreduce":
        return _main_allreduce(args)
    if args.what == "overhead":
        return _main_overhead(args)
    if args.what == "ddp":
        return _main_ddp(args)
    if args.max_np < 1 or args.rounds < 1 or args.steps < 1:
        raise ConfigError("--max-np, --rounds and --steps must be at least 1")
    extra = [a for a in args.recipe_args if a != "--"] + ([] if args.real_data else ["--synthetic"])
    result = scaling(args.recipe, args.framework, args.max_np, args.rounds, args.steps, extra)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "scaling.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot_scaling(result, os.path.join(args.output_dir, "scaling.png"))
    for r in result["rows"]:
        print(f"np={r['np']}: {r['images_per_sec']:.1f} img/s (min {r['min']:.1f}, max {r['max']:.1f}), "
              f"{r['per_worker']:.1f} per worker, efficiency {100 * r['efficiency']:.1f}%")
    print(f"bench: wrote {args.output_dir}/scaling.json and scaling.png")
    return 0


def _check_sizes(**sizes: int) -> None:
    bad = [k for k, v in sizes.items() if v < 1]
    if bad:
        raise ConfigError(", ".join("--" + k.replace("_", "-") for k in bad) + " must be at least 1")


def _save(output_dir: str, name: str, result: Dict, groups: Dict[str, Dict[str, Dict]], title: str) -> None:
    """NAME.json and NAME.png (grouped bars of the variants) in ``output_dir``."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot_compare(groups, title, os.path.join(output_dir, f"{name}.png"))
    print(f"bench: wrote {output_dir}/{name}.json and {name}.png")


def _main_overhead(args) -> int:
    _check_sizes(max_np=args.max_np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = overhead(args.recipe, args.framework, args.max_np, args.rounds, args.steps, args.batch_size)
    for r in result["rows"]:
        v = r["variants"]
        print(f"np={r['np']}: hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s, bare "
              f"{v['bare']['images_per_sec']:.1f} img/s; step time hvdtrain/bare {r['step_time_ratio']:.3f} "
              f"({'within' if r['within_target'] else 'over'} the 1.03 target)")
    _save(args.output_dir, "overhead", result, {f"np={r['np']}": r["variants"] for r in result["rows"]},
          f"{args.recipe} on {args.framework}: hvdtrain vs a bare Horovod loop")
    return 0


def _main_ddp(args) -> int:
    _check_sizes(np=args.np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = ddp(args.recipe, args.np, args.rounds, args.steps, args.batch_size)
    v = result["variants"]
    print(f"np={args.np}: Horovod {v['horovod']['images_per_sec']:.1f} img/s, DDP {v['ddp']['images_per_sec']:.1f} "
          f"img/s, hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s; Horovod/DDP {result['horovod_over_ddp']:.3f}")
    _save(args.output_dir, "ddp", result, {f"np={args.np}": v}, f"{args.recipe}: Horovod vs PyTorch DDP (gloo)")
    return 0


def _main_allreduce(args) -> int:
    try:
        sizes = [int(v) for v in args.sizes.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--sizes must be byte counts separated by commas, got {args.sizes!r}") from None
    _check_sizes(np=args.np, rounds=args.rounds, fusion_rounds=args.fusion_rounds, smallest_size=min(sizes or [0]))
    grid = None
    if args.fusion:
        try:
            grid = [(int(float(mb) * (1 << 20)), float(ms)) for mb, ms in (p.split("/") for p in args.fusion.split(","))]
        except ValueError:
            raise ConfigError(f"--fusion must be MB/ms pairs separated by commas, got {args.fusion!r}") from None
        if DEFAULT_FUSION not in grid:
            grid.append(DEFAULT_FUSION)
    result = allreduce(args.np, args.rounds, sizes, args.fusion_rounds, grid)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "allreduce.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot_allreduce(result, os.path.join(args.output_dir, "allreduce.png"))
    for r in result["rows"]:
        print(f"{r['bytes']:>10} bytes: " + "  ".join(f"{v} {r[v]['busbw_gbps']:.3f} GB/s" for v in result["variants"]))
    rn = result["resnet50"]
    print(f"ResNet-50 gradients: best {rn['best']}, default {rn['default']} takes {rn['default_over_best']:.3f}x the "
          f"best ({'within' if rn['within_target'] else 'over'} the 1.10 target)")
    print(f"bench: wrote {args.output_dir}/allreduce.json and allreduce.png")
    return 0


def _main_input(args) -> int:
    _check_sizes(np=args.np, rounds=args.rounds, steps=args.steps)
    recipe_args = [a for a in args.recipe_args if a != "--"]
    result = input_pipeline(args.recipe, args.framework, args.np, args.rounds, args.steps, recipe_args)
    v = result["variants"]
    verdict = ("the loader is the bottleneck" if result["loader_bound"] else
               "within the 0.95 target" if result["within_target"] else
               "under the 0.95 target" if result["within_target"] is False else "loader headroom under 1.5x")
    print(f"loader alone {v['loader']['images_per_sec']:.1f} img/s per process; training on real data "
          f"{v['train-real']['images_per_sec']:.1f} img/s, on synthetic {v['train-synthetic']['images_per_sec']:.1f} "
          f"img/s; real/synthetic {result['real_over_synthetic']:.3f} ({verdict})")
    _save(args.output_dir, "input", result, {f"{args.recipe} {args.framework} np={args.np}": v},
          "input pipeline: loader alone, training on real and synthetic data")
    return 0


def _main_ps(args) -> int:
    _check_sizes(np=args.np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = parameter_server(args.recipe, args.np, args.rounds, args.steps, args.batch_size)
    for name, v in result["variants"].items():
        print(f"{name}: {v['images_per_sec']:.1f} img/s (min {v['min']:.1f}, max {v['max']:.1f})")
    eff = result["efficiency"]
    print(f"Horovod / parameter server at np={args.np}: {result['horovod_over_ps_1_server']:.3f} (1 server), "
          f"{result['horovod_over_ps_2_servers']:.3f} (2 servers); scaling efficiency: Horovod "
          f"{100 * eff['horovod']:.0f}%, PS 1 server {100 * eff['ps 1 server']:.0f}%, "
          f"PS 2 servers {100 * eff['ps 2 servers']:.0f}%")
    _save(args.output_dir, "ps", result, {"": result["variants"]}, f"{args.recipe} on MXNet: Horovod vs parameter server")
    return 0
