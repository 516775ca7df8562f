"""MNIST: a small CNN on the standard IDX files, on PyTorch or MXNet Gluon.

Data: ``--data-dir`` holds the four MNIST files (optionally gzipped) as published at
http://yann.lecun.com/exdb/mnist/. ``scripts/make_digits_mnist.py DIR`` writes an embedded stand-in with no download:
scikit-learn's 1,797 real handwritten digits, upsampled to 28x28, in the same format.
"""
from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from typing import Literal, Tuple

import numpy as np

from hvdtrain import ArrayDataset, ConfigError, TrainConfig, Trainer
from hvdtrain.config import BASE_LRS

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MEAN, STD = 0.1307, 0.3081  # of the MNIST training images, scaled to [0, 1]

# IDX: magic = 0x0000 | dtype code | number of dimensions, then one big-endian uint32 per dimension.
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str) -> np.ndarray:
    """An IDX file (``.gz`` too) as a numpy array; ValueError naming the file when it is not valid IDX."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    dtype, ndim = np.dtype(_IDX_DTYPES[data[2]]), data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = data[4 + 4 * ndim:]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(body) != expected:
        raise ValueError(f"{path} is truncated or padded: {len(body)} data bytes, header says {expected}")
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def write_idx(path: str, array: np.ndarray) -> None:
    """Write a uint8 array in IDX format (the MNIST layout)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(bytes([0, 0, 0x08, array.ndim]))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.tobytes())


def random_shift(images: np.ndarray, labels: np.ndarray, max_shift: int = 2):
    """Translate each image by up to ``max_shift`` pixels in x and y (numpy's global RNG, seeded per epoch)."""
    if images.ndim != 4 or max_shift <= 0:
        return images, labels
    n, _, h, w = images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (max_shift, max_shift), (max_shift, max_shift)),
                    constant_values=float(images.min()))
    dy, dx = np.random.randint(0, 2 * max_shift + 1, size=(2, n))
    out = np.empty_like(images)
    for i in range(n):
        out[i] = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
    return out, labels


def find_file(data_dir: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    return ""


def random_flip(images: np.ndarray, labels: np.ndarray):
    """Mirror each image left-right with probability 1/2 (numpy's global RNG, seeded per step)."""
    flip = np.random.random(len(images)) < 0.5
    out = images.copy()
    out[flip] = images[flip][..., ::-1]
    return out, labels


def load_split(data_dir: str, images: str, labels: str, mean: float = MEAN,
               std: float = STD) -> Tuple[np.ndarray, np.ndarray]:
    x = read_idx(find_file(data_dir, FILES[images]))
    y = read_idx(find_file(data_dir, FILES[labels]))
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(f"{data_dir}: {FILES[images]} has shape {x.shape} and {FILES[labels]} {y.shape}; "
                          f"expected (N, rows, cols) images and N labels")
    x = ((x.astype(np.float32) / 255.0 - mean) / std)[:, None, :, :]
    return x, y.astype(np.int64)


@dataclass
class MNISTConfig(TrainConfig):
    """MNIST defaults: 2 workers reach >= 97% on the embedded digits in a few seconds per epoch.

    An override without a docstring keeps TrainConfig's help text.
    """

    epochs: int = 20
    batch_size: int = 32
    base_lrs = {**BASE_LRS, "sgd": 0.03}
    warmup_epochs: float = 1.0
    lr_mode: Literal["step", "cosine", "poly", "constant"] = "cosine"
    data_dir: str = "data/digits"
    """Directory with the four MNIST IDX files (scripts/make_digits_mnist.py DIR writes the embedded digits)."""
    hidden: int = 128
    """Units of the hidden fully connected layer."""
    dropout: float = 0.25
    """Dropout before the classifier."""
    max_shift: int = 2
    """Training augmentation: random translation of up to this many pixels (0: none)."""
    flip: bool = False
    """Training augmentation: mirror images left-right at random (right for clothes, wrong for digits)."""
    batch_norm: bool = False
    """BatchNorm after each convolution."""

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.hidden < 1:
            raise ConfigError(f"--hidden must be at least 1, got {self.hidden}")


class MNISTTrainer(Trainer):
    """A small CNN on MNIST IDX files (PyTorch or MXNet)."""

    name = "mnist"
    config_class = MNISTConfig
    input_shape = (1, 28, 28)
    num_classes = 10
    sample_unit = "images"
    mean, std = MEAN, STD
    """Normalisation of the [0, 1] pixel values: the training set's mean and standard deviation."""
    data_hint = ("MNIST IDX files, optionally .gz, published at http://yann.lecun.com/exdb/mnist/; or write the "
                 "embedded digits with 'python scripts/make_digits_mnist.py {data_dir}'")
    """Where to get the data, for the error when --data-dir lacks it."""

    def check(self) -> None:
        super().check()
        cfg = self.cfg
        if cfg.synthetic:
            return
        missing = [stem for stem in FILES.values() if not find_file(cfg.data_dir, stem)]
        if missing:
            where = f"--data-dir {cfg.data_dir}" if os.path.isdir(cfg.data_dir) else \
                f"--data-dir {cfg.data_dir} does not exist and"
            raise ConfigError(f"{where} lacks {', '.join(missing)} ({self.data_hint.format(data_dir=cfg.data_dir)})")

    def preprocessing(self):
        return {"image": "28 x 28 grayscale, one channel", "scale": "pixel / 255", "mean": [self.mean],
                "std": [self.std], "layout": "N x 1 x 28 x 28"}

    def datasets(self):
        try:
            train = load_split(self.cfg.data_dir, "train_images", "train_labels", self.mean, self.std)
            test = load_split(self.cfg.data_dir, "test_images", "test_labels", self.mean, self.std)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        shift, flip = self.cfg.max_shift, self.cfg.flip

        def augment(x, y):
            x, y = random_shift(x, y, shift)
            return random_flip(x, y) if flip else (x, y)
        return ArrayDataset(*train, transform=augment), ArrayDataset(*test)

    def build_torch(self):
        from torch import nn
        cfg = self.cfg
        norm = (lambda c: [nn.BatchNorm2d(c)]) if cfg.batch_norm else (lambda c: [])
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), *norm(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), *norm(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, cfg.hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, self.num_classes))

    def build_mxnet(self):
        from mxnet.gluon import nn
        cfg = self.cfg
        # Layer for layer the PyTorch model (one block per operation, in the same order), so that both name their
        # parameters alike ('0.weight', '9.weight'): a run of either framework exports to the other and to ONNX.
        net = nn.HybridSequential()
        norm = (lambda: [nn.BatchNorm(momentum=0.9, epsilon=1e-5)]) if cfg.batch_norm else (lambda: [])
        for channels in (32, 64):  # BatchNorm with PyTorch's BatchNorm2d defaults: momentum 0.1 (Gluon's 0.9), eps 1e-5
            net.add(nn.Conv2D(channels, 3, padding=1), *norm(), nn.Activation("relu"), nn.MaxPool2D(2))
        net.add(nn.Flatten(), nn.Dense(cfg.hidden), nn.Activation("relu"), nn.Dropout(cfg.dropout),
                nn.Dense(self.num_classes))
        return net
