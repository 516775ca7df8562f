"""``python -m hvdtrain bench ps``: Horovod against MXNet's parameter server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Sequence, Tuple

from .runner import add_run_arguments, check_sizes, compare, cores, free_port, run_loop, save, threads_per_rank


Place = Callable[[str, int], Tuple[List[str], str, str]]
"""(role, index) -> (the command prefix that runs a process on that role's host, the host's address, its interface);
roles: scheduler, server, worker."""


def loopback(role: str, index: int) -> Tuple[List[str], str, str]:
    return [], "127.0.0.1", "lo"


def run_ps(recipe: str, workers: int, servers: int, threads: int, steps: int, batch_size: int,
           timeout: float, place: Place = loopback, recipe_args: Sequence[str] = (), warmup: int = 0,
           details: bool = False):
    """Global img/s of the bare Gluon loop on MXNet's parameter server: a scheduler, ``servers`` servers and
    ``workers`` workers, on loopback or where ``place`` puts them, each in its own session so that none outlives the
    run (a stale scheduler or server on the port breaks the next run). ``recipe_args``: the recipe's own options.
    ``details``: a dict instead, with the workers' CPU seconds per timed step and the servers' and scheduler's CPU
    seconds per timed step (sampled every 50 ms while the workers run, read at rank 0's timed window)."""
    import signal
    base = dict(os.environ, DMLC_PS_ROOT_URI=place("scheduler", 0)[1], DMLC_PS_ROOT_PORT=str(free_port()),
                DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers), OMP_NUM_THREADS=str(threads))

    def env(role: str, index: int) -> Tuple[List[str], Dict[str, str]]:
        prefix, address, interface = place(role, index)
        return prefix, dict(base, DMLC_ROLE=role, DMLC_NODE_HOST=address, DMLC_INTERFACE=interface)

    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        procs = []
        stop = threading.Event()  # ends the sampler of the scheduler's and servers' CPU (details)
        try:
            for role, index in [("scheduler", 0)] + [("server", j) for j in range(servers)]:
                prefix, role_env = env(role, index)  # MXNet starts the role when imported
                procs.append(subprocess.Popen([*prefix, sys.executable, "-c", "import mxnet"], env=role_env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                              start_new_session=True))
            workers_ = []
            for i in range(workers):
                prefix, role_env = env("worker", i)
                workers_.append(subprocess.Popen(
                    [*prefix, sys.executable, "-m", "hvdtrain.bench.loops", "ps-mxnet", "--recipe", recipe, "--steps",
                     str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads",
                     str(threads), "--result", result, "--", *recipe_args],
                    env=role_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
            procs += workers_
            services = procs[:1 + servers]
            samples: List[Tuple[float, List[float]]] = []
            ticks = os.sysconf("SC_CLK_TCK")

            def sample():  # the scheduler's and servers' CPU seconds over time, to read at the workers' timed window
                while not stop.is_set():
                    samples.append((time.time(), [_cpu_seconds(p.pid, ticks) for p in services]))
                    stop.wait(0.05)
            sampler = threading.Thread(target=sample, daemon=True)
            if details:
                sampler.start()
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
                raise RuntimeError("bench: parameter server worker failed: " + " | ".join(lines[-3:]))
            with open(result) as f:
                ips = float(json.load(f)["images_per_sec"])
            if not details:
                return ips
            stop.set()
            sampler.join()
            workers_cpu, window = [], None
            for i in range(workers):
                with open(f"{result}.rank{i}") as f:
                    row = json.load(f)
                workers_cpu.append(row["cpu_seconds_per_step"])
                window = window or row["timed_window"]

            def at(t: float) -> List[float]:  # the last sample at or before t
                earlier = [cpu for when, cpu in samples if when <= t]
                return earlier[-1] if earlier else samples[0][1]
            begin, end = at(window[0]), at(window[1])
            services_cpu = [(b - a) / steps for a, b in zip(begin, end)]
            return {"images_per_sec": ips, "worker_cpu_per_step": workers_cpu,
                    "scheduler_cpu_per_step": services_cpu[0], "server_cpu_per_step": services_cpu[1:]}
        finally:
            stop.set()
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except OSError:
                        pass
                p.wait()


def _cpu_seconds(pid: int, ticks: int) -> float:
    """User + system CPU seconds of a running process and its threads, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, IndexError, ValueError):
        return float("nan")


def parameter_server(recipe: str, np_: int, rounds: int, steps: int, batch_size: int, timeout: float = 600) -> Dict:
    """Horovod (bare Gluon loop) against MXNet's parameter server with 1 and 2 servers, at 1 and ``np_`` workers."""
    threads = threads_per_rank(np_)
    res = compare({
        "horovod np=1": lambda: run_loop("horovod-mxnet", recipe, 1, threads, steps, batch_size, timeout),
        f"horovod np={np_}": lambda: run_loop("horovod-mxnet", recipe, np_, threads, steps, batch_size, timeout),
        "ps 1 server np=1": lambda: run_ps(recipe, 1, 1, threads, steps, batch_size, timeout),
        f"ps 1 server np={np_}": lambda: run_ps(recipe, np_, 1, threads, steps, batch_size, timeout),
        f"ps 2 servers np={np_}": lambda: run_ps(recipe, np_, 2, threads, steps, batch_size, timeout),
    }, rounds)
    med = {k: v["images_per_sec"] for k, v in res.items()}
    return {"benchmark": "ps", "recipe": recipe, "framework": "mxnet", "np": np_, "threads_per_rank": threads,
            "cores": cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "variants": res,
            "horovod_over_ps_1_server": med[f"horovod np={np_}"] / med[f"ps 1 server np={np_}"],
            "horovod_over_ps_2_servers": med[f"horovod np={np_}"] / med[f"ps 2 servers np={np_}"],
            "efficiency": {"horovod": med[f"horovod np={np_}"] / (np_ * med["horovod np=1"]),
                           "ps 1 server": med[f"ps 1 server np={np_}"] / (np_ * med["ps 1 server np=1"]),
                           "ps 2 servers": med[f"ps 2 servers np={np_}"] / (np_ * med["ps 1 server np=1"])},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    check_sizes(np=args.np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = parameter_server(args.recipe, args.np, args.rounds, args.steps, args.batch_size)
    for name, v in result["variants"].items():
        print(f"{name}: {v['images_per_sec']:.1f} img/s (min {v['min']:.1f}, max {v['max']:.1f})")
    eff = result["efficiency"]
    print(f"Horovod / parameter server at np={args.np}: {result['horovod_over_ps_1_server']:.3f} (1 server), "
          f"{result['horovod_over_ps_2_servers']:.3f} (2 servers); scaling efficiency: Horovod "
          f"{100 * eff['horovod']:.0f}%, PS 1 server {100 * eff['ps 1 server']:.0f}%, "
          f"PS 2 servers {100 * eff['ps 2 servers']:.0f}%")
    save(args.output_dir, "ps", result, {"": result["variants"]}, f"{args.recipe} on MXNet: Horovod vs parameter server")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ps", help="Horovod against MXNet's parameter server (kvstore dist_sync, 1 and 2 servers)")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--np", type=int, default=2)
    add_run_arguments(p)
