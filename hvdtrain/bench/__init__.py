"""``python -m hvdtrain bench scaling|overhead|ddp|ps|network|allreduce|input|decode|shards|ray|convergence|amp|compile|project``:
measured side by side, and projected.

One module per benchmark (its name), each with ``add_parser(sub)`` and ``run(args)``; :mod:`.runner` holds what they
share; :mod:`.loops` and :mod:`.allreduce_worker` are the worker programs they launch.

``scaling``: throughput of a recipe at np = 1, 2, ....

Each round launches the recipe once per world size, in interleaved order (np=1, np=2, ..., then again), so that
drift of a shared machine spreads over all sizes alike; the report gives the median and the spread of the rounds.
Every rank gets the same number of CPU threads at every size (cores / max np), so np=1 and np=N use the same cores
per rank and the comparison measures scaling, not thread counts. Scaling efficiency = img/s(np) / (np x img/s(1)),
the figure both source articles report. Writes ``scaling.json`` and ``scaling.png`` (bars: img/s per np; line:
efficiency against the ideal 100%).

``overhead``: the hvdtrain Trainer against a hand-written Horovod loop (:mod:`hvdtrain.bench.loops`) with the same
model, batch, optimizer and threads, at np = 1..N; the figure is step time hvdtrain / step time bare (target <= 1.03).
``ddp``: the bare Horovod loop under ``horovodrun --gloo`` against PyTorch's DistributedDataParallel under ``torchrun``
with the gloo backend (and hvdtrain beside them); the figure is throughput Horovod / DDP. ``ps``: the bare Horovod
Gluon loop against the same loop on MXNet's parameter server (kvstore dist_sync, 1 and 2 servers on loopback), with
the scaling efficiency of each; ``network``: the same over rate-limited links between 2-4 namespace hosts
(:mod:`hvdtrain.bench.network`). ``allreduce``: bus bandwidth per message size
(:mod:`hvdtrain.bench.allreduce_worker`) and ResNet-50's 161 gradients under several fusion thresholds and cycle times. ``input``: the recipe's loader alone
against training on real and on synthetic data; ``decode``: each input path's decoded and augmented images per second
per core (:mod:`hvdtrain.bench.decode`); ``shards``: the ImageNet recipe from tar shards at s3:// over rate-limited
links against local shards and an ImageFolder (:mod:`hvdtrain.bench.shards`); ``ray``: the same training under
``hvdtrain ray`` on a Ray cluster and under horovodrun on the same hosts (:mod:`hvdtrain.bench.ray`). Every comparison interleaves its variants within each round (A B C,
then C B A) and reports median, min and max per variant. ``compile``: the recipes with ``--compile`` against eager
PyTorch (:mod:`hvdtrain.bench.compile`). ``project``: the step's cost model
(:mod:`hvdtrain.bench.costmodel`) at host counts not measured here (docs/scaling.md).
"""
from __future__ import annotations

import argparse
import importlib
from typing import List

BENCHMARKS = ("scaling", "overhead", "ddp", "ps", "network", "allreduce", "input", "decode", "shards", "ray",
              "convergence", "amp", "compile", "project")
"""Module names under hvdtrain.bench, in the order ``bench -h`` lists them."""


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain bench",
                                     description="Measure hvdtrain side by side; see hvdtrain/bench/__init__.py.")
    sub = parser.add_subparsers(dest="what", required=True)
    modules = {name: importlib.import_module(f"{__name__}.{name}") for name in BENCHMARKS}
    for module in modules.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return modules[args.what].run(args)
