"""The training loop. It knows no framework: everything framework- or Horovod-specific is behind ``self.backend``.

A recipe (or a user) subclasses :class:`Trainer` and provides data and a model per framework::

    class MyTrainer(Trainer):
        name = "mine"
        def datasets(self):            # framework-free (numpy) data, or datasets_torch / datasets_mxnet
            return ArrayDataset(x_train, y_train), ArrayDataset(x_val, y_val)
        def build_torch(self):         # one builder per framework the recipe supports
            return torch.nn.Sequential(...)

and runs it with ``MyTrainer(MyConfig(...)).fit()`` under ``horovodrun`` (or ``python -m hvdtrain recipe mod:MyTrainer``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import checkpoint, guard, schedule, weights
from .backends import make_backend
from .callbacks import Callback, MetricsFile, ProgressLogger, TensorBoard
from .config import ConfigError, TrainConfig
from .data import ShardSampler, Synthetic, steps_per_epoch
from .faults import JobFailed, RankReporter, explain_failure, is_collective_failure, mark_reported
from .phases import PHASES, summarize
from .report import autotune_best, format_autotune


class Trainer:
    """Data-parallel training with Horovod on the framework chosen by ``cfg.framework``."""

    name: str = "custom"
    """Recipe name: the default output directory is runs/NAME-FRAMEWORK."""
    config_class = TrainConfig
    report_top5: bool = False
    """Report top-5 accuracy (val_top5) in each epoch's record."""
    input_shape: Tuple[int, ...] = ()
    """Shape of one sample, for --synthetic."""
    num_classes: int = 0
    """Number of classes, for --synthetic."""

    def __init__(self, cfg: Optional[TrainConfig] = None, callbacks: Optional[List[Callback]] = None, **overrides):
        cfg = cfg if cfg is not None else self.config_class()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        if not cfg.output_dir:
            cfg = dataclasses.replace(cfg, output_dir=os.path.join("runs", f"{self.name}-{cfg.framework}"))
        cfg.validate()
        self.cfg = cfg
        self.extra_callbacks = list(callbacks or [])
        self.backend = None
        self.reporter = None
        self.global_step = 0

    # --- what a recipe provides -------------------------------------------------------------------------------------
    def check(self) -> None:
        """Check inputs (data paths, flag combinations) before Horovod starts; raise ConfigError naming the fix."""
        if getattr(self, f"build_{self.cfg.framework}", None) is None:
            raise ConfigError(f"recipe {self.name} has no {self.cfg.framework} model; "
                              f"choose another --framework")

    def datasets(self) -> Tuple[Any, Any]:
        """(train, val) datasets for every framework; override, or provide datasets_torch / datasets_mxnet.

        Optional per-framework hooks: build_torch / build_mxnet (required, the model) and loss_torch / loss_mxnet
        (a loss taking (logits, labels); default softmax cross-entropy).
        """
        raise ConfigError(f"recipe {self.name} provides no datasets")

    # --- the loop ---------------------------------------------------------------------------------------------------
    def fit(self) -> Optional[Dict[str, Any]]:
        """Set up and train ``cfg.epochs`` epochs (resuming per ``cfg.resume``); returns the last epoch's record.

        A failure on this rank is written to OUTPUT_DIR/errors/rank-N.txt and named in one line on stderr, and
        Horovod is shut down in order before the exception propagates. When this rank stopped only because the job's
        collectives broke, :class:`~hvdtrain.faults.JobFailed` is raised instead, naming the rank that failed first
        and its error (read from the other ranks' error files and heartbeats).
        """
        return self._guarded(lambda: (self.setup(), self.train())[1])

    def _guarded(self, work):
        """Run ``work`` with fit()'s failure handling (see there)."""
        try:
            return work()
        except BaseException as e:
            failure = self._failed(e)
            if failure is not None:
                raise failure from e
            raise
        finally:
            if self.reporter is not None:
                self.reporter.stop()
            if getattr(self, "_output_lock", None) is not None:
                self._output_lock.close()  # releases the flock: the directory is free for the next job

    def _failed(self, e: BaseException) -> Optional[BaseException]:
        """Record and report a failure of fit() (see there); returns the exception to raise instead, if any."""
        try:
            if self.reporter is None or isinstance(e, (ConfigError, checkpoint.CheckpointError, KeyboardInterrupt)):
                return None  # a one-line user error (the same on every rank), or an interrupt: nothing to explain
            path = self.reporter.record_error(e)
            rank = self.reporter.rank
            if not is_collective_failure(e):
                mark_reported(e, rank, f"{type(e).__name__}: {e}".splitlines()[0][:300] + f" (traceback: {path})")
                return None
            # Horovod's own message ("Horovod has been shut down", a Gloo timeout) hides the cause: name it instead.
            why = explain_failure(self.cfg.output_dir, rank)
            failure = JobFailed(f"stopped because the job's collectives failed ({str(e).splitlines()[0][:160]}); "
                                + (why if why else "the cause is on another rank: see its output above")
                                + f"; this rank's traceback: {path}")
            mark_reported(failure, rank, str(failure))
            return failure
        finally:
            # Horovod: stop in order (MXNet's queued ops first) rather than at interpreter exit; the other ranks then
            # see the shutdown at once instead of waiting for a timeout.
            if self.backend is not None:
                self.backend.shutdown(failed=True)

    def setup(self, restore: bool = True) -> None:
        """Start Horovod, build data and model, broadcast rank 0's state, and resume from a checkpoint if any (with
        ``restore``), else start from --init-from's weights if given."""
        cfg = self.cfg
        self.check()
        backend = self.backend = make_backend(cfg.framework)
        backend.init(cfg)
        # From here on the configuration says the precision the run computes in (--precision auto resolved).
        self.precision_requested = cfg.precision
        self.cfg = cfg = dataclasses.replace(cfg, precision=backend.precision)
        # Before anything is written: a world the launcher did not start, or an output directory a live job holds.
        if not cfg.elastic:  # elastic worlds change size by design
            guard.check_world_size(backend.size, backend.mpi_built())
        self._output_lock = self._take_output_dir()
        self.reporter = RankReporter(cfg.output_dir, backend.rank)
        if backend.rank == 0:  # SIGUSR1 / a stall (half of --stall-timeout): a table of every rank's progress
            self.reporter.watch(stall_after=max(1, cfg.stall_timeout // 2))
            self._forget_departed_ranks(backend.size)
        self.reporter.start()
        # Per-phase step times; the backend marks its phases on the same timer, which tells the heartbeat too.
        self.phases = backend.phases.configure(cfg.profile_steps, self.reporter.enter)
        self._timeline = "off"
        backend.seed(cfg.seed)  # the same initial weights everywhere, before rank 0's are broadcast anyway
        self.train_set, self.val_set = self._datasets()
        backend.check_data(self.train_set, cfg)
        loss = getattr(self, f"loss_{backend.name}", None)
        backend.setup(self._framework_hook("build")(), cfg, loss_fn=loss() if loss else None,
                      sample_shape=self._sample_shape(self.train_set))
        self.train_sampler = ShardSampler(len(self.train_set), backend.rank, backend.size, seed=cfg.seed)
        self.val_sampler = (ShardSampler(len(self.val_set), backend.rank, backend.size, shuffle=False, pad=False)
                            if self.val_set is not None else None)
        self.steps = steps_per_epoch(len(self.train_sampler), cfg.batch_size * cfg.accumulate)
        if self.steps == 0:
            raise ConfigError(f"each of the {backend.size} ranks gets {len(self.train_sampler)} training samples, "
                              f"fewer than --batch-size x --accumulate = {cfg.batch_size * cfg.accumulate}; "
                              f"lower --batch-size or run fewer ranks")
        self.start_epoch, self.global_step, self.resume_offset = self._restore() if restore else (0, 0, 0)
        if cfg.init_from and (self.start_epoch, self.global_step, self.resume_offset) == (0, 0, 0):
            self._init_from(evaluating=not restore)

    def _take_output_dir(self):
        """Rank 0 locks --output-dir for this job (:func:`guard.lock_output_dir`); every rank stops on a refusal."""
        backend, refusal, handle = self.backend, None, None
        if backend.rank == 0:
            try:
                handle = guard.lock_output_dir(self.cfg.output_dir)
            except ConfigError as e:
                refusal = str(e)
        if not self.cfg.elastic:  # a worker joining an elastic job must run no collective the others do not
            refusal = backend.broadcast_object(refusal)
        if refusal:
            raise ConfigError(refusal)
        return handle

    def train(self) -> Optional[Dict[str, Any]]:
        """The epochs after :meth:`setup`: steps, per-rank-averaged metrics, evaluation, checkpoints, callbacks."""
        cfg, is_root = self.cfg, self.backend.rank == 0
        self.callbacks = self._callbacks() if is_root else []
        if is_root:
            self._announce(self.steps)
        for cb in self.callbacks:
            cb.on_train_start(self, self.start_epoch)
        if is_root and self.start_epoch >= cfg.epochs:
            print(f"hvdtrain: the checkpoint already covers all {cfg.epochs} epochs; nothing to train "
                  f"(raise --epochs, or pass --resume never to start over)", flush=True)
        record = self.backend.run_elastic(self) if cfg.elastic else self.run_epochs()
        self._timeline_window(after_step=True, end=True)
        if cfg.autotune and is_root:
            best = autotune_best(os.path.join(cfg.output_dir, "autotune.csv"))
            print(f"hvdtrain: autotune: {format_autotune(best)}; log in {cfg.output_dir}/autotune.csv", flush=True)
        for cb in self.callbacks:
            cb.on_train_end(self, record)
        self.reporter.progress(self.global_step, "done")
        return record

    def run_epochs(self) -> Optional[Dict[str, Any]]:
        """From the current position (start_epoch, resume_offset) to the last epoch, or to --max-steps."""
        record = None
        for epoch in range(self.start_epoch, self.cfg.epochs):
            offset = self.resume_offset if epoch == self.start_epoch else 0  # > 0: resumed mid-epoch
            record = self.train_epoch(epoch, offset)
            if self._reached_max_steps():
                break
        return record

    def train_epoch(self, epoch: int, offset: int = 0) -> Dict[str, Any]:
        """One epoch from sample ``offset`` of its order: steps, metrics across ranks, evaluation, checkpoint."""
        cfg, backend, train_set = self.cfg, self.backend, self.train_set
        is_root = backend.rank == 0
        self.train_sampler.set_epoch(epoch, offset)
        if hasattr(train_set, "set_epoch"):  # per-sample augmentation seeds
            train_set.set_epoch(epoch)
        global_batch = cfg.batch_size * cfg.accumulate * backend.size
        steps = steps_per_epoch(len(self.train_sampler), cfg.batch_size * cfg.accumulate)
        mixing = cfg.mixup > 0 and epoch < cfg.epochs - cfg.mixup_off_epoch
        batches = backend.loader(train_set, self.train_sampler, cfg.batch_size, drop_last=True,
                                 num_workers=cfg.num_workers)
        for cb in self.callbacks:
            cb.on_epoch_start(self, epoch, steps)
        sums: Dict[str, Any] = {}
        done, start, bad, lr, resumable = 0, time.perf_counter(), 0, backend.get_lr(), True
        cpu_start = time.process_time()  # every thread of this process: loader, framework, Horovod's background loop
        self.phases.reset()
        for i in range(steps):
            position = offset + i * global_batch  # samples of this epoch consumed before this step
            self.reporter.step = self.global_step  # the heartbeat's phase comes from the timer, as it is entered
            self._timeline_window(after_step=False)
            self.phases.begin_step(self.global_step + 1)
            # Every random number of a step derives from (seed, epoch, position, rank), the framework's too (dropout):
            # a run stopped after any step (--max-steps, a kill) and resumed there draws what it would have drawn.
            # With --reseed checkpoint the framework's generator is reseeded only where a run can resume.
            backend.seed(self._rank_seed(epoch, position), framework=cfg.reseed == "step" or i == 0 or resumable)
            resumable = False
            lr = self.lr_at(epoch + position / len(train_set))
            backend.set_lr(lr)
            mix = float(np.random.default_rng([cfg.seed, epoch, position]).beta(cfg.mixup, cfg.mixup)) \
                if mixing else None
            out = backend.train_step(self._next_micro_batches(batches), mix=mix)
            self.phases.enter("other")
            sums = {k: sums.get(k, 0) + v for k, v in out.items()}
            done += 1
            self.global_step += 1
            bad = self._check_finite(out["loss"], bad)
            for cb in self.callbacks:
                cb.on_step_end(self, epoch, i, self.global_step, lr)
            if cfg.log_every and self.global_step % cfg.log_every == 0:
                logged = backend.allreduce_mean({k: v / done for k, v in sums.items()})
                for cb in self.callbacks:
                    cb.on_log(self, self.global_step, logged)
            if i + 1 < steps:
                resumable = self._mid_epoch_save(epoch, position + global_batch)
            self.phases.end_step()
            self._timeline_window(after_step=True)
            if self._reached_max_steps():
                break
        train_seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        self.reporter.progress(self.global_step, "metrics")
        means = {k: v / max(done, 1) for k, v in sums.items()} or {"loss": 0.0}
        # Horovod: the training metrics averaged over ranks, and with them whether any rank saw a non-finite loss
        # since the last checkpoint (its gradients were averaged into every rank's weights).
        train = backend.allreduce_mean({**means, "nonfinite": float(self._nonfinite_seen)})
        healthy = self._decided_healthy(train.pop("nonfinite") == 0)
        self.reporter.progress(self.global_step, "eval")
        backend.average_statistics()  # the model scored here is the one the checkpoint holds, on every rank
        val = self.evaluate()
        timing, slowest = self._timing(train_seconds, done, time.perf_counter() - start, cpu_seconds)
        record = {"epoch": epoch + 1, "train_loss": train["loss"], **val,
                  "images_per_sec": done * global_batch / slowest["train_seconds"],
                  "epoch_seconds": slowest["epoch_seconds"], "lr": lr, "world_size": backend.size,
                  "framework": backend.name, "global_step": self.global_step, **timing}
        if healthy:  # never a checkpoint of weights that a non-finite loss may have reached
            backend.gather_state()  # Horovod: state the ranks hold in parts (--shard-optimizer), whole on rank 0
        if is_root and healthy:
            if done == steps:
                self.save_checkpoint(epoch + 1)
            else:  # --max-steps ended the epoch early
                self.save_checkpoint(epoch, offset + done * global_batch)
        self.commit(epoch + 1 if done == steps else epoch, 0 if done == steps else offset + done * global_batch,
                    check=False)
        for cb in self.callbacks:
            cb.on_epoch_end(self, record)
        if cfg.elastic:  # after the record is written: a membership change restarts from the commit above
            self.backend.check_membership()
        return record

    def _mid_epoch_save(self, epoch: int, offset: int) -> bool:
        """Commit (elastic) and checkpoint where due; True when a run may resume at ``offset``."""
        cfg = self.cfg
        resumable = False
        if cfg.elastic and cfg.commit_every and self.global_step % cfg.commit_every == 0:
            self.commit(epoch, offset)
            resumable = True
        if cfg.checkpoint_every_steps and self.global_step % cfg.checkpoint_every_steps == 0:
            resumable = True
            # Horovod: every rank takes part in the decision, rank 0 writes.
            if self._healthy_everywhere():
                self.backend.gather_state()
                if self.backend.rank == 0:
                    self.save_checkpoint(epoch, offset)
        return resumable

    def commit(self, epoch: int, offset: int, check: bool = True) -> None:
        """Elastic mode: remember this position (and the backend's model and optimizer) as the point to roll back
        to when a worker leaves or joins; with ``check``, then restart there at once if workers were added."""
        if self.cfg.elastic:
            self.backend.commit({"epoch": epoch, "offset": offset, "global_step": self.global_step})
            if check:
                self.backend.check_membership()

    def restore_position(self, position: Dict[str, int]) -> None:
        """Elastic mode, after a reset: continue from a committed position with the new world size."""
        self.start_epoch, self.resume_offset = int(position["epoch"]), int(position["offset"])
        self.global_step = int(position["global_step"])
        b = self.backend
        self.train_sampler.rank, self.train_sampler.size = b.rank, b.size
        if self.val_sampler is not None:
            self.val_sampler.rank, self.val_sampler.size = b.rank, b.size
        self.reporter.rank = b.rank

    def _timing(self, train_seconds: float, steps: int, epoch_seconds: float,
                cpu_seconds: float) -> Tuple[Dict[str, Any], Dict[str, float]]:
        """This epoch's per-phase step times: every rank's means, its training time, its time for the whole epoch
        and its process's CPU time while training gathered in one collective; the phases averaged, with the slowest
        rank of each (see :mod:`hvdtrain.phases`), every rank's CPU seconds per step, and the slowest rank's training
        and epoch time, which is the job's."""
        local = self.phases.local_means()
        rows = self.backend.allgather_floats([local[p] for p in PHASES] + [train_seconds, epoch_seconds, cpu_seconds])
        clock = "synchronized" if self.cfg.profile_steps else "launch" if self.backend.asynchronous else "host"
        n = len(PHASES)
        timing = summarize([dict(zip(PHASES, row)) for row in rows], clock, [row[n] / max(steps, 1) for row in rows])
        timing["cpu_seconds_per_step"] = [round(row[n + 2] / max(steps, 1), 6) for row in rows]  # by rank
        return timing, {"train_seconds": max(row[n] for row in rows), "epoch_seconds": max(row[n + 1] for row in rows)}

    def _timeline_window(self, after_step: bool, end: bool = False) -> None:
        """--timeline-steps A:B: start Horovod's timeline before global step A, stop it after step B (or at the
        end)."""
        window = self.cfg.timeline_window()
        if window is None:
            return
        a, b = window
        if self._timeline == "off" and not after_step and a <= self.global_step + 1 <= b:
            path = self.cfg.timeline_file or os.path.join(self.cfg.output_dir, "timeline.json")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.backend.start_timeline(path)
            self._timeline = path
        elif self._timeline not in ("off", "done") and after_step and (self.global_step >= b or end):
            self.backend.stop_timeline()
            if self.backend.rank == 0:
                print(f"hvdtrain: Horovod timeline of steps {a}..{min(b, self.global_step)} written to "
                      f"{self._timeline} (open it in chrome://tracing or ui.perfetto.dev)", flush=True)
            self._timeline = "done"

    def _forget_departed_ranks(self, size: int) -> None:
        """Heartbeats of ranks that an earlier, larger run in this output directory left behind."""
        beat_dir = os.path.join(self.cfg.output_dir, "heartbeats")
        for name in os.listdir(beat_dir) if os.path.isdir(beat_dir) else []:
            stem = name[len("rank-"):-len(".json")] if name.startswith("rank-") and name.endswith(".json") else ""
            if stem.isdigit() and int(stem) >= size:
                os.unlink(os.path.join(beat_dir, name))

    def evaluate(self) -> Dict[str, Optional[float]]:
        """Loss and accuracy on the validation set: each rank a disjoint shard, sums allreduced once."""
        val_set, val_sampler = self.val_set, self.val_sampler
        if val_set is None:
            return {"val_loss": None, "val_accuracy": None}
        sums: Dict[str, Any] = {"loss_sum": 0.0, "correct": 0.0, "correct5": 0.0, "count": 0.0}
        batch_size = self.cfg.eval_batch_size or 2 * self.cfg.batch_size
        for batch in self.backend.loader(val_set, val_sampler, batch_size, drop_last=False,
                                         num_workers=self.cfg.num_workers):
            for k, v in self.backend.eval_step(batch).items():
                sums[k] = sums[k] + v
        total = self.backend.allreduce_sum(sums)
        self.eval_count = int(total["count"])  # every validation sample once, over all ranks
        count = max(total["count"], 1.0)
        out = {"val_loss": total["loss_sum"] / count, "val_accuracy": total["correct"] / count}
        if self.report_top5:
            out["val_top5"] = total["correct5"] / count
        return out

    def lr_at(self, epoch: float) -> float:
        cfg = self.cfg
        return schedule.learning_rate(
            epoch, base_lr=cfg.base_lr, world_size=self.backend.lr_workers(cfg), accumulate=cfg.accumulate,
            warmup_epochs=cfg.warmup_epochs, total_epochs=cfg.epochs, mode=cfg.lr_mode,
            milestones=cfg.lr_milestones, decay=cfg.lr_decay, power=cfg.lr_power)

    # --- checkpoints ------------------------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.cfg.output_dir, "checkpoints")

    def save_checkpoint(self, epoch: int, offset: int = 0) -> str:
        """Rank 0: write a checkpoint atomically and keep the newest K. ``epoch`` epochs are complete, plus the
        first ``offset`` samples of the next one's order. Returns its path ("" when the weights are not finite and
        nothing was written)."""
        self.reporter.progress(self.global_step, "checkpoint")
        state = {"trainer": {"epoch": epoch, "offset": offset, "global_step": self.global_step,
                             "recipe": self.name,
                             "framework": self.backend.name, "world_size": self.backend.size,
                             "config": json.loads(self.cfg.to_json())},
                 "backend": self.backend.state_dict()}
        bad = [name for name, value in state["backend"]["model"].items()
               if np.issubdtype(np.asarray(value).dtype, np.floating) and not np.isfinite(value).all()]
        if bad:  # a NaN gradient that left the loss finite: the weights are gone, the last checkpoint is kept
            print(f"hvdtrain: warning: not writing a checkpoint at step {self.global_step}: parameter {bad[0]} (and "
                  f"{len(bad) - 1} more) holds NaN or infinite values", file=sys.stderr, flush=True)
            return ""
        path = checkpoint.save(self.checkpoint_dir, epoch, self.global_step, state)
        checkpoint.prune(self.checkpoint_dir, self.cfg.keep_checkpoints)
        return path

    def _restore(self) -> Tuple[int, int, int]:
        """Rank 0 picks and loads the checkpoint; every rank learns the outcome, then receives rank 0's state."""
        info = self._load_on_root() if self.backend.rank == 0 else None
        if self.cfg.elastic:
            # Elastic: no collective here (a worker joining a running job would wait for partners that never
            # come); the elastic driver's sync broadcasts rank 0's state and position instead.
            if info is not None and "error" in info:
                raise checkpoint.CheckpointError(info["error"])
            return (info["epoch"], info["global_step"], info["offset"]) if info else (0, 0, 0)
        # Horovod: every rank takes the same decision (resume or not, and from where), or fails the same way.
        info = self.backend.broadcast_object(info)
        if info is None:
            return 0, 0, 0
        if "error" in info:
            raise checkpoint.CheckpointError(info["error"])
        # Horovod: model and optimizer state from rank 0, which loaded the checkpoint.
        self.backend.broadcast_state()
        return info["epoch"], info["global_step"], info["offset"]

    def _set_aside_previous_run(self) -> None:
        """--resume never in a directory that holds an earlier run: move its checkpoints and metrics to
        previous-TIMESTAMP/ rather than overwrite or prune them (they may be newer by name than this run's)."""
        old = [p for p in (self.checkpoint_dir, os.path.join(self.cfg.output_dir, "metrics.jsonl"))
               if os.path.exists(p)]
        if not checkpoint.list_checkpoints(self.checkpoint_dir) or not old:
            return
        target = os.path.join(self.cfg.output_dir, time.strftime("previous-%Y%m%d-%H%M%S"))
        os.makedirs(target, exist_ok=True)
        for path in old:
            os.replace(path, os.path.join(target, os.path.basename(path)))
        print(f"hvdtrain: --resume never: the earlier run's checkpoints and metrics were moved to {target}",
              file=sys.stderr)

    def _load_on_root(self) -> Optional[Dict[str, Any]]:
        cfg = self.cfg
        removed = checkpoint.clean_temporaries(self.checkpoint_dir)
        if removed:
            print(f"hvdtrain: removed {len(removed)} temporary file(s) left by an interrupted checkpoint write",
                  file=sys.stderr)
        if cfg.resume == "never":
            self._set_aside_previous_run()
            return None
        path = (checkpoint.latest_valid(self.checkpoint_dir, warn=lambda m: print(f"hvdtrain: warning: {m}",
                                                                                 file=sys.stderr))
                if cfg.resume == "auto" else cfg.resume)
        if path is None:
            return None
        try:
            state = checkpoint.load(path)
            meta = state["trainer"]
            if meta["framework"] != self.backend.name or meta["recipe"] != self.name:
                raise checkpoint.CheckpointError(
                    f"{path} was written by recipe {meta['recipe']} on {meta['framework']}, not {self.name} on "
                    f"{self.backend.name}; pass --resume never or another --output-dir")
            self.backend.load_state_dict(state["backend"])
        except (checkpoint.CheckpointError, KeyError, TypeError, ValueError, RuntimeError) as e:
            return {"error": f"cannot resume from {path}: {e}"}
        print(f"hvdtrain: resuming from {path} (epoch {meta['epoch']}, step {meta['global_step']})", file=sys.stderr)
        return {"epoch": int(meta["epoch"]), "global_step": int(meta["global_step"]),
                "offset": int(meta.get("offset", 0)), "path": path}

    # --- weights in and out: --init-from, eval, export ----------------------------------------------------------------
    def preprocessing(self) -> Dict[str, Any]:
        """How raw inputs become the model's input, for exported models (a recipe describes its own)."""
        return {}

    def _init_from(self, evaluating: bool = False) -> None:
        """--init-from: rank 0 reads the weights and fits them to the model (renamed from the other framework where
        needed); every rank then takes rank 0's model. Elastic runs, which must not add collectives, read on every
        rank. Optimizer state stays fresh."""
        b, path = self.backend, self.cfg.init_from
        info = None
        if b.rank == 0 or self.cfg.elastic:
            try:
                arrays, source = weights.read(path)
                fitted, kept = weights.fit(b.model_arrays(), arrays, path, to=b.weight_naming)
                if kept and evaluating:
                    raise weights.WeightsError(f"{path} has another class count than the model ({', '.join(kept)}): "
                                               f"evaluating it would score an untrained classifier; pass the "
                                               f"recipe's --num-classes for these weights")
                b.assign_model_arrays(fitted)
                info = {"kept": kept, "count": len(fitted), "framework": source.get("framework") or "unknown"}
            except weights.WeightsError as e:
                info = {"error": f"--init-from: {e}"}
        if not self.cfg.elastic:
            info = b.broadcast_object(info)  # Horovod: every rank succeeds or fails alike
        if "error" in info:
            raise ConfigError(info["error"])
        if not self.cfg.elastic:
            # Horovod: rank 0's weights (and its fresh optimizer state) on every rank.
            b.broadcast_state()
        if b.rank == 0:
            kept = info["kept"]
            print(f"hvdtrain: initialised from {path} ({info['framework']} weights, {info['count'] - len(kept)} of "
                  f"{info['count']} arrays)" + (f"; the classifier ({', '.join(kept)}) has another class count "
                                                f"there and starts fresh" if kept else ""), flush=True)

    def run_eval(self) -> Dict[str, Any]:
        """Evaluate --init-from's weights on the validation set under Horovod (each sample once over all ranks), with
        fit()'s failure handling; rank 0 prints the figures and writes OUTPUT_DIR/eval.json."""
        def work():
            self.setup(restore=False)
            out = {**self.evaluate(), "count": self.eval_count, "world_size": self.backend.size,
                   "framework": self.backend.name, "source": self.cfg.init_from, "precision": self.cfg.precision}
            if self.backend.rank == 0:
                with open(os.path.join(self.cfg.output_dir, "eval.json"), "w") as f:
                    json.dump(out, f, indent=2)
                top5 = f", val_top5 {100 * out['val_top5']:.2f}%" if out.get("val_top5") is not None else ""
                print(f"hvdtrain: eval: val_loss {out['val_loss']:.6f}, val_accuracy {100 * out['val_accuracy']:.2f}%"
                      f"{top5} over {out['count']} samples on {out['world_size']} worker(s); "
                      f"{self.cfg.output_dir}/eval.json", flush=True)
            return out
        return self._guarded(work)

    def sample_inputs(self, n: int = 8) -> Tuple[np.ndarray, str]:
        """Up to ``n`` validation inputs (float32, the model's preprocessing applied) and where they came from; a
        seeded normal batch where the recipe's data is not at hand."""
        try:
            _, val = self._datasets()
            if val is not None and len(val):
                xs = [np.asarray(val[i][0], np.float32) for i in range(min(n, len(val)))]
                return np.stack(xs), f"{len(xs)} validation samples"
        except (ConfigError, OSError) as e:
            why = str(e)
        else:
            why = "no validation set"
        shape = self.input_shape or ()
        return (np.random.default_rng(0).standard_normal((n,) + tuple(shape)).astype(np.float32),
                f"{n} random inputs ({why})")

    def _offline_model(self, backend, arrays: Dict[str, np.ndarray], source: str):
        """The recipe's model on ``backend`` (not initialised: no Horovod), holding ``arrays``."""
        self.backend = backend
        model = backend.prepare_model(self._framework_hook("build")(), self.input_shape)
        fitted, kept = weights.fit(backend.model_arrays(model), arrays, source, to=backend.weight_naming)
        if kept:
            raise weights.WeightsError(f"{source} has another class count than the model ({', '.join(kept)}); "
                                       f"pass --num-classes")
        backend.assign_model_arrays(fitted, model)
        return model

    def export(self, source: str, fmt: str, directory: str) -> Dict[str, Any]:
        """Write the weights in ``source`` as the recipe's model on --framework, in that framework's own formats
        (``native``) or as ONNX (through a framework that exports it), plus model.json (recipe, classes, input,
        preprocessing) and sample.npz (inputs and the logits of the source model, in the framework that wrote it).
        No Horovod. Returns model.json's content, with the largest difference between the source's logits and the
        exported model's (``max_abs_diff``)."""
        from .backends import BACKENDS, backend_class
        arrays, info = weights.read(source)
        target = backend_class(self.cfg.framework)()
        if fmt == "onnx" and not target.exports_onnx:
            able = [n for n in BACKENDS if getattr(self, f"build_{n}", None) and _exports_onnx(n)]
            if not able:
                raise ConfigError(f"recipe {self.name} has no model on a framework that exports ONNX")
            target = backend_class(able[0])()
        model = self._offline_model(target, arrays, source)
        x, what = self.sample_inputs()
        logits = target.predict(model, x)
        reference, ref_framework = logits, target.name
        if info.get("framework") in BACKENDS and info["framework"] != target.name:
            ref_backend = backend_class(info["framework"])()
            reference = ref_backend.predict(self._offline_model(ref_backend, arrays, source), x)
            ref_framework = ref_backend.name
            self.backend = target
        os.makedirs(directory, exist_ok=True)
        if fmt == "onnx":
            target.export_onnx(model, os.path.join(directory, "model.onnx"), self.input_shape)
            files = {"onnx": "model.onnx"}
            logits = _onnxruntime_logits(os.path.join(directory, "model.onnx"), x)
        else:
            files = target.export_native(model, directory, self.input_shape)
        np.savez(os.path.join(directory, "sample.npz"), inputs=x, logits=reference)
        head = [np.shape(arrays[n])[0] for n in weights.classifier(arrays) if len(np.shape(arrays[n])) == 2]
        meta = {"format": "hvdtrain-export", "kind": fmt, "framework": target.name if fmt == "native" else "onnx",
                "recipe": self.name, "model": getattr(self.cfg, "model", None),
                "num_classes": head[0] if head else None, "input_shape": list(self.input_shape),
                "input": "float32 N x " + " x ".join(map(str, self.input_shape)) + ", preprocessed as below",
                "output": "logits (unnormalised class scores)", "preprocessing": self.preprocessing(),
                **files, "source": info.get("path", source), "source_framework": info.get("framework"),
                "epoch": info.get("epoch"), "config": json.loads(self.cfg.to_json()),
                "sample": {"file": "sample.npz", "inputs": what, "logits_from": ref_framework},
                "max_abs_diff": float(np.abs(logits - reference).max()),
                "logit_scale": float(np.abs(reference).max())}
        with open(os.path.join(directory, "model.json"), "w") as f:
            json.dump(meta, f, indent=2)
        return meta

    # --- helpers ----------------------------------------------------------------------------------------------------
    def _framework_hook(self, prefix: str):
        hook = getattr(self, f"{prefix}_{self.backend.name}", None)
        if hook is None:
            raise ConfigError(f"recipe {self.name} has no {prefix}_{self.backend.name}(); "
                              f"it does not support --framework {self.backend.name}")
        return hook

    def _datasets(self):
        if self.cfg.synthetic:
            if not self.input_shape or not self.num_classes:
                raise ConfigError(f"recipe {self.name} does not support --synthetic (no input_shape/num_classes)")
            # 64 steps per epoch, or --max-steps in one epoch: a benchmark's steps are all in one timed epoch.
            steps = max(64, self.cfg.max_steps)
            n = self.cfg.batch_size * self.cfg.accumulate * self.backend.size * steps
            return Synthetic(n, self.input_shape, self.num_classes), None
        hook = getattr(self, f"datasets_{self.backend.name}", None) or self.datasets
        return hook()

    @staticmethod
    def _sample_shape(dataset) -> Tuple[int, ...]:
        """Shape of one input sample (frameworks with deferred initialisation need it before the broadcast)."""
        if isinstance(dataset, Synthetic):
            return dataset.shape
        sample = dataset[0][0]
        return tuple(getattr(sample, "shape", ()))

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

    FINITE_CHECK_EVERY = 10
    """Steps between the collective decisions of the non-finite-loss guard (a collective per step cost ~15%)."""

    _nonfinite_seen = False
    """This rank saw a non-finite training loss since the last checkpoint decision."""

    def _healthy_everywhere(self) -> bool:
        """Horovod: whether no rank has seen a non-finite loss since the last decision (one scalar allreduce, on
        every rank); the same answer everywhere."""
        total = self.backend.allreduce_sum({"nonfinite": float(self._nonfinite_seen)})["nonfinite"]
        return self._decided_healthy(total == 0)

    def _decided_healthy(self, healthy: bool) -> bool:
        if not healthy and self.backend.rank == 0:
            print(f"hvdtrain: warning: a rank saw a non-finite training loss before step {self.global_step}: no "
                  f"checkpoint is written from these weights", file=sys.stderr, flush=True)
        self._nonfinite_seen = False
        return healthy

    def _check_finite(self, loss, bad: int) -> int:
        """Count this rank's consecutive non-finite losses; every FINITE_CHECK_EVERY steps all ranks decide together
        (one tiny allreduce) and the job stops once any rank has seen --max-bad-steps in a row."""
        finite = math.isfinite(self.backend.scalar(loss))
        # Only what reached the weights bars checkpoints: a step the loss scaler skipped left them clean.
        self._nonfinite_seen = self._nonfinite_seen or (not finite and self.backend.last_step_applied())
        limit = self.cfg.max_bad_steps
        if not limit:
            return 0
        bad = 0 if finite else bad + 1
        if self.global_step % self.FINITE_CHECK_EVERY == 0:
            # Horovod: the same decision on every rank, from the worst rank.
            over = self.backend.allreduce_sum({"over_limit": 1.0 if bad >= limit else 0.0})["over_limit"]
            if over > 0:
                raise FloatingPointError(
                    f"the training loss was NaN or infinite for at least {limit} steps in a row (up to step "
                    f"{self.global_step}); stopping. The newest checkpoint in {self.checkpoint_dir} was written "
                    f"before; lower --base-lr, use --precision fp32, or raise --max-bad-steps")
        return bad

    def _callbacks(self) -> List[Callback]:
        out = self.cfg.output_dir
        os.makedirs(out, exist_ok=True)
        return [ProgressLogger(), MetricsFile(os.path.join(out, "metrics.jsonl")),
                TensorBoard(os.path.join(out, "tensorboard"))] + self.extra_callbacks

    def _announce(self, steps: int) -> None:
        cfg, b = self.cfg, self.backend
        with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
            resolved = {**json.loads(cfg.to_json()), "recipe": self.name, "world_size": b.size,
                        "threads_per_rank": b.threads, "steps_per_epoch": steps,
                        "precision_requested": self.precision_requested, "precision_reason": b.precision_reason,
                        "global_batch": cfg.batch_size * cfg.accumulate * b.size}
            json.dump(resolved, f, indent=2, sort_keys=True)
        target = schedule.scaled_lr(cfg.base_lr, b.lr_workers(cfg), cfg.accumulate)
        print(f"hvdtrain: {self.name} on {b.name}, {b.size} worker(s) x {b.threads} thread(s) on {b.device}; "
              f"global batch {cfg.batch_size} x {b.size}" + (f" x {cfg.accumulate}" if cfg.accumulate > 1 else "")
              + f" = {cfg.batch_size * cfg.accumulate * b.size}; lr {cfg.base_lr:g} -> {target:g}; "
              + (f"optimizer sharded over {b.size} ranks; " if cfg.shard_optimizer else "")
              + f"{steps} steps/epoch; {cfg.precision} ({b.precision_reason}); output {cfg.output_dir}", flush=True)
        print(f"hvdtrain: rank 0 is pid {os.getpid()}: kill -USR1 {os.getpid()} prints every rank's last step and "
              f"phase", flush=True)


def _exports_onnx(framework: str) -> bool:
    from .backends import backend_class
    try:
        return backend_class(framework).exports_onnx
    except ImportError:  # that framework is not installed
        return False


def _onnxruntime_logits(path: str, x: np.ndarray) -> np.ndarray:
    """``x`` through the ONNX file at ``path`` with onnxruntime (the onnx extra)."""
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError("--format onnx needs the onnx extra: pip install 'hvdtrain[onnx]' "
                          "(onnx, onnxscript, onnxruntime)") from None
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]
