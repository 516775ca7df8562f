"""``python -m hvdtrain bench scaling``: throughput and scaling efficiency of a recipe at np = 1..N, in interleaved
rounds."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List

from ..config import ConfigError
from .runner import cores, run_recipe, threads_per_rank


def scaling(recipe: str, framework: str, max_np: int, rounds: int, steps: int, extra: List[str],
            timeout: float = 600) -> Dict:
    """Interleaved rounds over np = 1..max_np; median, spread and efficiency per np."""
    n_cores = cores()
    threads = threads_per_rank(max_np)
    sizes = list(range(1, max_np + 1))
    samples: Dict[int, List[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):  # A B, then B A: no size always runs first
            samples[n].append(run_recipe(recipe, framework, n, threads, steps, extra, timeout))
            print(f"bench: round {r + 1}/{rounds} np={n}: {samples[n][-1]:.1f} img/s", flush=True)
    base = statistics.median(samples[1])
    rows = []
    for n in sizes:
        med = statistics.median(samples[n])
        rows.append({"np": n, "images_per_sec": med, "per_worker": med / n, "min": min(samples[n]),
                     "max": max(samples[n]), "samples": samples[n], "efficiency": med / (n * base)})
    return {"benchmark": "scaling", "recipe": recipe, "framework": framework, "threads_per_rank": threads,
            "cores": n_cores, "rounds": rounds, "steps": steps, "extra_args": extra, "rows": rows,
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


def run(args) -> int:
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


def add_parser(sub) -> None:
    p = sub.add_parser("scaling", help="throughput and scaling efficiency at np = 1..N")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    p.add_argument("--max-np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--real-data", action="store_true", help="the recipe's data instead of --synthetic")
    p.add_argument("--output-dir", default="runs/bench")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: more options for the recipe")
