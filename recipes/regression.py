"""Regression: an MLP predicting diabetes progression one year ahead from ten baseline measurements.

Data: scikit-learn's copy of the diabetes study (Efron, Hastie, Johnstone and Tibshirani, "Least Angle Regression",
Annals of Statistics 2004): 442 patients, 10 features (age, sex, BMI, blood pressure, six blood serum values), the
target a quantitative measure of disease progression. It ships inside scikit-learn (no download). A fixed 100
patients are held out for validation. Features and target are standardised with the training split's statistics;
the model trains on the standardised target, and val_mse / val_mae / val_rmse are reported in the target's own units.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Tuple

import numpy as np

from hvdtrain import ArrayDataset, ConfigError, TrainConfig, Trainer
from hvdtrain.config import BASE_LRS
from hvdtrain.metrics import MeanAbsoluteError, MeanSquaredError, RootMeanSquaredError

VALIDATION = 100
"""Patients held out, the same ones for every run (a permutation with seed 0)."""


def load_diabetes() -> Tuple[np.ndarray, np.ndarray]:
    """(features (442, 10) float64, target (442,) float64) from scikit-learn's embedded copy."""
    try:
        from sklearn.datasets import load_diabetes as sklearn_diabetes
    except ImportError:
        raise ConfigError("the regression recipe reads scikit-learn's embedded diabetes data: pip install "
                          "scikit-learn (make install includes it)") from None
    x, y = sklearn_diabetes(return_X_y=True, scaled=False)
    return np.asarray(x, np.float64), np.asarray(y, np.float64)


def split(x: np.ndarray, y: np.ndarray):
    """Train and validation parts, standardised with the training part's mean and standard deviation; returns
    (train, val, target mean, target std)."""
    order = np.random.default_rng(0).permutation(len(x))
    val, train = order[:VALIDATION], order[VALIDATION:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    y_mean, y_std = y[train].mean(), y[train].std()

    def part(idx):
        return ((x[idx] - mean) / std).astype(np.float32), ((y[idx] - y_mean) / y_std).astype(np.float32)
    return part(train), part(val), float(y_mean), float(y_std)


@dataclass
class RegressionConfig(TrainConfig):
    """Regression defaults: Adam with a cosine decay over 20 epochs of 342 patients (longer overfits: the training
    error keeps falling, the validation error rises); 2 workers reach a validation RMSE near 54 (the target's
    standard deviation is 77) in a few seconds."""

    epochs: int = 20
    batch_size: int = 16
    base_lrs = {**BASE_LRS, "adam": 0.003, "adamw": 0.003}
    optimizer: Literal["sgd", "adam", "adamw", "lars", "lamb"] = "adam"
    lr_mode: Literal["step", "cosine", "poly", "constant"] = "cosine"
    weight_decay: float = 0.01
    hidden: int = 32
    """Units of each of the two hidden layers."""


class RegressionTrainer(Trainer):
    """Diabetes progression by an MLP, mean squared error, on PyTorch or MXNet."""

    name = "regression"
    config_class = RegressionConfig
    input_shape = (10,)
    sample_unit = "patients"
    output_description = "the standardised disease progression one year after baseline (preprocessing: output)"

    def datasets(self):
        train, val, self.y_mean, self.y_std = split(*load_diabetes())
        return ArrayDataset(*train), ArrayDataset(*val)

    def metrics(self):
        if not hasattr(self, "y_std"):
            _, _, self.y_mean, self.y_std = split(*load_diabetes())
        # Errors of the standardised prediction times the target's standard deviation: in the target's own units.
        return [MeanSquaredError(scale=self.y_std), MeanAbsoluteError(scale=self.y_std),
                RootMeanSquaredError(scale=self.y_std)]

    def preprocessing(self):
        return {"features": "the 10 diabetes baseline variables, standardised with the training split's mean and "
                            "std", "output": f"(progression - {self.y_mean:.4f}) / {self.y_std:.4f}"}

    def build_torch(self):
        from torch import nn
        h = self.cfg.hidden
        return nn.Sequential(nn.Linear(10, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))

    def build_mxnet(self):
        from mxnet.gluon import nn
        h = self.cfg.hidden
        net = nn.HybridSequential()  # layer for layer the PyTorch model
        net.add(nn.Dense(h, in_units=10), nn.Activation("tanh"), nn.Dense(h, in_units=h), nn.Activation("tanh"),
                nn.Dense(1, in_units=h))
        return net

    @staticmethod
    def loss_torch():
        def squared_error(pred, y):  # per sample
            return (pred.reshape(y.shape) - y) ** 2
        return squared_error

    loss_mxnet = loss_torch
