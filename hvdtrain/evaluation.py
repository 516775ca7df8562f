"""Validation: the recipe's loss and its metrics over the validation set, on every rank, in one collective.

Each rank scores a disjoint shard (:class:`~hvdtrain.data.ShardSampler` without padding, so every sample counts once);
the loss sum, the sample count and every metric's sums (:mod:`hvdtrain.metrics`) go in a single float64 allreduce.
Framework-free: the backend's ``eval_step`` gives each batch's outputs, target and loss sum on the host.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .config import ConfigError
from .metrics import MeanAbsoluteError, MeanSquaredError, Metric, Tally


class Evaluator:
    def __init__(self, backend, val_set: Any, val_sampler: Any, metrics: List[Metric], batch_size: int,
                 num_workers: int = 0, default_metrics: bool = False):
        """``default_metrics``: ``metrics`` are the Trainer's defaults (a classifier's), which :meth:`check` fits to
        the targets."""
        self.backend, self.val_set, self.val_sampler = backend, val_set, val_sampler
        self.metrics, self.batch_size, self.num_workers = metrics, batch_size, num_workers
        self.default_metrics = default_metrics
        self.regression_defaults = False
        try:
            Tally(metrics)  # distinct names, none reserved, checked before any training
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _first_batch(self) -> Any:
        """The first validation samples as a batch (the same on every rank, so every rank decides alike with no
        collective); None without a validation set."""
        if self.val_set is None or len(self.val_set) == 0:
            return None
        first = range(min(len(self.val_set), self.batch_size))
        return next(iter(self.backend.loader(self.val_set, first, len(first), drop_last=False, num_workers=0)), None)

    def fit_defaults(self) -> None:
        """Default metrics fit the target, read from the first validation sample (no forward pass: the model's state
        has not been broadcast yet): class indices keep accuracy; other targets get the mean squared and absolute
        errors (accuracy on float targets reported 0.00%), which :meth:`check` drops for the loss alone where the
        output does not match the target element for element."""
        if not self.default_metrics or self.val_set is None or len(self.val_set) == 0:
            return
        try:
            _, target = self.backend.task.split(self.val_set[0])
            kind = np.asarray(target).dtype.kind
        except Exception:  # noqa: BLE001 - items that are not arrays on the host (a device tensor): keep the defaults
            return
        if kind not in "iub":
            self.metrics = [MeanSquaredError(), MeanAbsoluteError()]
            self.regression_defaults = True

    def check(self) -> None:
        """Before training: the first validation batch through ``eval_step``, the loss and every metric. A metric
        that cannot read the model's output is a one-line ConfigError naming both shapes."""
        batch = self._first_batch()
        if batch is None:
            return
        try:
            outputs, target, _, _ = self.backend.eval_step(batch)
        except ValueError as e:
            raise ConfigError(f"the validation loss: {e} (checked on one validation batch before training)") from None
        target = np.asarray(target)
        if self.regression_defaults:
            out = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
            if not (isinstance(out, np.ndarray) and out.size == target.size):
                self.metrics = []  # the loss alone
        try:
            Tally(self.metrics).add(outputs, target)
        except ValueError as e:
            raise ConfigError(f"{e} (checked on one validation batch before training)") from None

    def goals(self) -> Dict[str, str]:
        """Every record key --monitor may name, with the direction in which it improves."""
        goals = {"train_loss": "min"}
        if self.val_set is not None:
            goals["val_loss"] = "min"
            goals.update({f"val_{m.name}": m.goal for m in self.metrics})
        return goals

    def run(self) -> Tuple[Dict[str, Optional[float]], int]:
        """The loss (mean per sample) and every metric, and how many samples they cover over all ranks (each
        once). Every rank takes part."""
        tally = Tally(self.metrics)
        if self.val_set is None:
            return {"val_loss": None, **{k: None for k in tally.values(tally.total)}}, 0
        loss_sum, weight, count = 0.0, 0.0, 0
        for batch in self.backend.loader(self.val_set, self.val_sampler, self.batch_size, drop_last=False,
                                         num_workers=self.num_workers):
            outputs, target, (batch_loss, batch_weight), n = self.backend.eval_step(batch, outputs=bool(self.metrics))
            tally.add(outputs, target)
            loss_sum, weight, count = loss_sum + batch_loss, weight + batch_weight, count + n
        # Horovod: the loss, the sample count and every metric's sums over all ranks, in one allreduce.
        total = self.backend.allreduce_array(np.concatenate([[loss_sum, weight, count], tally.total]), "eval")
        return {"val_loss": total[0] / max(total[1], 1.0), **tally.values(total[3:])}, int(total[2])
