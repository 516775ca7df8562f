"""Evaluation metrics as objects a task lists: framework-free, summed per rank, allreduced once per evaluation.

A metric turns one batch's model outputs and targets (numpy arrays, on the host) into a few sums
(:meth:`Metric.sums`), and the sums over the whole validation set into its value (:meth:`Metric.value`). The
Trainer adds every rank's sums over its disjoint shard, allreduces them all in one collective, and asks each metric
for its value: the value over N ranks is the value over one rank on the same data, each sample counted once however
unevenly the shards split. The sums are float64 on the host, so both frameworks give the same number for the same
outputs.

A user's own metric subclasses :class:`Metric`::

    class WithinTenPercent(Metric):
        name, goal = "within10", "max"
        def sums(self, outputs, target):
            hit = np.abs(outputs.reshape(target.shape) - target) <= 0.1 * np.abs(target)
            return [hit.sum(), hit.size]
        def value(self, sums):
            return sums[0] / max(sums[1], 1)

and lists it in its Trainer's :meth:`~hvdtrain.Trainer.metrics`. Records name it ``val_NAME``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import numpy as np


class Metric:
    """One evaluation metric: ``sums`` per batch, ``value`` from their totals over every rank."""

    name: str = ""
    """The record's key is ``val_NAME``."""
    goal: str = "max"
    """``max`` when larger is better (accuracy), ``min`` when smaller is (errors, perplexity): --monitor's default."""
    size: int = 2
    """How many sums :meth:`sums` returns."""

    def sums(self, outputs: Any, target: np.ndarray) -> Sequence[float]:
        """This batch's contribution: ``size`` numbers that add up over batches and ranks. ``outputs`` is the
        model's output as numpy (float32; a tuple or dict when the model returns several), ``target`` the batch's
        target as the dataset gave it."""
        raise NotImplementedError

    def value(self, sums: np.ndarray) -> float:
        """The metric from the totals of :meth:`sums` over the whole validation set."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def _logits(outputs: Any) -> np.ndarray:
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    elif isinstance(outputs, dict):
        outputs = next(iter(outputs.values()))
    return np.asarray(outputs)


class Accuracy(Metric):
    """Share of targets whose class has the largest output (``outputs`` (N, C) or (N, ..., C), integer targets of
    shape (N,) or (N, ...): every position counts, as for a sequence model)."""

    name, goal = "accuracy", "max"

    def sums(self, outputs, target):
        logits, target = _logits(outputs), np.asarray(target)
        hit = logits.reshape(-1, logits.shape[-1]).argmax(axis=1) == target.reshape(-1)
        return [float(hit.sum()), float(hit.size)]

    def value(self, sums):
        return float(sums[0] / max(sums[1], 1.0))


class TopK(Metric):
    """Share of targets among the ``k`` largest outputs (top-5 accuracy with the default)."""

    goal = "max"

    def __init__(self, k: int = 5, name: str = ""):
        self.k = k
        self.name = name or f"top{k}"

    def sums(self, outputs, target):
        logits, target = _logits(outputs), np.asarray(target)
        flat = logits.reshape(-1, logits.shape[-1])
        k = min(self.k, flat.shape[1])
        top = np.argpartition(-flat, k - 1, axis=1)[:, :k]
        hit = (top == target.reshape(-1, 1)).any(axis=1)
        return [float(hit.sum()), float(hit.size)]

    value = Accuracy.value


class _Elementwise(Metric):
    """A mean over every element of the target; ``scale`` multiplies the error (a target standardised for training
    reports its error in the original units with ``scale=std``)."""

    goal = "min"
    power = 1

    def __init__(self, scale: float = 1.0, name: str = ""):
        self.scale = float(scale)
        if name:
            self.name = name

    def sums(self, outputs, target):
        target = np.asarray(target, dtype=np.float64)
        pred = _logits(outputs).astype(np.float64)
        if pred.size != target.size:
            raise ValueError(f"metric {self.name}: the model's output has {pred.shape} values per batch and the "
                             f"target {target.shape}; they must match element for element")
        err = np.abs(pred.reshape(target.shape) - target) * self.scale
        return [float((err ** self.power).sum()), float(err.size)]

    def value(self, sums):
        return float(sums[0] / max(sums[1], 1.0))


class MeanSquaredError(_Elementwise):
    """Mean squared error over every target element."""

    name, power = "mse", 2


class MeanAbsoluteError(_Elementwise):
    """Mean absolute error over every target element."""

    name, power = "mae", 1


class RootMeanSquaredError(MeanSquaredError):
    """Square root of the mean squared error (of the whole set, not a mean of per-batch roots)."""

    name = "rmse"

    def value(self, sums):
        return math.sqrt(super().value(sums))


class Perplexity(Metric):
    """exp of the mean cross-entropy per target token: ``outputs`` (N, ..., V) unnormalised scores, integer targets
    (N, ...). Computed from the summed token log-likelihood, not as a mean of per-batch perplexities. Targets equal
    to ``ignore_index`` (padding) are not counted."""

    name, goal = "perplexity", "min"

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def sums(self, outputs, target):
        logits = _logits(outputs).astype(np.float64)
        flat, target = logits.reshape(-1, logits.shape[-1]), np.asarray(target).reshape(-1).astype(np.int64)
        keep = target != self.ignore_index
        flat, target = flat[keep], target[keep]
        top = flat.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(flat - top).sum(axis=1))
        nll = log_z - flat[np.arange(len(target)), target]
        return [float(nll.sum()), float(len(target))]

    def value(self, sums):
        return float(math.exp(sums[0] / max(sums[1], 1.0)))


class Tally:
    """The sums of a list of metrics over one rank's batches, as one float64 vector (one allreduce for all)."""

    def __init__(self, metrics: List[Metric]):
        names = [m.name for m in metrics]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated or not all(names):
            raise ValueError(f"metrics need distinct non-empty names; got {names}")
        self.metrics = metrics
        self.offsets = np.cumsum([0] + [m.size for m in metrics])
        self.total = np.zeros(int(self.offsets[-1]), dtype=np.float64)

    def add(self, outputs: Any, target: np.ndarray) -> None:
        for i, m in enumerate(self.metrics):
            got = np.asarray(m.sums(outputs, target), dtype=np.float64).reshape(-1)
            if got.size != m.size:
                raise ValueError(f"metric {m.name}: sums() returned {got.size} numbers, its size says {m.size}")
            self.total[self.offsets[i]:self.offsets[i + 1]] += got

    def values(self, total: np.ndarray) -> Dict[str, float]:
        """``val_NAME`` of every metric from the totals over every rank."""
        return {f"val_{m.name}": m.value(total[self.offsets[i]:self.offsets[i + 1]])
                for i, m in enumerate(self.metrics)}


def throughput(samples_per_sec: float, sample_unit: str = "samples", tokens_per_sample: int = 0) -> Dict[str, float]:
    """An epoch record's speed, named after what it counts: ``samples_per_sec`` always, ``UNIT_per_sec`` too for a
    task whose samples are e.g. images, and ``tokens_per_sec`` for a sequence task of ``tokens_per_sample``."""
    out = {"samples_per_sec": samples_per_sec}
    if sample_unit != "samples":
        out[f"{sample_unit}_per_sec"] = samples_per_sec
    if tokens_per_sample:
        out["tokens_per_sec"] = samples_per_sec * tokens_per_sample
    return out
