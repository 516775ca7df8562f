"""``python -m hvdtrain bench input``: the input pipeline alone against training on real and synthetic data.

Training throughput is the steady state: ``--steps`` steps after the first ``--steps`` (see ``steady`` below)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List

from .runner import check_sizes, compare, cores, run_recipe, run_worker, save, threads_per_rank


def input_pipeline(recipe: str, framework: str, np_: int, rounds: int, steps: int, recipe_args: List[str],
                   timeout: float = 600) -> Dict:
    """The recipe's loader alone against training on real data and on --synthetic data, interleaved."""
    threads = threads_per_rank(np_)

    def loader_alone() -> float:
        with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
            result = os.path.join(out, "result.json")
            cmd = [sys.executable, "-m", "hvdtrain.bench.loops", "loader", "--recipe", recipe, "--steps", str(steps),
                   "--result", result, "--", "--framework", framework, "--threads", str(threads), *recipe_args]
            return float(run_worker(cmd, result, timeout, "loader", {})["images_per_sec"])

    def steady(args: List[str]) -> float:
        """Training img/s of steps steps+1..2 x steps: a run of 2 x steps less a run of steps. The Trainer's epoch
        time includes the loader's start (worker processes, ImageRecordIter's threads and first batches), which an
        epoch of thousands of steps pays once and a run of 30 steps pays in full; the difference cancels it. A run's
        seconds are steps x batch / img/s, so the batch cancels too."""
        short = run_recipe(recipe, framework, np_, threads, steps, args, timeout)
        long = run_recipe(recipe, framework, np_, threads, 2 * steps, args, timeout)
        extra = 2.0 / long - 1.0 / short  # seconds per image of the second half (steps x batch cancel)
        # A run so short that the noise exceeds the start-up cost leaves no positive difference: the long run's own
        # rate then (start-up included), not a negative or infinite img/s.
        return 1.0 / extra if extra > 0 else long

    res = compare({
        "loader": loader_alone,
        "train-real": lambda: steady(recipe_args),
        "train-synthetic": lambda: steady([*recipe_args, "--synthetic"]),
    }, rounds)
    real, synthetic, loader = (res[k]["images_per_sec"] for k in ("train-real", "train-synthetic", "loader"))
    # The loader alone is one process; np processes each run one.
    headroom = loader * np_ / synthetic
    return {"benchmark": "input", "recipe": recipe, "framework": framework, "np": np_, "threads_per_rank": threads,
            "cores": cores(), "rounds": rounds, "steps": steps, "recipe_args": recipe_args, "variants": res,
            "real_over_synthetic": real / synthetic, "loader_headroom": headroom,
            "loader_bound": headroom < 1.0, "target": 0.95,
            "within_target": (real / synthetic >= 0.95) if headroom >= 1.5 else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    check_sizes(np=args.np, rounds=args.rounds, steps=args.steps)
    recipe_args = [a for a in args.recipe_args if a != "--"]
    result = input_pipeline(args.recipe, args.framework, args.np, args.rounds, args.steps, recipe_args)
    v = result["variants"]
    verdict = ("the loader is the bottleneck" if result["loader_bound"] else
               "within the 0.95 target" if result["within_target"] else
               "under the 0.95 target" if result["within_target"] is False else "loader headroom under 1.5x")
    print(f"loader alone {v['loader']['images_per_sec']:.1f} img/s per process; training on real data "
          f"{v['train-real']['images_per_sec']:.1f} img/s, on synthetic {v['train-synthetic']['images_per_sec']:.1f} "
          f"img/s; real/synthetic {result['real_over_synthetic']:.3f} ({verdict})")
    save(args.output_dir, "input", result, {f"{args.recipe} {args.framework} np={args.np}": v},
          "input pipeline: loader alone, training on real and synthetic data")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("input", help="the input pipeline alone against training on real and synthetic data")
    p.add_argument("--recipe", default="imagenet")
    p.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    p.add_argument("--np", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="batches per run")
    p.add_argument("--output-dir", default="runs/bench")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: the recipe's options (--data-dir ...)")
