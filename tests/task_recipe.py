"""A user's own task, as the README's subclass contract allows: two inputs per sample, a float target, the user's
own step with an auxiliary loss, and a metric of their own. Used by tests/e2e/test_tasks.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvdtrain import ArrayDataset, TrainConfig, Trainer
from hvdtrain.metrics import MeanSquaredError, Metric
from recipes.regression import RegressionTrainer

AUX = 0.01
"""Weight of the auxiliary loss: the mean squared prediction."""


class WithinTenth(Metric):
    """Share of predictions within 0.1 of the target: the user's own metric."""

    name, goal = "within_tenth", "max"

    def sums(self, outputs, target):
        hit = np.abs(np.asarray(outputs).reshape(target.shape) - target) <= 0.1
        return [hit.sum(), hit.size]

    def value(self, sums):
        return sums[0] / max(sums[1], 1)


def make_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((2, n, 3)).astype(np.float32)
    y = (0.5 * (a @ [1.0, -1.0, 0.5] + b @ [0.5, 1.0, -1.0]) + 0.05 * rng.standard_normal(n)).astype(np.float32)
    return a, b, y


def numpy_forward(arrays, a, b):
    """The model below in numpy, from its weights by structural name."""
    h = np.tanh(np.concatenate([a, b], axis=1) @ arrays["net.0.weight"].T + arrays["net.0.bias"])
    return (h @ arrays["net.2.weight"].T + arrays["net.2.bias"])[:, 0]


@dataclass
class TwoInputConfig(TrainConfig):
    epochs: int = 3
    batch_size: int = 16
    base_lr: float = 0.01
    optimizer: str = "adam"


class TwoInputTrainer(Trainer):
    name = "two-input"
    config_class = TwoInputConfig

    def datasets(self):
        return ArrayDataset(*make_data(512, 1)), ArrayDataset(*make_data(101, 2))  # 101: uneven over 2 ranks

    def metrics(self):
        return [MeanSquaredError(), WithinTenth()]

    def build_torch(self):
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

            def forward(self, a, b):
                return self.net(torch.cat([a, b], dim=1))
        return Net()

    def build_mxnet(self):
        from mxnet.gluon import nn

        class Net(nn.HybridBlock):
            def __init__(self):
                super().__init__()
                with self.name_scope():
                    self.net = nn.HybridSequential()
                    self.net.add(nn.Dense(16, in_units=6), nn.Activation("tanh"), nn.Dense(1, in_units=16))

            def hybrid_forward(self, F, a, b):
                return self.net(F.concat(a, b, dim=1))
        return Net()

    # The user's own step: the squared error plus an auxiliary loss; (loss per sample, outputs).
    def step_torch(self, model, batch):
        a, b, y = batch
        pred = model(a, b).reshape(y.shape)
        return (pred - y) ** 2 + AUX * pred ** 2, pred

    step_mxnet = step_torch


class NoMetricsRegression(TwoInputTrainer):
    """The same regression, as a new user writes it: its own loss, no metrics declared, no step of its own."""

    name = "no-metrics-regression"
    metrics = Trainer.metrics  # the defaults, as if never overridden
    step_torch = step_mxnet = None

    loss_torch = loss_mxnet = staticmethod(RegressionTrainer.loss_torch)  # the squared error per sample


@dataclass
class SequenceConfig(TrainConfig):
    epochs: int = 1
    batch_size: int = 8
    base_lr: float = 0.05
    bad_output: bool = False
    """Return (N, T + 1, C): an output no metric can read."""


class SequenceTrainer(Trainer):
    """A PyTorch sequence tagger whose output follows CrossEntropyLoss's own convention, (N, C, T), targets (N, T)
    with padding (-100) at the end of some sequences; no metrics declared."""

    name = "sequence-nct"
    config_class = SequenceConfig

    def datasets(self):
        rng = np.random.default_rng(0)

        def make(n):
            x = rng.integers(1, 20, (n, 6)).astype(np.int64)
            y = (x % 5).astype(np.int64)
            y[::3, 4:] = -100  # every third sequence is padded after 4 tokens
            return ArrayDataset(x, y)
        return make(96), make(24)

    def build_torch(self):
        from torch import nn
        bad = self.cfg.bad_output

        class Tagger(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.out = nn.Embedding(20, 16), nn.Linear(16, 5)

            def forward(self, x):
                h = self.out(self.embed(x))  # (N, T, C)
                if bad:
                    h = nn.functional.pad(h, (0, 0, 0, 1))  # (N, T + 1, C)
                return h.transpose(1, 2)  # (N, C, T)
        return Tagger()

    @staticmethod
    def loss_torch():
        import torch.nn.functional as F

        def loss(out, y):  # per position, the pads ignored: CrossEntropyLoss's own (N, C, T) convention
            return F.cross_entropy(out[..., :y.shape[1]], y, reduction="none")
        return loss
