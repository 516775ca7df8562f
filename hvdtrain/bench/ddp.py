"""``python -m hvdtrain bench ddp``: Horovod against PyTorch DistributedDataParallel on the same cores.

The base comparison is three variants at ``--np`` workers: the bare Horovod loop (Gloo), the same loop on DDP (gloo)
and hvdtrain. ``--same-cores`` adds each at np=1 with all the cores to one rank (the scaling a user of one machine
sees: np=2 x 1 thread against np=1 x 2 threads), hvdtrain on MXNet included. ``--candidates`` adds hvdtrain under
each Horovod setting of ``CANDIDATES``, the measurements behind hvdtrain's defaults (``--candidates NAME ...``: those
named only, so that few variants, run side by side, can take more rounds).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..config import ConfigError
from .runner import add_run_arguments, check_sizes, compare, cores, run_loop, run_recipe, save, threads_per_rank

# Horovod settings hvdtrain's step was measured under, each against hvdtrain's defaults (on the CPU the gradients in
# groups, HOROVOD_IDLE_WAIT=2; docs/benchmarks.md lists the figures): name -> (environment, hvdtrain options).
# HOROVOD_IDLE_WAIT comes from hvdtrain's patch of Horovod (scripts/patch_horovod.py, fix 3).
PER_GRADIENT = ["--allreduce-groups", "0"]
CANDIDATES: Dict[str, Tuple[Dict[str, str], List[str]]] = {
    "Horovod's loop, per-gradient allreduces": ({"HOROVOD_IDLE_WAIT": "0"}, PER_GRADIENT),
    "Horovod's loop, one group": ({"HOROVOD_IDLE_WAIT": "0"}, []),
    "cycle 5 ms, one group": ({"HOROVOD_IDLE_WAIT": "0", "HOROVOD_CYCLE_TIME": "5"}, []),
    "idle wait then a cycle, the default groups": ({"HOROVOD_IDLE_WAIT": "1"}, []),
    "idle wait, per-gradient allreduces": ({}, PER_GRADIENT),
    "no response cache": ({"HOROVOD_CACHE_CAPACITY": "0"}, []),
}


def ddp(recipe: str, np_: int, rounds: int, steps: int, batch_size: int, same_cores: bool = False,
        candidates: Optional[Sequence[str]] = None, timeout: float = 600) -> Dict:
    """``candidates``: names of ``CANDIDATES`` to run hvdtrain under as well; empty: all of them; None: none."""
    chosen = [] if candidates is None else list(candidates or CANDIDATES)
    unknown = [name for name in chosen if name not in CANDIDATES]
    if unknown:
        raise ConfigError(f"--candidates: unknown candidate {unknown[0]!r}: choose from "
                          + "; ".join(repr(n) for n in CANDIDATES))
    threads, all_threads = threads_per_rank(np_), cores()
    extra = ["--synthetic", "--batch-size", str(batch_size)]
    variants: Dict[str, Callable[[], float]] = {
        "horovod": lambda: run_loop("horovod-torch", recipe, np_, threads, steps, batch_size, timeout),
        "ddp": lambda: run_loop("ddp-torch", recipe, np_, threads, steps, batch_size, timeout),
        "hvdtrain": lambda: run_recipe(recipe, "torch", np_, threads, steps, extra, timeout, details=True),
    }
    if same_cores:
        variants.update({
            "ddp np=1": lambda: run_loop("ddp-torch", recipe, 1, all_threads, steps, batch_size, timeout),
            "hvdtrain np=1": lambda: run_recipe(recipe, "torch", 1, all_threads, steps, extra, timeout),
            "hvdtrain mxnet": lambda: run_recipe(recipe, "mxnet", np_, threads, steps, extra, timeout),
            "hvdtrain mxnet np=1": lambda: run_recipe(recipe, "mxnet", 1, all_threads, steps, extra, timeout),
        })
    for name in chosen:
        env, options = CANDIDATES[name]
        variants[f"hvdtrain, {name}"] = lambda env=env, options=options: run_recipe(
            recipe, "torch", np_, threads, steps, extra + options, timeout, env, details=True)
    res = compare(variants, rounds)
    for v in res.values():
        v.update(waits(v.get("rounds") or []))
    ips = {name: v["images_per_sec"] for name, v in res.items()}
    result = {"benchmark": "ddp", "recipe": recipe, "framework": "torch", "np": np_, "threads_per_rank": threads,
              "cores": all_threads, "rounds": rounds, "steps": steps, "batch_size": batch_size, "variants": res,
              "horovod_over_ddp": ips["horovod"] / ips["ddp"], "hvdtrain_over_ddp": ips["hvdtrain"] / ips["ddp"],
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if same_cores:
        result["same_cores"] = {"ddp": ips["ddp"] / ips["ddp np=1"], "hvdtrain": ips["hvdtrain"] / ips["hvdtrain np=1"],
                                "hvdtrain mxnet": ips["hvdtrain mxnet"] / ips["hvdtrain mxnet np=1"]}
    if chosen:
        result["candidates"] = {name: {"env": CANDIDATES[name][0], "options": CANDIDATES[name][1],
                                       "over_ddp": ips[f"hvdtrain, {name}"] / ips["ddp"]} for name in chosen}
    return result


def waits(rounds: List[Dict]) -> Dict[str, List[float]]:
    """hvdtrain's wait for its allreduces (the allreduce phase: from the end of the backward pass to synchronize's
    return) and its CPU per step (the mean of the ranks), in ms, each round's, from the records
    ``run_recipe(details=True)`` kept."""
    out = {"allreduce_wait_ms": [round(1e3 * r["phase_seconds"]["allreduce"], 3) for r in rounds
                                 if "allreduce" in (r.get("phase_seconds") or {})],
           "cpu_ms_per_step": [round(1e3 * statistics.mean(r["worker_cpu_per_step"]), 3) for r in rounds
                               if r.get("worker_cpu_per_step")]}
    return {k: v for k, v in out.items() if v}


def run(args) -> int:
    check_sizes(np=args.np, rounds=args.rounds, steps=args.steps, batch_size=args.batch_size)
    result = ddp(args.recipe, args.np, args.rounds, args.steps, args.batch_size, args.same_cores, args.candidates)
    v = result["variants"]
    print(f"np={args.np}: Horovod {v['horovod']['images_per_sec']:.1f} img/s, DDP {v['ddp']['images_per_sec']:.1f} "
          f"img/s, hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s; Horovod/DDP {result['horovod_over_ddp']:.3f}, "
          f"hvdtrain/DDP {result['hvdtrain_over_ddp']:.3f}")
    for name, ratio in result.get("same_cores", {}).items():
        print(f"same cores, {name}: np={args.np} / np=1 {ratio:.3f}")
    for name, c in result.get("candidates", {}).items():
        print(f"candidate {name}: hvdtrain/DDP {c['over_ddp']:.3f}")
    for name, arm in v.items():
        if arm.get("allreduce_wait_ms"):
            wait, cpu = arm["allreduce_wait_ms"], arm.get("cpu_ms_per_step")
            print(f"{name}: waits for its allreduces {statistics.median(wait):.2f} ms a step ({min(wait):.2f}-"
                  f"{max(wait):.2f})" + (f", CPU {statistics.median(cpu):.1f} ms a step ({min(cpu):.1f}-"
                                         f"{max(cpu):.1f})" if cpu else ""))
    save(args.output_dir, "ddp", result, {f"np={args.np}": {k: v[k] for k in ("horovod", "ddp", "hvdtrain")}},
         f"{args.recipe}: Horovod vs PyTorch DDP (gloo)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ddp", help="Horovod against PyTorch DistributedDataParallel (both on Gloo)")
    p.add_argument("--recipe", default="mnist")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--same-cores", action="store_true",
                   help="also np=1 with every core to one rank: the scaling on one machine, MXNet included")
    p.add_argument("--candidates", nargs="*", metavar="NAME",
                   help="also hvdtrain under each Horovod setting measured, or those named: "
                        + "; ".join(repr(n) for n in CANDIDATES))
    add_run_arguments(p)
