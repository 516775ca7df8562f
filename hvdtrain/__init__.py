"""hvdtrain: one Horovod Trainer for PyTorch and MXNet Gluon.

``import hvdtrain`` imports neither framework nor Horovod; the chosen backend is imported when training starts.
"""
from .basics import __version__
from .callbacks import Callback
from .config import ConfigError, TrainConfig
from .data import ArrayDataset, ShardSampler
from .trainer import Trainer
__all__ = ["Trainer", "TrainConfig", "ConfigError", "Callback", "ArrayDataset", "ShardSampler", "__version__"]
