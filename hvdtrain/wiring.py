"""How a :class:`~hvdtrain.trainer.Trainer` is put together before its first step (``Trainer.setup``): Horovod started
and checked, the collaborators built (outputs, the rank's reporter, the checkpoint policy, health, phases, the
timeline, evaluation, the monitor), the data and its samplers, the model set up on the backend, and the position
restored from a checkpoint or --init-from. The loop itself (:mod:`hvdtrain.trainer`) only uses what this builds.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Tuple

import numpy as np

from . import guard
from .backends import make_backend
from .backends.base import Task
from .callbacks import Callback, MetricsFile, ProgressLogger, TensorBoard
from .checkpoint_policy import Checkpointer, Position
from .config import ConfigError
from .data import ShardSampler, Synthetic
from .evaluation import Evaluator
from .faults import RankReporter
from .health import Health
from .monitor import Monitor
from .timeline import TimelineWindow


def setup(trainer, restore: bool = True, default_metrics: bool = True) -> None:
    """Start Horovod, build data and model, broadcast rank 0's state, and resume from a checkpoint if any (with
    ``restore``), else start from --init-from's weights if given. ``default_metrics``: the recipe keeps the
    Trainer's :meth:`~hvdtrain.trainer.Trainer.metrics` (they then fit the targets)."""
    cfg = trainer.cfg
    trainer.check()
    trainer.outputs.check_urls(cfg)  # the store answers, with credentials, and the bucket exists: before Horovod
    backend = trainer.backend = make_backend(cfg.framework)
    backend.init(cfg)
    backend.check_horovod_fixes(cfg)  # a Horovod without hvdtrain's fixes: refused or warned, before any output
    # From here on the configuration says the precision the run computes in (--precision auto resolved).
    trainer.precision_requested = cfg.precision
    trainer.cfg = cfg = dataclasses.replace(cfg, precision=backend.precision)
    # Before anything is written: a world the launcher did not start, or an output directory a live job holds.
    if not cfg.elastic:  # elastic worlds change size by design
        guard.check_world_size(backend.size, backend.mpi_built())
    trainer.outputs.take(backend, collective=not cfg.elastic)
    trainer.reporter = RankReporter(cfg.output_dir, backend.rank)
    if backend.rank == 0:  # SIGUSR1 / a stall (half of --stall-timeout): a table of every rank's progress
        trainer.reporter.watch(stall_after=max(1, cfg.stall_timeout // 2))
        trainer.reporter.forget_ranks_from(backend.size)
    trainer.reporter.start()
    trainer.checkpointer = Checkpointer(cfg, backend, trainer.name, trainer.reporter)
    trainer.checkpointer.output_url = trainer.output_url
    trainer.checkpointer.written = trainer.outputs.push
    trainer.health = Health(backend, cfg.max_bad_steps, trainer.checkpointer.directory, cfg)
    # Per-phase step times: the backend marks its phases on its timer, which tells the heartbeat too.
    trainer.phases = backend.phases.configure(cfg.profile_steps, trainer.reporter.enter)
    trainer.timeline = TimelineWindow(cfg, backend)
    backend.seed(cfg.seed)  # the same initial weights everywhere, before rank 0's are broadcast anyway
    trainer.train_set, trainer.val_set = trainer.datasets_for(backend.name, backend.size)
    backend.check_data(trainer.train_set, cfg)
    own_order = getattr(trainer.train_set, "training_sampler", None)  # a dataset that orders itself (shards)
    trainer.train_sampler = (own_order(backend.rank, backend.size, cfg.seed) if own_order else
                             ShardSampler(len(trainer.train_set), backend.rank, backend.size, seed=cfg.seed))
    trainer.val_sampler = (ShardSampler(len(trainer.val_set), backend.rank, backend.size, shuffle=False, pad=False)
                           if trainer.val_set is not None else None)
    trainer.evaluator = Evaluator(backend, trainer.val_set, trainer.val_sampler, trainer.metrics(),
                                  cfg.eval_batch_size or 2 * cfg.batch_size, cfg.num_workers,
                                  default_metrics=default_metrics)
    loss = getattr(trainer, f"loss_{backend.name}", None)
    task = Task(split=trainer.split_batch, step=getattr(trainer, f"step_{backend.name}", None))
    if cfg.compile and not cfg.compile_blocks:
        cfg = dataclasses.replace(cfg, compile_blocks=",".join(trainer.compile_blocks()))
    backend.setup(trainer.framework_hook("build", backend.name)(), cfg, loss_fn=loss() if loss else None,
                  sample_shape=sample_shape(trainer, trainer.train_set), task=task)
    trainer.evaluator.fit_defaults()  # default metrics fit the target (read from the data: no forward yet)
    trainer.monitor = trainer.checkpointer.monitor = (
        Monitor(cfg.monitor, cfg.early_stop, trainer.evaluator.goals()) if cfg.monitor else None)
    trainer._plan()
    if trainer.steps == 0:
        raise ConfigError(f"each of the {backend.size} ranks gets {len(trainer.train_sampler)} training samples, "
                          f"fewer than --batch-size x --accumulate = {cfg.batch_size * cfg.accumulate}; "
                          f"lower --batch-size or run fewer ranks")
    trainer.position = trainer.checkpointer.restore() if restore else Position()
    if cfg.init_from and trainer.position == Position():
        trainer.checkpointer.init_from(evaluating=not restore)
    # One validation batch through the model, the loss and the metrics before any training: a metric that cannot
    # read the model's outputs is a one-line error now, not after the first epoch. After the state's broadcast:
    # MXNet's oneDNN forward leaves weights in a layout Horovod's broadcast cannot read.
    trainer.evaluator.check()


def datasets_for(trainer, framework: str, world_size: int = 1):
    """(train, val) for ``framework``: --synthetic data, the recipe's datasets_FRAMEWORK, or its datasets."""
    if trainer.cfg.synthetic:
        if not trainer.input_shape or not trainer.num_classes:
            raise ConfigError(f"recipe {trainer.name} does not support --synthetic (no input_shape/num_classes)")
        # 64 steps per epoch, or --max-steps in one epoch: a benchmark's steps are all in one timed epoch.
        steps = max(64, trainer.cfg.max_steps)
        n = trainer.cfg.batch_size * trainer.cfg.accumulate * world_size * steps
        return Synthetic(n, trainer.input_shape, trainer.num_classes), None
    hook = getattr(trainer, f"datasets_{framework}", None) or trainer.datasets
    return hook()


def sample_shape(trainer, dataset) -> Tuple[Any, ...]:
    """Shape of one input sample, or one sample's inputs when there are several or they are not floating
    point (frameworks with deferred initialisation need them before the broadcast)."""
    if isinstance(dataset, Synthetic):
        return dataset.shape
    inputs, _ = trainer.split_batch(dataset[0])
    if len(inputs) == 1 and "float" in str(getattr(inputs[0], "dtype", "float")):
        return tuple(getattr(inputs[0], "shape", ()))
    return tuple(a.asnumpy() if hasattr(a, "asnumpy") else np.asarray(a) for a in inputs)


def callbacks(trainer) -> List[Callback]:
    """Rank 0's callbacks: the progress lines, metrics.jsonl, TensorBoard, MLflow (--track), then the user's."""
    out = trainer.cfg.output_dir
    os.makedirs(out, exist_ok=True)
    tracking = ([trainer.outputs.tracker(trainer.cfg, trainer.name, trainer.backend, trainer.checkpointer)]
                if trainer.cfg.track == "mlflow" else [])
    return [ProgressLogger(), MetricsFile(os.path.join(out, "metrics.jsonl")),
            TensorBoard(os.path.join(out, "tensorboard"))] + tracking + trainer.extra_callbacks
