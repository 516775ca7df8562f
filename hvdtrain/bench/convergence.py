"""``python -m hvdtrain bench convergence``: does scaling out keep the accuracy of one worker?

The claim both source articles rest on (Goyal et al.: the same accuracy up to a global batch of 8k, with the learning
rate scaled linearly and warmed up): the same recipe trained in several arms that differ only in how the global batch
is made, each to the end of its schedule:

    np=1 x accumulate 1   batch B on one worker (the reference)
    np=2 x accumulate 1   B per worker on two, the rate scaled x2 (data parallelism)
    np=1 x accumulate 2   B twice per step on one worker, the rate scaled x2 (the same global batch, no allreduce)
    np=2 x accumulate 2   4B, the rate scaled x4
    np=2 x accumulate 4   8B, the rate scaled x8: where the linear rule starts to strain

Each arm's test accuracy per epoch goes to ``convergence.json`` and ``convergence.png`` (one line per arm), with the
final accuracy, its difference from the reference, and the wall time of the arm. Each finished arm also leaves
``runs/ARM/arm.json``: run again with the same options, the benchmark reads finished arms instead of training them.
``--seeds`` repeats every arm per seed, to measure the spread that seeds alone give. The arms run one after another
(not interleaved: this measures accuracy, not speed), so the wall times are comparable only on a quiet machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

from ..config import ConfigError
from .runner import check_sizes, write

ARMS: List[Tuple[int, int]] = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)]
"""(workers, accumulate) of each arm; the first is the reference."""


def arm_name(np_: int, accumulate: int) -> str:
    return f"np={np_} x accumulate {accumulate}"


def run_arm(recipe: str, framework: str, np_: int, accumulate: int, seed: int, extra: List[str], out: str,
            timeout: float) -> Dict:
    """Train one arm to the end; its per-epoch records and wall time. An arm already trained with the same command
    in ``out`` (its ``arm.json``) is read instead of trained again, so an interrupted benchmark resumes."""
    done = os.path.join(out, "arm.json")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, "-m", "hvdtrain",
           "recipe", recipe, "--framework", framework, "--accumulate", str(accumulate), "--seed", str(seed),
           "--resume", "never", "--output-dir", out, *extra]
    if os.path.exists(done):
        with open(done) as f:
            previous = json.load(f)
        if previous.get("command") == cmd[7:]:  # from "-m hvdtrain" on: the interpreter's path may differ
            print(f"bench: {arm_name(np_, accumulate)}, seed {seed}: trained before, read from {done}", flush=True)
            return previous["result"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench: {arm_name(np_, accumulate)} did not finish within {timeout:.0f}s") from None
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        cause = [line.split("hvdtrain: error: ", 1)[1] for line in lines if "hvdtrain: error: " in line][:1]
        raise RuntimeError(f"bench: {arm_name(np_, accumulate)} failed (exit {proc.returncode}): "
                           + " | ".join(cause or lines[-3:]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    result = {"np": np_, "accumulate": accumulate, "seed": seed, "global_batch": config["global_batch"],
              "seconds": seconds, "val_accuracy": [r["val_accuracy"] for r in records],
              "final_accuracy": records[-1]["val_accuracy"], "best_accuracy": max(r["val_accuracy"] for r in records),
              "lr": [r["lr"] for r in records], "images_per_sec": [r["samples_per_sec"] for r in records]}
    with open(done, "w") as f:
        json.dump({"command": cmd[7:], "result": result}, f, indent=2)
    return result


def convergence(recipe: str, framework: str, arms: List[Tuple[int, int]], seeds: List[int], extra: List[str],
                work_dir: str, timeout: float = 7200) -> Dict:
    runs = []
    for seed in seeds:
        for np_, accumulate in arms:
            name = arm_name(np_, accumulate)
            print(f"bench: {framework} {name}, seed {seed} ...", flush=True)
            out = os.path.join(work_dir, f"{framework}-np{np_}-acc{accumulate}-seed{seed}")
            run = run_arm(recipe, framework, np_, accumulate, seed, extra, out, timeout)
            print(f"bench: {framework} {name}, seed {seed}: test accuracy {100 * run['final_accuracy']:.2f}% "
                  f"(global batch {run['global_batch']}) in {run['seconds']:.0f}s", flush=True)
            runs.append({"arm": name, **run})
    reference = [r["final_accuracy"] for r in runs if (r["np"], r["accumulate"]) == arms[0]]
    ref = sum(reference) / len(reference)
    summary = {}
    for np_, accumulate in arms:
        finals = [r["final_accuracy"] for r in runs if (r["np"], r["accumulate"]) == (np_, accumulate)]
        mean = sum(finals) / len(finals)
        summary[arm_name(np_, accumulate)] = {"final_accuracy": mean, "seeds": len(finals),
                                              "spread": max(finals) - min(finals),
                                              "points_from_reference": 100 * (mean - ref)}
    within = [a for a, s in summary.items() if abs(s["points_from_reference"]) <= 0.5]
    return {"benchmark": "convergence", "recipe": recipe, "framework": framework, "seeds": seeds,
            "extra_args": extra, "reference": arm_name(*arms[0]), "runs": runs, "summary": summary,
            "within_half_a_point": within, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def plot_convergence(results: List[Dict], path: str) -> None:
    """Test accuracy per epoch, one line per arm (and seed), one panel per framework."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        for run in result["runs"]:
            epochs = range(1, len(run["val_accuracy"]) + 1)
            label = f"{run['arm']} (batch {run['global_batch']})" + (
                f", seed {run['seed']}" if len(result["seeds"]) > 1 else "")
            ax.plot(epochs, [100 * a for a in run["val_accuracy"]], marker=".", label=label)
        finals = [100 * r["final_accuracy"] for r in result["runs"]]
        ax.set_ylim(max(0.0, min(finals) - 6), min(100.0, max(finals) + 1.5))
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{result['recipe']} on {result['framework']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parse_arms(text: str) -> List[Tuple[int, int]]:
    try:
        arms = [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        arms = []
    if not arms or any(len(a) != 2 or min(a) < 1 for a in arms):
        raise ConfigError(f"--arms must be NPxACCUMULATE pairs separated by commas (e.g. 1x1,2x1,1x2), got {text!r}")
    return arms  # type: ignore[return-value]


def run(args) -> int:
    arms = _parse_arms(args.arms)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds must be integers separated by commas, got {args.seeds!r}") from None
    check_sizes(seeds=len(seeds))
    extra = [a for a in args.recipe_args if a != "--"]
    results = []
    os.makedirs(args.output_dir, exist_ok=True)
    for framework in args.frameworks.split(","):
        result = convergence(args.recipe, framework, arms, seeds, extra, os.path.join(args.output_dir, "runs"))
        results.append(result)
        for name, s in result["summary"].items():
            print(f"{framework} {name}: {100 * s['final_accuracy']:.2f}% ({s['points_from_reference']:+.2f} points "
                  f"from {result['reference']}" + (f", spread {100 * s['spread']:.2f} over {s['seeds']} seeds" if
                                                   s["seeds"] > 1 else "") + ")")
    write(args.output_dir, "convergence", results, lambda path: plot_convergence(results, path))
    return 0


def add_parser(sub) -> None:
    import argparse
    p = sub.add_parser("convergence", help="test accuracy of one recipe at np=1, np=2 and with accumulation")
    p.add_argument("--recipe", default="fashion-mnist")
    p.add_argument("--frameworks", default="torch,mxnet", help="comma-separated")
    p.add_argument("--arms", default=",".join(f"{n}x{a}" for n, a in ARMS),
                   help="NPxACCUMULATE pairs; the first is the reference")
    p.add_argument("--seeds", default="42", help="comma-separated; every arm runs once per seed")
    p.add_argument("--output-dir", default="runs/bench/convergence")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: more options for the recipe")
