"""hvdtrain: one Horovod Trainer for PyTorch and MXNet Gluon.

``import hvdtrain`` imports neither framework nor Horovod; the chosen backend is imported when training starts.
"""
from .basics import __version__
from .callbacks import Callback
from .config import ConfigError, TrainConfig
from .data import ArrayDataset, ShardSampler
from .raylaunch import RayJobFailed, run_on_ray
from .trainer import Trainer
__all__ = ["Trainer", "TrainConfig", "ConfigError", "Callback", "ArrayDataset", "ShardSampler", "run_on_ray",
           "RayJobFailed", "__version__"]
