"""Validation: the recipe's loss and its metrics over the validation set, on every rank, in one collective.

Each rank scores a disjoint shard (:class:`~hvdtrain.data.ShardSampler` without padding, so every sample counts once);
the loss sum, the sample count and every metric's sums (:mod:`hvdtrain.metrics`) go in a single float64 allreduce.
Framework-free: the backend's ``eval_step`` gives each batch's outputs, target and loss sum on the host.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .metrics import Metric, Tally


class Evaluator:
    def __init__(self, backend, val_set: Any, val_sampler: Any, metrics: List[Metric], batch_size: int,
                 num_workers: int = 0):
        self.backend, self.val_set, self.val_sampler = backend, val_set, val_sampler
        self.metrics, self.batch_size, self.num_workers = metrics, batch_size, num_workers
        Tally(metrics)  # distinct names, checked before any training

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
        loss_sum, count = 0.0, 0
        for batch in self.backend.loader(self.val_set, self.val_sampler, self.batch_size, drop_last=False,
                                         num_workers=self.num_workers):
            outputs, target, batch_loss, n = self.backend.eval_step(batch, outputs=bool(self.metrics))
            tally.add(outputs, target)
            loss_sum, count = loss_sum + batch_loss, count + n
        # Horovod: the loss, the sample count and every metric's sums over all ranks, in one allreduce.
        total = self.backend.allreduce_array(np.concatenate([[loss_sum, count], tally.total]), "eval")
        return {"val_loss": total[0] / max(total[1], 1.0), **tally.values(total[2:])}, int(total[1])
