"""What every benchmark shares: running a recipe or a worker under a launcher and reading its result, interleaving
variants, sizing threads, and writing JSON plus a chart."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..config import ConfigError


def run_recipe(recipe: str, framework: str, np_: int, threads: int, steps: int, extra: List[str],
              timeout: float, env: Optional[Dict[str, str]] = None, epochs: int = 1, details: bool = False) -> Any:
    """Global img/s of one short run of ``recipe`` on ``np_`` local workers; ``env``: more environment variables.
    ``details``: a dict instead, the img/s as ``images_per_sec`` with the epoch record's ``phase_seconds`` (means
    across the ranks) and each rank's CPU per step as ``worker_cpu_per_step`` (the network arms' key), which
    :func:`compare` keeps per round.
    fp32 unless ``extra`` says otherwise: the bare loops it is compared with compute in fp32, and ``--precision auto``
    would pick bf16 on some processors only. ``epochs`` > 1: that many whole epochs (``steps`` unused), the last
    one's rate (what a run settles to after a first epoch that compiled, or warmed up)."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        cmd = [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, "-m", "hvdtrain",
               "recipe", recipe, "--framework", framework, "--epochs", str(epochs), "--warmup-epochs", "0",
               *(["--max-steps", str(steps)] if epochs == 1 else []), "--threads", str(threads), "--resume",
               "never", "--output-dir", out, "--precision", "fp32", *extra]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                                  env=dict(os.environ, **(env or {})))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"bench: np={np_} did not finish within {timeout:.0f}s: {' '.join(cmd)}") from None
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            cause = [line.split("hvdtrain: error: ", 1)[1] for line in lines if "hvdtrain: error: " in line][:1]
            raise RuntimeError(f"bench: np={np_} failed (exit {proc.returncode}): " + " | ".join(cause or lines[-3:]))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            record = json.loads(f.readlines()[-1])
        rate = float(record["samples_per_sec"])  # images/s for the image recipes
        if not details:
            return rate
        return {"images_per_sec": rate, "phase_seconds": record.get("phase_seconds") or {},
                "worker_cpu_per_step": record.get("cpu_seconds_per_step") or []}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(np_: int) -> int:
    """The same threads per rank in every variant and at every size: the cores divided by the most ranks run."""
    return max(1, cores() // np_)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loop(loop: str, recipe: str, np_: int, threads: int, steps: int, batch_size: int, timeout: float,
             extra: Sequence[str] = (), env: Optional[Dict[str, str]] = None) -> float:
    """Global img/s of one run of a bare loop (hvdtrain.bench.loops) on ``np_`` local workers; ``extra``: more of
    the loop's options (--precision P, then -- and the recipe's own)."""
    binary = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        args = ["--recipe", recipe, "--steps", str(steps), "--batch-size", str(batch_size), "--threads", str(threads),
                "--result", result, *extra]
        if loop == "ddp-torch":
            cmd = [os.path.join(binary, "torchrun"), "--nproc_per_node", str(np_), "--master_addr", "127.0.0.1",
                   "--master_port", str(free_port()), "-m", "hvdtrain.bench.loops", loop, *args]
        else:
            cmd = [os.path.join(binary, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                   sys.executable, "-m", "hvdtrain.bench.loops", loop, *args]
        out_json = run_worker(cmd, result, timeout, f"{loop} np={np_}",
                              {"OMP_NUM_THREADS": str(threads), **(env or {})})
        return float(out_json["images_per_sec"])


def _cpu_times() -> List[int]:
    """The machine's busy and total CPU time (jiffies, all cores) from /proc/stat; [] where there is none."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return [sum(values) - idle, sum(values)]


def speed_probe(repeats: int = 3) -> float:
    """Seconds for a fixed piece of pure-Python work on one core, the fastest of ``repeats``: this process's view of
    how fast a core of the machine runs now. On a shared host it changes with the load of others (another machine's
    threads on the same physical cores), which no counter here shows; timed beside every sample, it lets a result
    say how fast the machine was while the sample ran."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - start)
    return best


SLOWED = 0.8
"""A sample taken while the machine ran below this fraction of its speed at the run's start is flagged."""


def compare(variants: Dict[str, Callable[[], Any]], rounds: int, journal: str = "",
            probe: Callable[[], float] = speed_probe) -> Dict[str, Dict]:
    """Each variant once per round, in alternating order; median, min, max and samples of its img/s, and the median
    fraction of the machine's cores that were busy while it ran. A variant returns its img/s, or a dict with
    ``images_per_sec`` and more figures (kept per round under ``rounds``). ``journal``: a file that gets a JSON line
    per sample as it is measured, so that a run which fails later (hours, for ``bench network``) keeps them.
    ``probe`` (:func:`speed_probe`) is timed before and after every sample: each sample's ``machine_speed`` is the
    machine's speed then, as a fraction of its speed before the first sample, and a warning names the samples taken
    below :data:`SLOWED` of it."""
    names = list(variants)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    busy: Dict[str, List[float]] = {n: [] for n in names}
    extra: Dict[str, List[Dict]] = {n: [] for n in names}
    speeds: Dict[str, List[float]] = {n: [] for n in names}
    reference = probe()
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            before = _cpu_times()
            probe_before = probe()
            value = variants[name]()
            speed = reference / (0.5 * (probe_before + probe()))
            after = _cpu_times()
            fraction = (after[0] - before[0]) / (after[1] - before[1]) if before and after and after[1] > before[1] \
                else None
            if fraction is not None:
                busy[name].append(fraction)
            speeds[name].append(speed)
            if journal:
                _append_line(journal, {"round": r + 1, "variant": name, "busy": fraction, "machine_speed": speed,
                                       "sample": value if isinstance(value, dict) else {"images_per_sec": value}})
            if isinstance(value, dict):
                extra[name].append(value)
                value = value["images_per_sec"]
            samples[name].append(float(value))
            print(f"bench: round {r + 1}/{rounds} {name}: {samples[name][-1]:.1f} img/s "
                  f"(machine at {speed:.2f} of its speed at the start)", flush=True)
    out = {}
    for n, s in samples.items():
        out[n] = {"images_per_sec": statistics.median(s), "min": min(s), "max": max(s), "samples": s,
                  "machine_speed": speeds[n]}
        if busy[n]:
            out[n]["machine_busy"] = statistics.median(busy[n])
        if extra[n]:
            out[n]["rounds"] = extra[n]
    slowed = [f"{n} round {i + 1} ({v:.2f})" for n in names for i, v in enumerate(speeds[n]) if v < SLOWED]
    if slowed:
        print(f"hvdtrain: warning: the machine ran below {SLOWED:g} of its speed at the start during "
              f"{len(slowed)} sample(s): {', '.join(slowed)}; others' load on its cores: rerun them or compare only "
              f"samples of the same speed", file=sys.stderr, flush=True)
    return out


def _append_line(path: str, row: Dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def run_worker(cmd: List[str], result: str, timeout: float, what: str, env: Dict[str, str]) -> Dict:
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


def check_sizes(**sizes: int) -> None:
    bad = [k for k, v in sizes.items() if v < 1]
    if bad:
        raise ConfigError(", ".join("--" + k.replace("_", "-") for k in bad) + " must be at least 1")


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


def machine() -> Dict:
    """What ran a benchmark: the processor's name and cores (these machines differ: figures of two compare only
    as ratios measured on each)."""
    name = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count()}


def write(output_dir: str, name: str, result, draw: Optional[Callable[[str], None]] = None) -> None:
    """NAME.json (``result``, with :func:`machine` added) in ``output_dir``, and NAME.png where ``draw(path)`` draws
    it."""
    if isinstance(result, dict):
        result.setdefault("machine", machine())
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    if draw is None:
        print(f"bench: wrote {output_dir}/{name}.json")
        return
    draw(os.path.join(output_dir, f"{name}.png"))
    print(f"bench: wrote {output_dir}/{name}.json and {name}.png")


def save(output_dir: str, name: str, result: Dict, groups: Dict[str, Dict[str, Dict]], title: str) -> None:
    """NAME.json and NAME.png (grouped bars of the variants) in ``output_dir``."""
    write(output_dir, name, result, lambda path: plot_compare(groups, title, path))


def add_run_arguments(p) -> None:
    """--rounds, --steps, --batch-size and --output-dir, as the throughput comparisons take them."""
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--output-dir", default="runs/bench")
