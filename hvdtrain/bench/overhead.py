"""``python -m hvdtrain bench overhead``: the hvdtrain Trainer against a hand-written Horovod loop of the same
framework. hvdtrain runs twice: at its defaults, and with ``--reseed checkpoint`` (the framework's generator reseeded
where a run can resume instead of before every step: MXNet's reseed is about 1 ms), since the bare loop, which
cannot resume at all, reseeds nothing."""
from __future__ import annotations

import time
from typing import Dict

from .runner import add_run_arguments, check_sizes, compare, cores, run_loop, run_recipe, save, threads_per_rank


TARGET = 1.02
RESEED = "hvdtrain --reseed checkpoint"


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
            RESEED: lambda n=n: run_recipe(recipe, framework, n, threads, steps,
                                           extra + ["--reseed", "checkpoint"], timeout),
        }, rounds)
        ratio = res["bare"]["images_per_sec"] / res["hvdtrain"]["images_per_sec"]
        reseed = res["bare"]["images_per_sec"] / res[RESEED]["images_per_sec"]
        rows.append({"np": n, "variants": res, "step_time_ratio": ratio, "within_target": ratio <= TARGET,
                     "step_time_ratio_reseed_checkpoint": reseed})
    return {"benchmark": "overhead", "recipe": recipe, "framework": framework, "threads_per_rank": threads,
            "cores": cores(), "rounds": rounds, "steps": steps, "batch_size": batch_size, "target": TARGET,
            "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    check_sizes(max_np=args.max_np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = overhead(args.recipe, args.framework, args.max_np, args.rounds, args.steps, args.batch_size)
    for r in result["rows"]:
        v = r["variants"]
        print(f"np={r['np']}: hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s, bare "
              f"{v['bare']['images_per_sec']:.1f} img/s; step time hvdtrain/bare {r['step_time_ratio']:.3f} "
              f"({'within' if r['within_target'] else 'over'} the {TARGET} target); with --reseed checkpoint "
              f"{v[RESEED]['images_per_sec']:.1f} img/s, {r['step_time_ratio_reseed_checkpoint']:.3f}")
    save(args.output_dir, "overhead", result, {f"np={r['np']}": r["variants"] for r in result["rows"]},
          f"{args.recipe} on {args.framework}: hvdtrain vs a bare Horovod loop")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="the hvdtrain Trainer against a bare Horovod loop, np = 1..N")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--framework", default="torch", choices=["torch", "mxnet"])
    p.add_argument("--max-np", type=int, default=2)
    add_run_arguments(p)
