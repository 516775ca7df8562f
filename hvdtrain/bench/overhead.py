"""``python -m hvdtrain bench overhead``: the hvdtrain Trainer against a hand-written Horovod loop of the same
framework."""
from __future__ import annotations

import time
from typing import Dict

from .runner import add_run_arguments, check_sizes, compare, cores, run_loop, run_recipe, save, threads_per_rank


def overhead(recipe: str, framework: str, max_np: int, rounds: int, steps: int, batch_size: int,
             timeout: float = 600) -> Dict:
    """hvdtrain against the bare Horovod loop of the same framework, at np = 1..max_np."""
    threads = threads_per_rank(max_np)
    extra = ["--synthetic", "--batch-size", str(batch_size)]
    rows = []
    for n in range(1, max_np + 1):
        res = compare({
            "hvdtrain": lambda n=n: run_recipe(recipe, framework, n, threads, steps, extra, timeout),
            "bare": lambda n=n: run_loop(f"horovod-{framework}", recipe, n, threads, steps, batch_size, timeout),
        }, rounds)
        ratio = res["bare"]["images_per_sec"] / res["hvdtrain"]["images_per_sec"]
        rows.append({"np": n, "variants": res, "step_time_ratio": ratio, "within_target": ratio <= 1.03})
    return {"benchmark": "overhead", "recipe": recipe, "framework": framework, "threads_per_rank": threads,
            "cores": cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "target": 1.03,
            "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    check_sizes(max_np=args.max_np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = overhead(args.recipe, args.framework, args.max_np, args.rounds, args.steps, args.batch_size)
    for r in result["rows"]:
        v = r["variants"]
        print(f"np={r['np']}: hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s, bare "
              f"{v['bare']['images_per_sec']:.1f} img/s; step time hvdtrain/bare {r['step_time_ratio']:.3f} "
              f"({'within' if r['within_target'] else 'over'} the 1.03 target)")
    save(args.output_dir, "overhead", result, {f"np={r['np']}": r["variants"] for r in result["rows"]},
          f"{args.recipe} on {args.framework}: hvdtrain vs a bare Horovod loop")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="the hvdtrain Trainer against a bare Horovod loop, np = 1..N")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    p.add_argument("--max-np", type=int, default=2)
    add_run_arguments(p)
