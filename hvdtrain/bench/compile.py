"""``python -m hvdtrain bench compile``: the recipes with ``--compile`` against eager PyTorch, interleaved.

Each arm is ``hvdtrain recipe R --synthetic`` for two epochs of 64 steps on ``--np`` workers; the second epoch's rate
is what counts (the first compiles: its first step says how long that took). The MNIST recipe's model is a flat
``nn.Sequential`` of layers, without repeated blocks: ``--compile`` compiles it whole there (and says that no
allreduce then overlaps the backward pass); the ImageNet recipe's ResNet compiles its residual blocks one by one.
Writes ``compile.json`` (img/s per recipe and arm, median and range over ``--rounds``, compiled / eager) and
``compile.png``. On a GPU host (``scripts/gpu_check.sh``) the same command measures there.
"""
from __future__ import annotations

import time
from typing import Dict, List

from ..config import ConfigError
from .amp import device_info
from .runner import check_sizes, compare, run_recipe, save, threads_per_rank

RECIPES = {"mnist": ["--batch-size", "32"],
           "imagenet": ["--model", "resnet18_v1b", "--image-size", "64", "--batch-size", "16", "--num-classes", "10"]}
"""The recipes measured and their options (small enough for a CPU)."""


def compile_bench(recipes: List[str], rounds: int, np_: int, backend: str, timeout: float = 1800) -> Dict:
    threads = threads_per_rank(np_)
    rows = {}
    for recipe in recipes:
        base = ["--synthetic", *RECIPES[recipe]]
        arms = {"eager": base, "compiled": [*base, "--compile", "--compile-backend", backend]}
        res = compare({name: (lambda extra=extra: run_recipe(recipe, "torch", np_, threads, 0, extra, timeout,
                                                              epochs=2))
                       for name, extra in arms.items()}, rounds)
        ratio = res["compiled"]["images_per_sec"] / res["eager"]["images_per_sec"]
        rows[recipe] = {"variants": res, "compiled_over_eager": ratio, "options": RECIPES[recipe]}
        print(f"bench: {recipe}: eager {res['eager']['images_per_sec']:.1f} img/s, compiled "
              f"{res['compiled']['images_per_sec']:.1f} img/s ({backend}), compiled/eager {ratio:.3f}", flush=True)
    return {"benchmark": "compile", "framework": "torch", "backend": backend, "np": np_, "rounds": rounds,
            "threads_per_rank": threads, "recipes": rows, "environment": device_info(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise ConfigError(f"--recipes must be a comma-separated subset of {','.join(RECIPES)}, got {args.recipes!r}")
    check_sizes(np=args.np, rounds=args.rounds)
    result = compile_bench(recipes, args.rounds, args.np, args.backend)
    save(args.output_dir, "compile", result, {r: row["variants"] for r, row in result["recipes"].items()},
         f"--compile ({args.backend}) against eager on {result['environment']['device']}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="the recipes with --compile against eager PyTorch, interleaved")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--np", type=int, default=1, help="workers")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: no code generated)")
    p.add_argument("--output-dir", default="runs/bench/compile")
