"""``python -m hvdtrain bench ddp``: Horovod against PyTorch DistributedDataParallel on the same cores."""
from __future__ import annotations

import time
from typing import Dict

from .runner import add_run_arguments, check_sizes, compare, cores, run_loop, run_recipe, save, threads_per_rank


def ddp(recipe: str, np_: int, rounds: int, steps: int, batch_size: int, timeout: float = 600) -> Dict:
    """Horovod (bare loop, Gloo) against PyTorch DDP (gloo), with hvdtrain beside them, at ``np_`` workers."""
    threads = threads_per_rank(np_)
    extra = ["--synthetic", "--batch-size", str(batch_size)]
    res = compare({
        "horovod": lambda: run_loop("horovod-torch", recipe, np_, threads, steps, batch_size, timeout),
        "ddp": lambda: run_loop("ddp-torch", recipe, np_, threads, steps, batch_size, timeout),
        "hvdtrain": lambda: run_recipe(recipe, "torch", np_, threads, steps, extra, timeout),
    }, rounds)
    return {"benchmark": "ddp", "recipe": recipe, "framework": "torch", "np": np_, "threads_per_rank": threads,
            "cores": cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "variants": res,
            "horovod_over_ddp": res["horovod"]["images_per_sec"] / res["ddp"]["images_per_sec"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    check_sizes(np=args.np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = ddp(args.recipe, args.np, args.rounds, args.steps, args.batch_size)
    v = result["variants"]
    print(f"np={args.np}: Horovod {v['horovod']['images_per_sec']:.1f} img/s, DDP {v['ddp']['images_per_sec']:.1f} "
          f"img/s, hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s; Horovod/DDP {result['horovod_over_ddp']:.3f}")
    save(args.output_dir, "ddp", result, {f"np={args.np}": v}, f"{args.recipe}: Horovod vs PyTorch DDP (gloo)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ddp", help="Horovod against PyTorch DistributedDataParallel (both on Gloo)")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--np", type=int, default=2)
    add_run_arguments(p)
