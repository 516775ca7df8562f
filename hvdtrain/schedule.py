"""Learning-rate schedule for data-parallel training: pure functions of the training position.

The large-batch recipe of Goyal et al. (arXiv 1706.02677): with k workers each taking a batch of n, the learning
rate is k times the single-worker rate (linear scaling), reached by a gradual linear warmup that starts at the
single-worker rate and is updated every step, followed by a decay.
"""
from __future__ import annotations

import math
from typing import Sequence


def scaled_lr(base_lr: float, world_size: int, accumulate: int = 1) -> float:
    """The target rate: base_lr per worker and micro-batch, times workers, times micro-batches per step."""
    return base_lr * world_size * accumulate


def warmup_factor(epoch: float, warmup_epochs: float, scale: float) -> float:
    """Multiplier of base_lr during warmup: 1 at epoch 0, rising linearly to ``scale`` at ``warmup_epochs``."""
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return scale
    return 1.0 + (scale - 1.0) * epoch / warmup_epochs


def decay_factor(epoch: float, total_epochs: float, mode: str, milestones: Sequence[int] = (),
                 decay: float = 0.1, power: float = 2.0, warmup_epochs: float = 0.0) -> float:
    """Multiplier of the scaled rate after warmup; cosine and poly run from the end of warmup to ``total_epochs``."""
    if mode == "constant":
        return 1.0
    if mode == "step":
        return decay ** sum(1 for m in milestones if epoch >= m)
    span = max(total_epochs - warmup_epochs, 1e-12)
    progress = min(max((epoch - warmup_epochs) / span, 0.0), 1.0)
    if mode == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if mode == "poly":
        return (1.0 - progress) ** power
    raise ValueError(f"unknown lr mode {mode!r}")


def learning_rate(epoch: float, *, base_lr: float, world_size: int, accumulate: int = 1,
                  warmup_epochs: float = 0.0, total_epochs: float = 1.0, mode: str = "step",
                  milestones: Sequence[int] = (), decay: float = 0.1, power: float = 2.0, end: float = 0.0) -> float:
    """The rate at fractional ``epoch`` (e.g. step / steps_per_epoch): warmup, then decay of the scaled rate; cosine
    and poly decay towards ``end`` instead of 0: ``end + (scaled - end) * factor``, MLPerf's polynomial decay
    (power 2, end 1e-4 in its ResNet-50 references)."""
    scale = world_size * accumulate
    if warmup_epochs > 0 and epoch < warmup_epochs:
        return base_lr * warmup_factor(epoch, warmup_epochs, scale)
    target = scaled_lr(base_lr, world_size, accumulate)
    factor = decay_factor(epoch, total_epochs, mode, milestones, decay, power, warmup_epochs)
    if mode in ("cosine", "poly") and end:
        return end + (target - end) * factor
    return target * factor
