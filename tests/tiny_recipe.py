"""A tiny recipe for tests: a two-layer MLP on separable Gaussian blobs, on both frameworks, no files needed.

Also shows the smallest user Trainer: ``python -m hvdtrain recipe tests.tiny_recipe:TinyTrainer``.
"""
import os
from dataclasses import dataclass

import numpy as np

from hvdtrain import ArrayDataset, TrainConfig, Trainer


@dataclass
class TinyConfig(TrainConfig):
    samples: int = 515
    """Training samples (odd on purpose: shards of unequal size before padding)."""
    features: int = 16
    """Input features."""
    classes: int = 4
    """Number of blobs."""
    perturb_by_rank: bool = False
    """Add rank-dependent noise to the initial weights (tests that the broadcast makes them equal)."""


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class TinyTrainer(Trainer):
    """Two-layer MLP on Gaussian blobs (tests)."""

    name = "tiny"
    config_class = TinyConfig

    def datasets(self):
        cfg = self.cfg
        rng = np.random.default_rng(1234)
        centers = rng.normal(0, 3, size=(cfg.classes, cfg.features)).astype(np.float32)

        def make(n):
            y = rng.integers(0, cfg.classes, size=n)
            x = centers[y] + rng.normal(0, 1.5, size=(n, cfg.features)).astype(np.float32)
            return ArrayDataset(x.astype(np.float32), y.astype(np.int64))
        return make(cfg.samples), make(203)

    def build_torch(self):
        import torch
        from torch import nn
        net = nn.Sequential(nn.Linear(self.cfg.features, 32), nn.Tanh(), nn.Linear(32, self.cfg.classes))
        if self.cfg.perturb_by_rank:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.1 * (_rank() + 1))
        return net

    def build_mxnet(self):
        import mxnet as mx
        from mxnet.gluon import nn
        net = nn.HybridSequential()
        net.add(nn.Dense(32, activation="tanh", in_units=self.cfg.features), nn.Dense(self.cfg.classes, in_units=32))
        net.initialize(mx.init.Xavier())
        if self.cfg.perturb_by_rank:
            for p in net.collect_params().values():
                p.set_data(p.data() + 0.1 * (_rank() + 1))
        return net
