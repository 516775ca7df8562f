"""The checkpoint policy of a run: when checkpoints are written, resume, best/ and branches, and the initial load of
``--init-from``. The file format itself (atomic writes, digests, pickle-free arrays, names) is ``checkpoint.py``.

One collaborator owned by the Trainer, called on every rank; rank 0 alone reads and writes files, and every decision
it takes (resume or not, from where; the weights it loaded) reaches the other ranks before they act on it.

The format: ``hvdtrain.checkpoint`` files (arrays plus a JSON skeleton, never a pickle) holding::

    {"trainer": {"epoch", "offset", "global_step", "train_sums", "train_steps", "recipe", "framework", "world_size",
                 "config", "monitor", "tracking"},
     "backend": Backend.state_dict()  ({"model": arrays by structural name, "optimizer": ..., ...}),
     "statistics_by_rank": a (world size, n) array, in a checkpoint inside an epoch of a job of several ranks}

``epoch`` epochs are complete, plus the first ``offset`` samples of the next one's order (a checkpoint inside an
epoch); :class:`Position` is that with the global step, the one position training, elastic commits and checkpoints
share. Inside an epoch it also carries the training metrics' sums over the epoch's steps so far (``train_sums``,
averaged over the ranks, over ``train_steps`` steps), so that a resumed epoch's train_loss covers the whole epoch as
an uninterrupted one does.

Each rank's running statistics (BatchNorm's) follow its own shard of the data until an epoch ends, where they are
averaged (``Backend.average_statistics``). A checkpoint inside an epoch therefore holds every rank's own statistics
(``statistics_by_rank``), and a resume at the same world size gives each rank its own back: the records then equal
the uninterrupted run's exactly. Without them every rank would continue from rank 0's statistics (a mid-epoch
checkpoint's model) or from their average (a --max-steps stop, which scores the averaged model), and the epoch's
evaluation would differ. At another world size every rank takes the rows' average.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from . import checkpoint, weights
from .config import ConfigError


@dataclass
class Position:
    """Where training stands: ``epoch`` epochs complete plus the first ``offset`` samples of the next epoch's order,
    after ``global_step`` optimizer steps."""
    epoch: int = 0
    offset: int = 0
    global_step: int = 0
    train_sums: Dict[str, float] = field(default_factory=dict)
    """The epoch's training metrics summed over its first ``train_steps`` steps (each the mean over the ranks)."""
    train_steps: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Position":
        return cls(int(d["epoch"]), int(d.get("offset", 0)), int(d["global_step"]),
                   {k: float(v) for k, v in (d.get("train_sums") or {}).items()}, int(d.get("train_steps") or 0))


class Checkpointer:
    def __init__(self, cfg, backend, recipe: str, reporter, monitor=None):
        self.cfg, self.backend, self.recipe, self.reporter = cfg, backend, recipe, reporter
        self.monitor = monitor
        """--monitor's :class:`~hvdtrain.monitor.Monitor` (None without): its state rides in every checkpoint."""
        self.tracking: Optional[Dict[str, Any]] = None
        """--track's state (the MLflow run's id), set by rank 0's tracker: it rides in every checkpoint."""
        self.resumed_tracking: Optional[Dict[str, Any]] = None
        """The resumed checkpoint's tracking state (None: a new run)."""
        self.tracking_ready: Optional[Callable[[], None]] = None
        """Rank 0: waits until :attr:`tracking` is known (the tracker opens its run on a thread of its own)."""
        self.output_url = ""
        """--output-dir when it is a URL (``cfg.output_dir`` is its staging copy)."""
        self.written: Optional[Callable[[], Any]] = None
        """Rank 0: called after each checkpoint write (a URL --output-dir pushes the staging copy there)."""
        self._loaded_statistics: Optional[np.ndarray] = None
        """Rank 0, between loading a checkpoint and broadcasting it: its ``statistics_by_rank``."""

    @property
    def directory(self) -> str:
        return os.path.join(self.cfg.output_dir, "checkpoints")

    # --- writing ----------------------------------------------------------------------------------------------------
    def save(self, at: Position, statistics_by_rank: Optional[np.ndarray] = None,
             model_statistics: Optional[np.ndarray] = None) -> str:
        """Rank 0: write a checkpoint of position ``at`` atomically and keep the newest K. Returns its path ("" when
        a parameter is not finite and nothing was written). ``model_statistics``: the running statistics the saved
        model holds in place of rank 0's own (which stay in the model being trained)."""
        self.reporter.progress(at.global_step, "checkpoint")
        if self.tracking_ready is not None:
            self.tracking_ready()
        state = {"trainer": {"epoch": at.epoch, "offset": at.offset, "global_step": at.global_step,
                             "train_sums": at.train_sums, "train_steps": at.train_steps, "recipe": self.recipe, "framework": self.backend.name,
                             "world_size": self.backend.size, "config": json.loads(self.cfg.to_json()),
                             "monitor": self.monitor.state() if self.monitor else None, "tracking": self.tracking},
                 "backend": self._backend_state(model_statistics)}
        if statistics_by_rank is not None:
            state["statistics_by_rank"] = statistics_by_rank
        bad = [name for name, value in state["backend"]["model"].items()
               if np.issubdtype(np.asarray(value).dtype, np.floating) and not np.isfinite(value).all()]
        if bad:  # a NaN gradient that left the loss finite: the weights are gone, the last checkpoint is kept
            print(f"hvdtrain: warning: not writing a checkpoint at step {at.global_step}: parameter {bad[0]} (and "
                  f"{len(bad) - 1} more) holds NaN or infinite values", file=sys.stderr, flush=True)
            return ""
        path = checkpoint.save(self.directory, at.epoch, at.global_step, state)
        checkpoint.prune(self.directory, self.cfg.keep_checkpoints)
        return path

    def _backend_state(self, statistics: Optional[np.ndarray]) -> Dict[str, Any]:
        if statistics is None:
            return self.backend.state_dict()
        own = self.backend.statistics()
        self.backend.set_statistics(statistics)
        try:
            return self.backend.state_dict()
        finally:
            self.backend.set_statistics(own)

    def _gather_and_save(self, at: Position, best: bool = False, statistics: Optional[np.ndarray] = None) -> None:
        """Every rank: ``statistics``, this rank's own running statistics where the model's are no longer its own
        (a --max-steps stop averaged them to score the model). A checkpoint inside an epoch without them (a
        --checkpoint-every-steps one) saves the model with the ranks' average, as an evaluation there would score
        it, not with rank 0's own."""
        # Horovod: state the ranks hold in parts (--shard-optimizer) comes together on rank 0, which writes.
        self.backend.gather_state()
        by_rank = self._statistics_by_rank(at, statistics)
        if self.backend.rank == 0:
            path = self.save(at, by_rank, by_rank.mean(axis=0) if by_rank is not None and statistics is None
                             else None)
            if path and best:
                self._keep_as_best(path)
            if path and self.written is not None:
                self.written()

    def _statistics_by_rank(self, at: Position, own: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """Every rank, at a checkpoint: inside an epoch of a job of several ranks, every rank's own running
        statistics as the rows of one array (one collective); None elsewhere. Elastic jobs keep rank 0's: their
        world changes, and their commits and restores broadcast rank 0's state."""
        b = self.backend
        if at.offset == 0 or b.size == 1 or self.cfg.elastic:
            return None
        own = b.statistics() if own is None else own
        # Horovod: every rank's statistics on every rank (all ranks decide alike, from sizes they share).
        return b.allgather_array(own, "statistics.by_rank") if own.size else None

    @property
    def best_directory(self) -> str:
        from .monitor import BEST_DIR
        return os.path.join(self.cfg.output_dir, BEST_DIR)

    def _keep_as_best(self, path: str) -> None:
        """Rank 0: a copy of checkpoint ``path`` (the best epoch by --monitor) as the only one in OUTPUT_DIR/best/:
        the copy is written whole (digest last), then every other checkpoint there is removed, whatever its name (a
        branch's new best may be older by name than the best of the future it abandoned)."""
        directory = self.best_directory
        os.makedirs(directory, exist_ok=True)
        name = os.path.basename(path)
        checkpoint.atomic_write(os.path.join(directory, name), open(path, "rb").read())
        checkpoint.atomic_write(os.path.join(directory, name + ".sha256"), open(path + ".sha256", "rb").read())
        for other in checkpoint.list_checkpoints(directory):
            if os.path.basename(other) != name:
                checkpoint.remove(other)

    def repair_best(self) -> None:
        """Rank 0, on resume: OUTPUT_DIR/best/ must hold the checkpoint the monitor's state names as the best
        (its global step). A crash between writing that checkpoint and copying it to best/ leaves best/ without it
        (or with an older one): the copy is made now from checkpoints/, where the resumed checkpoint itself is
        usually that one. Where it was pruned too, a warning says the best epoch's weights are lost."""
        step = self.monitor.best_step if self.monitor is not None and self.monitor.best is not None else 0
        if not step:
            return
        held = [checkpoint.position_of(p) for p in checkpoint.list_checkpoints(self.best_directory)]
        if held and held[-1][1] == step:
            return
        source = [p for p in checkpoint.list_checkpoints(self.directory) if checkpoint.position_of(p)[1] == step]
        if source:
            checkpoint.read_verified(source[-1])
            self._keep_as_best(source[-1])
            print(f"hvdtrain: {self.best_directory} did not hold the best epoch's checkpoint (a crash between writing "
                  f"it and copying it there, or a branch from an older checkpoint): copied {source[-1]}",
                  file=sys.stderr)
        else:
            print(f"hvdtrain: warning: the best epoch's checkpoint ({self.monitor.key} {self.monitor.best:.6g} at "
                  f"epoch {self.monitor.best_epoch}, step {step}) is in neither {self.best_directory} nor "
                  f"{self.directory} (--keep-checkpoints pruned it): best/ will hold the next best epoch",
                  file=sys.stderr)

    def epoch_end(self, at: Position, healthy: bool, best: bool = False,
                  statistics: Optional[np.ndarray] = None) -> None:
        """Every rank, after an epoch (complete, or cut short by --max-steps at ``at``, ``statistics`` then this
        rank's own running statistics before they were averaged): a checkpoint where the weights are healthy on
        every rank (with ``best``, also kept in OUTPUT_DIR/best/), and the elastic commit."""
        if healthy:  # never a checkpoint of weights that a non-finite loss may have reached
            self._gather_and_save(at, best, statistics)
        self.commit(at, check=False)

    def mid_epoch(self, at: Position, health, with_sums: Optional[Callable[[], Position]] = None) -> bool:
        """Every rank, after a step inside an epoch: commit (elastic) and checkpoint where due; True when a run may
        resume at ``at`` (the Trainer then reseeds the framework's generator). ``with_sums``: ``at`` with the epoch's
        training sums so far, which costs every rank a collective: called only where a checkpoint is due."""
        cfg, step = self.cfg, at.global_step
        resumable = False
        if cfg.elastic and cfg.commit_every and step % cfg.commit_every == 0:
            self.commit(at)
            resumable = True
        if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0:
            resumable = True
            # Horovod: every rank takes part in the decision, rank 0 writes.
            if health.everywhere(step):
                self._gather_and_save(with_sums() if with_sums is not None else at)
        return resumable

    def commit(self, at: Position, check: bool = True) -> None:
        """Elastic mode: remember ``at`` (and the backend's model and optimizer) as the point to roll back to when a
        worker leaves or joins; with ``check``, then restart there at once if workers were added."""
        if self.cfg.elastic:
            self.backend.commit(at.as_dict())
            if check:
                self.backend.check_membership()

    # --- reading ----------------------------------------------------------------------------------------------------
    def restore(self) -> Position:
        """Every rank: rank 0 picks and loads the checkpoint (--resume), every rank learns the outcome, then receives
        rank 0's state. Elastic runs decide without a collective (a worker joining a running job would wait for
        partners that never come): the elastic driver's sync broadcasts rank 0's state and position instead."""
        info = self.backend.root_decides(self._load_on_root, collective=not self.cfg.elastic,
                                         error=checkpoint.CheckpointError)
        if info is None:
            return Position()
        # (kept in later checkpoints even by a run without --track: a later resume with it continues the run)
        self.resumed_tracking = self.tracking = info.get("tracking")
        if self.monitor is not None:
            self.monitor.load(info.get("monitor"))
            if self.backend.rank == 0:
                self.repair_best()
        if not self.cfg.elastic:
            # Horovod: model and optimizer state from rank 0, which loaded the checkpoint.
            self.backend.broadcast_state()
            if info.get("statistics_by_rank"):
                self._restore_statistics()
        return Position.from_dict(info)

    def _restore_statistics(self) -> None:
        """Every rank, resuming from a checkpoint inside an epoch: its own running statistics back (the average of
        every rank's at another world size)."""
        b = self.backend
        # Horovod: the checkpoint's rows from rank 0, which loaded them.
        rows = b.broadcast_tree(self._loaded_statistics if b.rank == 0 else None)
        self._loaded_statistics = None
        b.set_statistics(rows[b.rank] if rows.shape[0] == b.size else rows.mean(axis=0))

    def _load_on_root(self) -> Optional[Dict[str, Any]]:
        cfg = self.cfg
        removed = checkpoint.clean_temporaries(self.directory)
        if removed:
            print(f"hvdtrain: removed {len(removed)} temporary file(s) left by an interrupted checkpoint write",
                  file=sys.stderr)
        if cfg.resume == "never":
            self._set_aside_previous_run()
            return None
        try:
            path = (checkpoint.latest_valid(self.directory, warn=lambda m: print(f"hvdtrain: warning: {m}",
                                                                                file=sys.stderr))
                    if cfg.resume == "auto" else self._local(cfg.resume))
        except ConfigError as e:
            return {"error": str(e)}
        if path is None:
            return None
        if cfg.resume != "auto":
            self._set_aside_future_of(path)
        try:
            state = checkpoint.load(path)
            meta = state["trainer"]
            if meta["framework"] != self.backend.name or meta["recipe"] != self.recipe:
                raise checkpoint.CheckpointError(
                    f"{path} was written by recipe {meta['recipe']} on {meta['framework']}, not {self.recipe} on "
                    f"{self.backend.name}; pass --resume never or another --output-dir")
            self.backend.load_state_dict(state["backend"])
            rows = state.get("statistics_by_rank")
            ours = self.backend.statistics().shape if rows is not None else None
            if rows is not None and rows.shape[1:] != ours:
                raise checkpoint.CheckpointError(f"its running statistics by rank have shape {rows.shape}, the "
                                                 f"model's {ours}")
            self._loaded_statistics = rows
        except (checkpoint.CheckpointError, KeyError, TypeError, ValueError, RuntimeError) as e:
            return {"error": f"cannot resume from {path}: {e}"}
        print(f"hvdtrain: resuming from {path} (epoch {meta['epoch']}, step {meta['global_step']})", file=sys.stderr)
        return {**Position.from_dict(meta).as_dict(), "path": path, "monitor": meta.get("monitor"),
                "tracking": meta.get("tracking"), "statistics_by_rank": rows is not None}

    def _local(self, path: str) -> str:
        """--resume PATH as a local file: a URL inside this job's --output-dir URL is its staging copy (pulled at
        the start); another URL is fetched (:func:`hvdtrain.remote.localize`)."""
        from . import remote
        if not remote.is_url(path):
            return path
        if self.output_url and path.startswith(self.output_url + "/"):
            return os.path.join(self.cfg.output_dir, *path[len(self.output_url) + 1:].split("/"))
        return remote.localize(path, "--resume")

    def _set_aside_future_of(self, path: str) -> None:
        """--resume PATH from a checkpoint older than this run's newest: the run branches there. The checkpoints after
        PATH (and best/ when it holds one of them) belong to the future it abandons; ``--resume auto``, ``eval RUN``
        and ``--init-from RUN`` would pick them, and pruning would keep them over the branch's own. They move to
        abandoned-TIMESTAMP/ with a copy of metrics.jsonl (whose later records the branch then drops)."""
        at = checkpoint.position_of(path)
        if at is None:
            return
        later = [p for p in checkpoint.list_checkpoints(self.directory) if checkpoint.position_of(p)[1] > at[1]
                 and os.path.abspath(p) != os.path.abspath(path)]
        best = checkpoint.list_checkpoints(self.best_directory)
        best_later = bool(best) and checkpoint.position_of(best[-1])[1] > at[1]
        if not later and not best_later:
            return
        target = os.path.join(self.cfg.output_dir, time.strftime("abandoned-%Y%m%d-%H%M%S"))
        os.makedirs(os.path.join(target, "checkpoints"), exist_ok=True)
        for p in later:
            for f in (p, p + ".sha256"):
                if os.path.exists(f):
                    os.replace(f, os.path.join(target, "checkpoints", os.path.basename(f)))
        if best_later:
            os.replace(self.best_directory, os.path.join(target, os.path.basename(self.best_directory)))
        metrics = os.path.join(self.cfg.output_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            with open(metrics, "rb") as f:
                checkpoint.atomic_write(os.path.join(target, "metrics.jsonl"), f.read())
        print(f"hvdtrain: --resume {path} branches at step {at[1]}: {len(later)} later checkpoint(s)"
              + (" and best/" if best_later else "") + f" moved to {target}", file=sys.stderr)

    def _set_aside_previous_run(self) -> None:
        """--resume never in a directory that holds an earlier run: move its checkpoints and metrics to
        previous-TIMESTAMP/ rather than overwrite or prune them (they may be newer by name than this run's)."""
        old = [p for p in (self.directory, os.path.join(self.cfg.output_dir, "metrics.jsonl"),
                           os.path.join(self.cfg.output_dir, "best")) if os.path.exists(p)]
        if not checkpoint.list_checkpoints(self.directory) or not old:
            return
        target = os.path.join(self.cfg.output_dir, time.strftime("previous-%Y%m%d-%H%M%S"))
        os.makedirs(target, exist_ok=True)
        for path in old:
            os.replace(path, os.path.join(target, os.path.basename(path)))
        print(f"hvdtrain: --resume never: the earlier run's checkpoints and metrics were moved to {target}",
              file=sys.stderr)

    def init_from(self, evaluating: bool = False) -> None:
        """--init-from: rank 0 reads the weights and fits them to the model (renamed from the other framework where
        needed); every rank then takes rank 0's model. Elastic runs, which must not add collectives, read on every
        rank. Optimizer state stays fresh. ``evaluating``: a classifier of another class count is refused (it
        would score untrained) instead of starting fresh."""
        b, path = self.backend, self.cfg.init_from

        def load() -> Dict[str, Any]:
            try:
                arrays, source = weights.read(path)
                fitted, kept = weights.fit(b.model_arrays(), arrays, path, to=b.weight_naming)
                if kept and evaluating:
                    raise weights.WeightsError(f"{path} has another class count than the model ({', '.join(kept)}): "
                                               f"evaluating it would score an untrained classifier; pass the "
                                               f"recipe's --num-classes for these weights")
                b.assign_model_arrays(fitted)
                return {"kept": kept, "count": len(fitted), "framework": source.get("framework") or "unknown"}
            except weights.WeightsError as e:
                return {"error": f"--init-from: {e}"}
        info = b.root_decides(load, collective=not self.cfg.elastic, everywhere=self.cfg.elastic, error=ConfigError)
        if not self.cfg.elastic:
            # Horovod: rank 0's weights (and its fresh optimizer state) on every rank.
            b.broadcast_state()
        if b.rank == 0:
            kept = info["kept"]
            print(f"hvdtrain: initialised from {path} ({info['framework']} weights, {info['count'] - len(kept)} of "
                  f"{info['count']} arrays)" + (f"; the classifier ({', '.join(kept)}) has another class count "
                                                f"there and starts fresh" if kept else ""), flush=True)
