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

One padding rule for every metric and the validation loss: a target position equal to :data:`IGNORE_INDEX` (-100,
PyTorch's ``CrossEntropyLoss`` default) counts nowhere, neither as a hit, a miss, a token of the perplexity nor a
value of ``val_loss``. So over padded sequences ``val_perplexity == exp(val_loss)`` for a cross-entropy loss.

The class axis of a classifier's output is found from the target's shape: the last axis ((N, C), (N, T, C): Gluon's
and the recipes' convention) or axis 1 ((N, C, T) with targets (N, T): PyTorch's ``CrossEntropyLoss`` convention for
sequences); ``class_axis`` says it where both would fit. Outputs that fit neither are a one-line error at the first
validation batch, which the Trainer runs through the metrics before training starts.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

IGNORE_INDEX = -100
"""A target position with this value (padding) counts in no metric and not in the validation loss."""
RESERVED = ("loss",)
"""Metric names that would replace a record key the Trainer writes itself (``val_loss``)."""


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


def class_scores(name: str, outputs: Any, target: Any, class_axis: Optional[int] = None,
                 ignore_index: int = IGNORE_INDEX) -> Tuple[np.ndarray, np.ndarray]:
    """(scores as (positions, classes), targets as (positions,)) of a classifier's batch, the padded positions left
    out; ``class_axis`` None: the last axis or axis 1, whichever the target's shape fits (see the module docstring).
    A single score per position (N,) or (N, 1) is a binary classifier's logit: (positions, 2) with the logit as
    class 1's score against 0. A ValueError naming the metric and both shapes where they cannot match."""
    scores, target = _logits(outputs), np.asarray(target)
    if target.dtype.kind not in "iub":
        raise ValueError(f"metric {name}: the target is {target.dtype} (a regression's?), not class indices; list "
                         f"error metrics (MeanSquaredError(), ...) in the Trainer's metrics() instead")
    if scores.shape == target.shape or scores.shape == target.shape + (1,):  # one logit per position: binary
        logit = scores.reshape(target.shape).astype(np.float64)
        scores, axis = np.stack([np.zeros_like(logit), logit], axis=-1), -1
    else:
        axis = class_axis
        if axis is None:
            if scores.shape[:-1] == target.shape:
                axis = -1
            elif scores.ndim == target.ndim + 1 and scores.shape[:1] + scores.shape[2:] == target.shape:
                axis = 1
        fits = axis is not None and scores.ndim == target.ndim + 1 and \
            np.delete(np.array(scores.shape), axis).tolist() == list(target.shape)
        if not fits:
            raise ValueError(f"metric {name}: the model's output {scores.shape} does not fit targets {target.shape}: "
                             f"give the class scores as (N, C) or (N, ..., C), or (N, C, ...) as PyTorch's "
                             f"CrossEntropyLoss takes them, for integer targets (N, ...)")
    flat = np.moveaxis(scores, axis, -1).reshape(-1, scores.shape[axis])
    target = target.reshape(-1).astype(np.int64)
    keep = target != ignore_index
    return flat[keep], target[keep]


class Accuracy(Metric):
    """Share of target positions whose class has the largest output: every position counts (as for a sequence
    model) but padding (:data:`IGNORE_INDEX`); a single logit per position is a binary classifier's (class 1 where
    it is above 0). ``class_axis``: where the classes are, when the target's shape does not tell."""

    name, goal = "accuracy", "max"

    def __init__(self, class_axis: Optional[int] = None, ignore_index: int = IGNORE_INDEX):
        self.class_axis, self.ignore_index = class_axis, ignore_index

    def sums(self, outputs, target):
        flat, target = class_scores(self.name, outputs, target, self.class_axis, self.ignore_index)
        hit = flat.argmax(axis=1) == target
        return [float(hit.sum()), float(hit.size)]

    def value(self, sums):
        return float(sums[0] / max(sums[1], 1.0))


class TopK(Metric):
    """Share of target positions among the ``k`` largest outputs (top-5 accuracy with the default); padding and the
    class axis as :class:`Accuracy`."""

    goal = "max"

    def __init__(self, k: int = 5, name: str = "", class_axis: Optional[int] = None,
                 ignore_index: int = IGNORE_INDEX):
        self.k = k
        self.name = name or f"top{k}"
        self.class_axis, self.ignore_index = class_axis, ignore_index

    def sums(self, outputs, target):
        flat, target = class_scores(self.name, outputs, target, self.class_axis, self.ignore_index)
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
    """exp of the mean cross-entropy per target token: ``outputs`` (N, ..., V) or (N, V, ...) unnormalised scores,
    integer targets (N, ...). Computed from the summed token log-likelihood, not as a mean of per-batch perplexities.
    Targets equal to ``ignore_index`` (padding) are not counted. A diverged model's perplexity is inf, not an
    error."""

    name, goal = "perplexity", "min"

    def __init__(self, ignore_index: int = IGNORE_INDEX, class_axis: Optional[int] = None):
        self.ignore_index, self.class_axis = ignore_index, class_axis

    def sums(self, outputs, target):
        flat, target = class_scores(self.name, outputs, target, self.class_axis, self.ignore_index)
        flat = flat.astype(np.float64)
        top = flat.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(flat - top).sum(axis=1))
        nll = log_z - flat[np.arange(len(target)), target]
        return [float(nll.sum()), float(len(target))]

    def value(self, sums):
        mean = sums[0] / max(sums[1], 1.0)
        return math.inf if mean > 709.0 else float(math.exp(mean))  # exp overflows a float64 past ~709.78


class Tally:
    """The sums of a list of metrics over one rank's batches, as one float64 vector (one allreduce for all)."""

    def __init__(self, metrics: List[Metric]):
        names = [m.name for m in metrics]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated or not all(names):
            raise ValueError(f"metrics need distinct non-empty names; got {names}")
        reserved = [n for n in names if n in RESERVED]
        if reserved:
            raise ValueError(f"metric name {reserved[0]!r} is the Trainer's own (val_{reserved[0]} is the recipe's "
                             f"loss): give the metric another name")
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
