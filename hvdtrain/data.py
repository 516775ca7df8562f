"""Framework-free data plumbing shared by both backends: index sharding and in-memory array datasets.

Horovod deadlocks when ranks run different numbers of steps (horovod#708, #832), so the training sampler pads the
index list to a multiple of the world size (as torch's DistributedSampler does): every rank gets exactly
``ceil(n / size)`` indices and therefore the same number of batches. Evaluation shards are not padded — each rank
evaluates a disjoint part and the sums are allreduced once, so no sample is counted twice.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import numpy as np


class ShardSampler:
    """This rank's share of ``range(n)``: shuffled per epoch from a seed every rank knows, then split by rank.

    Works as the ``sampler`` of a torch DataLoader and of a Gluon DataLoader alike.
    """

    def __init__(self, n: int, rank: int, size: int, shuffle: bool = True, seed: int = 0, pad: bool = True):
        if n <= 0:
            raise ValueError("cannot shard an empty dataset")
        self.n, self.rank, self.size = n, rank, size
        self.shuffle, self.seed, self.pad = shuffle, seed, pad
        self.epoch = 0

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        """Reshuffle for ``epoch``: the same permutation on every rank, a different one each epoch. ``offset``
        skips the first samples of the epoch's order: those the job consumed before a resume, whatever the world
        size was then (step i of every rank together consumes positions [i*B*size, (i+1)*B*size) of the order)."""
        self.epoch, self.offset = epoch, offset

    offset: int = 0

    def indices(self) -> np.ndarray:
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.n) if self.shuffle
                 else np.arange(self.n))[self.offset:]
        if self.pad and len(order):
            total = math.ceil(len(order) / self.size) * self.size
            if total > len(order):  # repeat from the start, as DistributedSampler does
                order = np.concatenate([order, np.resize(order, total - len(order))])
        return order[self.rank::self.size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        n = max(self.n - self.offset, 0)
        if self.pad:
            return math.ceil(n / self.size)
        return len(range(self.rank, n, self.size))


class ArrayDataset:
    """Samples held as equally long numpy arrays (e.g. images and labels); indexable by one index or an array.

    ``transform``, when given, maps the tuple of arrays of a batch to a new tuple (e.g. random crops of the
    images); it runs on numpy, so the same augmentation serves both frameworks.
    """

    def __init__(self, *arrays: np.ndarray, transform: Optional[Callable[..., Tuple[np.ndarray, ...]]] = None):
        if not arrays or any(len(a) != len(arrays[0]) for a in arrays):
            raise ValueError("ArrayDataset needs arrays of equal length")
        self.arrays = arrays
        self.transform = transform

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, index) -> Tuple[np.ndarray, ...]:
        items = tuple(a[index] for a in self.arrays)
        return self.transform(*items) if self.transform is not None else items


def array_batches(dataset: ArrayDataset, indices: Sequence[int], batch_size: int,
                  drop_last: bool) -> Iterator[Tuple[np.ndarray, ...]]:
    """Batches of an in-memory dataset by fancy indexing: no per-sample Python, no worker processes."""
    indices = np.asarray(indices)
    stop = len(indices) - (len(indices) % batch_size if drop_last else 0)
    for start in range(0, stop, batch_size):
        yield dataset[indices[start:start + batch_size]]


def pixel_normalization(dataset: Any) -> Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]]:
    """(mean, std) when ``dataset``'s samples begin with uint8 pixels (C x H x W, 0-255) for the backend to scale to
    [0, 1] and normalize on the device, ``(x / 255 - mean) / std`` per channel; None for samples that arrive ready."""
    return getattr(dataset, "normalize_on_device", None)


def decodes_on_device(dataset: Any) -> bool:
    """Whether ``dataset``'s images reach the backend still encoded, for it to decode on its device
    (``--decoder device``: :class:`hvdtrain.vision.DeviceDecodeTransform`)."""
    return bool(getattr(getattr(dataset, "transform", None), "decode_on_device", False))


def split_batch(batch: Any) -> Tuple[Tuple[Any, ...], Any]:
    """A batch as (the model's inputs, the target): a tuple or list ``(input, ..., target)`` — the last element is
    the target, the others the model's positional inputs — or a dict whose ``"target"`` entry is the target and whose
    other entries, in order, are the inputs. A Trainer overrides ``split_batch`` for any other structure."""
    if isinstance(batch, dict):
        if "target" not in batch:
            raise ValueError(f"a dict batch needs a 'target' entry (it has {sorted(batch)}); or override "
                             f"Trainer.split_batch")
        return tuple(v for k, v in batch.items() if k != "target"), batch["target"]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    raise ValueError(f"a batch must be (input, ..., target) or a dict with a 'target' entry, got "
                     f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else f' of {len(batch)}'}; "
                     f"or override Trainer.split_batch")


def map_arrays(fn: Callable[[Any], Any], batch: Any) -> Any:
    """``fn`` applied to every array of a batch of tuples, lists and dicts, keeping its structure."""
    if isinstance(batch, dict):
        return {k: map_arrays(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_arrays(fn, v) for v in batch)
    return fn(batch)


def steps_per_epoch(shard_len: int, batch_size: int) -> int:
    """Full batches in one rank's shard; the same on every rank because the shards are padded to equal length."""
    return shard_len // batch_size


class Synthetic:
    """Random samples of a fixed shape, generated once on the device by the backend (``--synthetic``)."""

    def __init__(self, n: int, shape: Tuple[int, ...], num_classes: int):
        self.n, self.shape, self.num_classes = n, tuple(shape), num_classes

    def __len__(self) -> int:
        return self.n
