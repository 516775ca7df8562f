"""The training loop. It knows no framework: everything framework- or Horovod-specific is behind ``self.backend``.

A recipe (or a user) subclasses :class:`Trainer` and provides data and a model per framework::

    class MyTrainer(Trainer):
        name = "mine"
        def datasets(self):            # framework-free (numpy) data, or datasets_torch / datasets_mxnet
            return ArrayDataset(x_train, y_train), ArrayDataset(x_val, y_val)
        def build_torch(self):         # one builder per framework the recipe supports
            return torch.nn.Sequential(...)

and runs it with ``MyTrainer(MyConfig(...)).fit()`` under ``horovodrun`` (or ``python -m hvdtrain recipe mod:MyTrainer``).

The task contract (the same on both frameworks): a batch is ``(input, ..., target)`` or a dict with a ``"target"``
entry (:meth:`Trainer.split_batch` for anything else); the model is called with the inputs; ``loss_FRAMEWORK()``
returns the loss ``loss(outputs, target)`` used for training and evaluation (softmax cross-entropy by default);
``step_FRAMEWORK(model, batch)`` may replace ``loss(model(*inputs), target)`` altogether; :meth:`Trainer.metrics`
lists the metric objects evaluation reports (:mod:`hvdtrain.metrics`).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import checkpoint, metrics as metric_objects, model_io, schedule, wiring
from .callbacks import Callback
from .checkpoint_policy import Position
from .config import ConfigError, TrainConfig
from .data import split_batch, steps_per_epoch
from .faults import failure_to_raise
from .monitor import Monitor
from .outputs import Outputs
from .phases import epoch_timing
from .report import announce, autotune_best, format_autotune
from .threads import ThreadCpu


class Trainer:
    """Data-parallel training with Horovod on the framework chosen by ``cfg.framework``."""

    name: str = "custom"
    """Recipe name: the default output directory is runs/NAME-FRAMEWORK."""
    config_class = TrainConfig
    report_top5: bool = False
    """Report top-5 accuracy (val_top5) in each epoch's record (the default :meth:`metrics`)."""
    sample_unit: str = "samples"
    """What one sample is, for the throughput's name in records: ``images`` gives ``images_per_sec`` besides
    ``samples_per_sec``."""
    tokens_per_sample: int = 0
    """Tokens in one sample (a sequence model's length): records then carry ``tokens_per_sec`` too."""
    input_shape: Tuple[int, ...] = ()
    """Shape of one sample, for --synthetic."""
    num_classes: int = 0
    """Number of classes, for --synthetic."""
    output_description: str = "logits (unnormalised class scores)"
    """What the model outputs, for an exported model's model.json (a regression says its prediction)."""

    def __init__(self, cfg: Optional[TrainConfig] = None, callbacks: Optional[List[Callback]] = None, **overrides):
        cfg = cfg if cfg is not None else self.config_class()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        if not cfg.output_dir:
            cfg = dataclasses.replace(cfg, output_dir=os.path.join("runs", f"{self.name}-{cfg.framework}"))
        cfg.validate()
        self.outputs = Outputs(cfg.output_dir)
        """Where results go: the directory's guard, a URL's staging copy and pusher, the tracker."""
        self.cfg = cfg = dataclasses.replace(cfg, output_dir=self.outputs.directory)
        self.extra_callbacks = list(callbacks or [])
        self.backend = None
        self.reporter = None
        self.position = Position()
        """Where training stands (epochs complete, samples of the next epoch consumed, optimizer steps)."""
        self.monitor: Optional[Monitor] = None
        """--monitor's best epoch and --early-stop's count (set up in :meth:`setup`)."""

    # --- what a recipe provides -------------------------------------------------------------------------------------
    def check(self) -> None:
        """Check inputs (data paths, flag combinations) before Horovod starts; raise ConfigError naming the fix."""
        if getattr(self, f"build_{self.cfg.framework}", None) is None:
            raise ConfigError(f"recipe {self.name} has no {self.cfg.framework} model; "
                              f"choose another --framework")
        if self.cfg.compile and self.cfg.compile_blocks:  # named blocks must exist: checked on the model, unlaunched
            from .backends.torch_compile import check_blocks
            check_blocks(self.build_torch(), [n for n in self.cfg.compile_blocks.split(",") if n])

    def compile_blocks(self) -> List[str]:
        """With --compile and no --compile-blocks: the submodules (state-dict prefixes) compiled one by one, so
        that each block's gradients reach Horovod as its backward pass ends; [] finds them (the repeated blocks of
        the model's sequential containers: :func:`hvdtrain.backends.torch_compile.find_blocks`)."""
        return []

    def datasets(self) -> Tuple[Any, Any]:
        """(train, val) datasets for every framework; override, or provide datasets_torch / datasets_mxnet.

        Optional per-framework hooks: build_torch / build_mxnet (required, the model) and loss_torch / loss_mxnet
        (a loss taking (logits, labels); default softmax cross-entropy).
        """
        raise ConfigError(f"recipe {self.name} provides no datasets")

    def metrics(self) -> List[metric_objects.Metric]:
        """The metrics evaluation reports (``val_NAME`` in records) besides ``val_loss``, the recipe's loss: by
        default classification accuracy (and top-5 with :attr:`report_top5`) where the targets are class indices, and
        the mean squared and absolute errors where they are not (decided on one validation batch before training:
        :meth:`hvdtrain.evaluation.Evaluator.check`). A regression returns e.g.
        ``[MeanSquaredError(), MeanAbsoluteError()]``, a language model ``[Perplexity()]``; ``[]`` reports the loss
        alone. Each metric's sums are allreduced once per evaluation (:mod:`hvdtrain.metrics`)."""
        return [metric_objects.Accuracy()] + ([metric_objects.TopK(5)] if self.report_top5 else [])

    def split_batch(self, batch: Any) -> Tuple[Tuple[Any, ...], Any]:
        """One batch (as the data loader gives it, on the device) as (the model's positional inputs, the target):
        ``(input, ..., target)`` or a dict with a ``"target"`` entry by default (:func:`hvdtrain.data.split_batch`).
        Override for any other structure."""
        return split_batch(batch)

    def preprocessing(self) -> Dict[str, Any]:
        """How raw inputs become the model's input, for exported models (a recipe describes its own)."""
        return {}

    # --- the loop ---------------------------------------------------------------------------------------------------
    def fit(self) -> Optional[Dict[str, Any]]:
        """Set up and train ``cfg.epochs`` epochs (resuming per ``cfg.resume``); returns the last epoch's record.

        A failure on this rank is written to OUTPUT_DIR/errors/rank-N.txt and named in one line on stderr, and
        Horovod is shut down in order before the exception propagates. When this rank stopped only because the job's
        collectives broke, :class:`~hvdtrain.faults.JobFailed` is raised instead, naming the rank that failed first
        and its error (read from the other ranks' error files and heartbeats).
        """
        return self.guarded(lambda: (self.setup(), self.train())[1])

    def guarded(self, work):
        """Run ``work`` with fit()'s failure handling (see there)."""
        try:
            return work()
        except BaseException as e:
            failure = self._failed(e)
            if failure is not None:
                raise failure from e
            raise
        finally:
            self.outputs.finish()  # the outputs delivered (of a failed run too), and their place free at once
            if self.reporter is not None:
                self.reporter.stop()
            self.outputs.unlock()

    def _failed(self, e: BaseException) -> Optional[BaseException]:
        """Record and report a failure of fit() (:func:`hvdtrain.faults.failure_to_raise`), then stop Horovod in
        order (MXNet's queued ops first) rather than at interpreter exit: the other ranks see the shutdown at once
        instead of waiting for a timeout. Returns the exception to raise instead, if any."""
        try:
            if self.reporter is None or isinstance(e, (ConfigError, checkpoint.CheckpointError, KeyboardInterrupt)):
                return None  # a one-line user error (the same on every rank), or an interrupt: nothing to explain
            return failure_to_raise(e, self.reporter, self.cfg.output_dir)
        finally:
            if self.backend is not None:
                self.backend.shutdown(failed=True)

    def setup(self, restore: bool = True) -> None:
        """Start Horovod, build data and model, broadcast rank 0's state, and resume from a checkpoint if any (with
        ``restore``), else start from --init-from's weights if given (:func:`hvdtrain.wiring.setup`)."""
        wiring.setup(self, restore, default_metrics=type(self).metrics is Trainer.metrics)

    @property
    def output_url(self) -> str:
        """--output-dir when it is a URL (cfg.output_dir is then its local staging copy: :mod:`hvdtrain.outputs`)."""
        return self.outputs.url

    @property
    def output_location(self) -> str:
        """Where the run's outputs are for a user: the URL, else the directory."""
        return self.outputs.location

    def _plan(self) -> None:
        """Steps per (whole) epoch and the global batch, for the world as it is now (again after an elastic reset)."""
        per_rank = self.cfg.batch_size * self.cfg.accumulate
        self.global_batch = per_rank * self.backend.size
        self.steps = steps_per_epoch(len(self.train_sampler), per_rank)

    def train(self) -> Optional[Dict[str, Any]]:
        """The epochs after :meth:`setup`: steps, per-rank-averaged metrics, evaluation, checkpoints, callbacks."""
        cfg, is_root = self.cfg, self.backend.rank == 0
        self.callbacks = wiring.callbacks(self) if is_root else []
        if is_root:
            announce(self, self.steps)
        for cb in self.callbacks:
            cb.on_train_start(self, self.position.epoch)
        self.outputs.push()  # what is written so far (config.json) reaches where the outputs go
        if is_root and self.position.epoch >= cfg.epochs:
            print(f"hvdtrain: the checkpoint already covers all {cfg.epochs} epochs; nothing to train "
                  f"(raise --epochs, or pass --resume never to start over)", flush=True)
        # The model, the data and the rest of the set-up live as long as the run: frozen too (see backend_class), the
        # collections during training walk only what training makes (measured on the MNIST recipe with both freezes:
        # about 10% less CPU per run). Unfrozen after it, so that a later run in this process (a sweep, a notebook)
        # can collect this one's cycles once they are garbage.
        gc.collect()
        gc.freeze()
        try:
            record = self.backend.run_elastic(self) if cfg.elastic else self.run_epochs()
        finally:
            gc.unfreeze()
        self.timeline.after_step(self.global_step, end=True)
        if cfg.autotune and is_root:
            best = autotune_best(os.path.join(cfg.output_dir, "autotune.csv"))
            print(f"hvdtrain: autotune: {format_autotune(best)}; log in {cfg.output_dir}/autotune.csv", flush=True)
        for cb in self.callbacks:
            cb.on_train_end(self, record)
        self.reporter.progress(self.global_step, "done")
        return record

    def run_epochs(self) -> Optional[Dict[str, Any]]:
        """From the current position to the last epoch, to --max-steps, or to --early-stop."""
        record = None
        while self.position.epoch < self.cfg.epochs and not self._reached_max_steps():
            if self.monitor is not None and self.monitor.stopped(self.position.epoch, self.backend.rank == 0,
                                                               self.cfg.output_dir):
                break
            record = self.train_epoch()
        return record

    def train_epoch(self) -> Dict[str, Any]:
        """One epoch from the current position (sample ``offset`` of its order): steps, metrics across ranks,
        evaluation, checkpoint; the position then stands at the epoch's end (or where --max-steps stopped)."""
        cfg, backend, epoch, offset = self.cfg, self.backend, self.position.epoch, self.position.offset
        self.train_sampler.set_epoch(epoch, offset)
        if hasattr(self.train_set, "set_epoch"):  # per-sample augmentation seeds
            self.train_set.set_epoch(epoch)
        steps = steps_per_epoch(len(self.train_sampler), cfg.batch_size * cfg.accumulate)  # those left after offset
        batches = backend.loader(self.train_set, self.train_sampler, cfg.batch_size, drop_last=True,
                                 num_workers=cfg.num_workers)
        for cb in self.callbacks:
            cb.on_epoch_start(self, epoch, steps)
        sums: Dict[str, Any] = {}
        # A resumed epoch: the sums of its steps before the checkpoint (means over the ranks) count towards its record.
        prior, prior_steps = dict(self.position.train_sums), self.position.train_steps
        done, resumable, lr = 0, True, backend.get_lr()
        start, cpu_start = time.perf_counter(), time.process_time()  # CPU: every thread (loader, Horovod's)
        thread_cpu = ThreadCpu()  # and the same by thread: the training thread, Horovod's, the transport's, ...
        thread_cpu.start()
        self.phases.reset()
        while done < steps and not self._reached_max_steps():
            # With --reseed checkpoint the framework's generator is reseeded only where a run can resume.
            lr, out = self._step(batches, epoch, offset + done * self.global_batch, done,
                                 reseed=cfg.reseed == "step" or done == 0 or resumable)
            resumable = False
            sums = {k: sums.get(k, 0) + v for k, v in out.items()}
            done += 1
            if cfg.log_every and self.global_step % cfg.log_every == 0:
                logged = backend.allreduce_mean({k: v / done for k, v in sums.items()})
                for cb in self.callbacks:
                    cb.on_log(self, self.global_step, logged)
            if done < steps:
                resumable = self.checkpointer.mid_epoch(
                    self._after(epoch, offset, done), self.health,
                    lambda: self._after(epoch, offset, done, backend.allreduce_mean(sums), prior, prior_steps))
            self.phases.end_step()
            self.timeline.after_step(self.global_step)
        train_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        threads = thread_cpu.stop()
        self.health.conclude()  # the stop rule's decision of the epoch's last step
        self.reporter.progress(self.global_step, "metrics")
        counted = prior_steps + done  # the epoch's steps, in this run and before its resume
        means = {k: (prior.get(k, 0.0) + v) / max(counted, 1) for k, v in sums.items()} or {"loss": 0.0}
        # Horovod: the training metrics averaged over ranks, and with them whether any rank saw a non-finite loss
        # since the last checkpoint (its gradients were averaged into every rank's weights).
        train = backend.allreduce_mean({**means, "nonfinite": self.health.flag()})
        healthy = self.health.decide(train.pop("nonfinite"), self.global_step)
        self.reporter.progress(self.global_step, "eval")
        # A stop inside the epoch keeps each rank's own statistics for the checkpoint, from which a resume goes on.
        own_statistics = backend.statistics() if done < steps else None
        backend.average_statistics()  # the model scored here is the one the checkpoint holds, on every rank
        val = self.evaluate()
        timing, slowest = epoch_timing(self.phases, backend, bool(cfg.profile_steps), done, train_seconds,
                                       time.perf_counter() - start, cpu_seconds, threads)
        record = {"epoch": epoch + 1, "train_loss": train["loss"], **val,
                  **metric_objects.throughput(done * self.global_batch / slowest["train_seconds"],
                                              self.sample_unit, self.tokens_per_sample),
                  "epoch_seconds": slowest["epoch_seconds"], "lr": lr, "world_size": backend.size,
                  "framework": backend.name, "global_step": self.global_step, **timing}
        self.position = (Position(epoch + 1, 0, self.global_step) if done == steps else
                         Position(epoch, offset + done * self.global_batch, self.global_step,
                                  {k: v * counted for k, v in train.items()}, counted))
        # Only a complete epoch is judged: one cut short by --max-steps is judged whole by the run that resumes it.
        best = self.monitor.observe(record) if self.monitor is not None and done == steps else False
        # The record first, then the checkpoint, which commits the epoch: a kill between the two resumes from the
        # previous checkpoint, and the record of the epoch trained again replaces this one (metrics.jsonl keeps the
        # records up to the resumed position). The other order lost the record of an epoch whose checkpoint was kept.
        for cb in self.callbacks:
            cb.on_epoch_end(self, record)
        self.checkpointer.epoch_end(self.position, healthy, best, own_statistics)
        if cfg.elastic:  # after the record is written: a membership change restarts from the commit above
            backend.check_membership()
        return record

    def _step(self, batches, epoch: int, at: int, i: int, reseed: bool) -> Tuple[float, Dict[str, Any]]:
        """One training step at sample ``at`` of the epoch's order (step ``i`` of this epoch here), the framework's
        generator reseeded with ``reseed``: (lr, the step's backend-native metrics)."""
        cfg, backend = self.cfg, self.backend
        self.reporter.step = self.global_step  # the heartbeat's phase comes from the timer, as it is entered
        self.timeline.before_step(self.global_step + 1)
        self.phases.begin_step(self.global_step + 1)
        # Every random number of a step derives from (seed, epoch, position, rank), the framework's too (dropout):
        # a run stopped after any step (--max-steps, a kill) and resumed there draws what it would have drawn.
        backend.seed(self._rank_seed(epoch, at), framework=reseed)
        lr = self.lr_at(epoch + at / len(self.train_set))
        backend.set_lr(lr)
        mixing = cfg.mixup > 0 and epoch < cfg.epochs - cfg.mixup_off_epoch
        mix = float(np.random.default_rng([cfg.seed, epoch, at]).beta(cfg.mixup, cfg.mixup)) if mixing else None
        out = backend.train_step(self._next_micro_batches(batches), mix=mix)
        self.phases.enter("other")
        self.position.global_step += 1
        self.health.observe(out["loss"], self.global_step, lr)
        for cb in self.callbacks:
            cb.on_step_end(self, epoch, i, self.global_step, lr)
        return lr, out

    def _after(self, epoch: int, offset: int, done: int, sums: Optional[Dict[str, Any]] = None,
               prior: Optional[Dict[str, float]] = None, prior_steps: int = 0) -> Position:
        """The position after ``done`` steps of an epoch begun at sample ``offset``; with ``sums`` (this run's
        training sums of those steps, averaged over the ranks) added to ``prior`` (the sums before it resumed)."""
        if sums is None:
            return Position(epoch, offset + done * self.global_batch, self.global_step)
        total = {k: (prior or {}).get(k, 0.0) + self.backend.scalar(v) for k, v in sums.items()}
        return Position(epoch, offset + done * self.global_batch, self.global_step, total, prior_steps + done)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken, over the whole run (resumes included)."""
        return self.position.global_step

    def restore_position(self, position: Dict[str, int]) -> None:
        """Elastic mode, after a reset: continue from a committed position with the new world size."""
        self.position = Position.from_dict(position)
        self.health.pending = None  # started before the reset, in a world that is gone
        b = self.backend
        self.train_sampler.rank, self.train_sampler.size = b.rank, b.size
        if self.val_sampler is not None:
            self.val_sampler.rank, self.val_sampler.size = b.rank, b.size
        self.reporter.rank = b.rank
        self._plan()
        if b.rank == 0 and not self.callbacks:  # rank 0 was lost (Horovod numbers hosts in no set order): this
            self.callbacks = wiring.callbacks(self)  # rank writes the records from the commit on, as rank 0 did
            for cb in self.callbacks:
                cb.on_train_start(self, self.position.epoch)

    def evaluation(self) -> Tuple[Dict[str, Optional[float]], int]:
        """The recipe's loss and :meth:`metrics` on the validation set, and the samples they cover
        (:class:`hvdtrain.evaluation.Evaluator`; every rank takes part)."""
        return self.evaluator.run()

    def evaluate(self) -> Dict[str, Optional[float]]:
        """The validation metrics of :meth:`evaluation` (every rank takes part)."""
        return self.evaluation()[0]

    def lr_at(self, epoch: float) -> float:
        """The learning rate at a fractional epoch: --base-lr scaled by the workers and --accumulate, linear warmup,
        then --lr-mode's decay (:func:`hvdtrain.schedule.learning_rate`)."""
        cfg = self.cfg
        return schedule.learning_rate(
            epoch, base_lr=cfg.base_lr, world_size=self.backend.lr_workers(cfg), accumulate=cfg.accumulate,
            warmup_epochs=cfg.warmup_epochs, total_epochs=cfg.epochs, mode=cfg.lr_mode,
            milestones=cfg.lr_milestones, decay=cfg.lr_decay, power=cfg.lr_power, end=cfg.lr_end)

    # --- the model outside training: eval and export (hvdtrain.model_io) -------------------------------------------
    def run_eval(self) -> Dict[str, Any]:
        """``python -m hvdtrain eval``: :func:`hvdtrain.model_io.run_eval`."""
        return model_io.run_eval(self)

    def export(self, source: str, fmt: str, directory: str) -> Dict[str, Any]:
        """``python -m hvdtrain export``: :func:`hvdtrain.model_io.export`."""
        return model_io.export(self, source, fmt, directory)

    # --- helpers ----------------------------------------------------------------------------------------------------
    def framework_hook(self, prefix: str, framework: str):
        """The recipe's ``PREFIX_FRAMEWORK`` method (``build_torch``...); a ConfigError naming it when missing."""
        hook = getattr(self, f"{prefix}_{framework}", None)
        if hook is None:
            raise ConfigError(f"recipe {self.name} has no {prefix}_{framework}(); "
                              f"it does not support --framework {framework}")
        return hook

    def datasets_for(self, framework: str, world_size: int = 1):
        """(train, val) for ``framework``: --synthetic data, the recipe's datasets_FRAMEWORK, or its datasets."""
        return wiring.datasets_for(self, framework, world_size)

    def _next_micro_batches(self, batches) -> list:
        try:
            return [next(batches) for _ in range(self.cfg.accumulate)]
        except StopIteration:
            raise RuntimeError("the data loader ran out of batches before the end of the epoch; every rank must "
                               "run the same number of steps") from None

    def _reached_max_steps(self) -> bool:
        return bool(self.cfg.max_steps) and self.global_step >= self.cfg.max_steps

    def _rank_seed(self, epoch: int, position: int) -> int:
        """A seed per (seed, epoch, position in the epoch, rank): a resume at any step replays the same numbers."""
        mixed = np.random.SeedSequence([self.cfg.seed, epoch, position, self.backend.rank]).generate_state(1)[0]
        return int(mixed) % (2 ** 31 - 1)
