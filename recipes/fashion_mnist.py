"""Fashion-MNIST: 70,000 28x28 grey photos of clothes in 10 classes (Zalando Research), MNIST's format and size but
far from solved by a small network: the real-data recipe of ``make demo``.

Data: ``--data-dir`` holds the four IDX files (optionally gzipped). Debian's package ``dataset-fashion-mnist`` installs
them under /usr/share/datasets/fashion-mnist/, the default here (``make data-fashion`` installs it as root); they are
also published at https://github.com/zalandoresearch/fashion-mnist. Reference accuracies from that project's
benchmark: two-convolution networks 87.6-91.6%, ResNet-18 94.9%.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hvdtrain.config import BASE_LRS
from recipes.mnist import MNISTConfig, MNISTTrainer

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot")


@dataclass
class FashionMNISTConfig(MNISTConfig):
    """Fashion-MNIST defaults: the MNIST network with BatchNorm and a wider hidden layer, mirrored and shifted
    training images, cosine decay."""

    epochs: int = 15
    batch_size: int = 64
    base_lrs = {**BASE_LRS, "sgd": 0.05}
    warmup_epochs: float = 1.0
    lr_mode: Literal["step", "cosine", "poly", "constant"] = "cosine"
    weight_decay: float = 5e-4
    data_dir: str = FASHION_DIR
    """Directory with the four Fashion-MNIST IDX files (Debian's dataset-fashion-mnist puts them here)."""
    hidden: int = 256
    dropout: float = 0.3
    flip: bool = True
    batch_norm: bool = True


class FashionMNISTTrainer(MNISTTrainer):
    """A small CNN on Fashion-MNIST (PyTorch or MXNet)."""

    name = "fashion-mnist"
    config_class = FashionMNISTConfig
    mean, std = 0.2860, 0.3530  # of the Fashion-MNIST training images, scaled to [0, 1]
    data_hint = ("the Fashion-MNIST IDX files, optionally .gz: 'apt-get install dataset-fashion-mnist' (Debian, "
                 "Ubuntu) puts them in " + FASHION_DIR + ", or download them from "
                 "https://github.com/zalandoresearch/fashion-mnist")
