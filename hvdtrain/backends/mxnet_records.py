"""MXNet's C++ RecordIO reader (ImageRecordIter) as the MXNet backend uses it: which record files it reads, the
batches of this rank's part of them with the ImageNet recipe's augmentation, and the MXNet 1.9.1 crop defect that
sends records stored at the training size to hvdtrain's own decoder instead.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterable, Iterator

import numpy as np

from ..config import ConfigError
from ..vision import RecordIODataset


class MXNetRecords:
    """The record path of one rank: ``to_device`` turns (data, label) NDArrays into the backend's batch."""

    def __init__(self, mx, rank: int, size: int, to_device: Callable[[Any], Any]):
        self.mx, self.rank, self.size, self.to_device = mx, rank, size, to_device
        self._crop_defects: Dict[str, bool] = {}

    def check(self, train_set: Any, cfg) -> None:
        """Say once where the crop defect sends the records to hvdtrain's decoder; refuse settings the C++ reader
        cannot honour."""
        if self.crop_defect(train_set) and self.rank == 0:
            t = train_set.transform
            print(f"hvdtrain: {train_set.rec_path} stores its images at the training size ({t.size}x{t.size}), where "
                  f"MXNet 1.9.1's ImageRecordIter corrupts random-resized crops (it resizes the crop into the buffer "
                  f"it reads from); reading it with hvdtrain's decoder instead, the PyTorch backend's pipeline. "
                  f"Records stored larger than --image-size use the C++ reader", file=sys.stderr, flush=True)
        if self.reads(train_set) and cfg.checkpoint_every_steps:
            raise ConfigError("--checkpoint-every-steps is not available when MXNet trains from RecordIO: its C++ "
                              "ImageRecordIter shuffles and augments in threads of its own, so a position inside an "
                              "epoch cannot be replayed on resume; checkpoint at epoch ends (the default), or train "
                              "from an ImageFolder (--data-format imagefolder)")

    def reads(self, dataset: Any) -> bool:
        """True for a training set that MXNet reads with its C++ ImageRecordIter (not one decoded to uint8 pixels
        by hvdtrain's turbo decoder, which reads the records itself, as on PyTorch)."""
        return (isinstance(dataset, RecordIODataset) and dataset.transform is not None and dataset.transform.train
                and dataset.normalize_on_device is None and not self.crop_defect(dataset))

    def crop_defect(self, dataset: Any) -> bool:
        """Whether the records hold images of exactly the training size (sampled headers, once per file). There
        MXNet 1.9.1's ImageRecordIter writes the resized crop into the image it is cropping from (cv::resize into a
        destination of the same size reuses its buffer, src/io/image_aug_default.cc): measured, 46% of the crops of
        32 px images trained at 32 px fell outside the configured area and aspect range, none at 33 px or more."""
        if not (isinstance(dataset, RecordIODataset) and dataset.transform is not None and dataset.transform.train):
            return False
        cache = self._crop_defects
        if dataset.rec_path not in cache:
            size = dataset.transform.size
            cache[dataset.rec_path] = (size, size) in dataset.stored_sizes()
        return cache[dataset.rec_path]

    def batches(self, dataset: RecordIODataset, sampler: Iterable[int], batch_size: int,
                threads: int) -> Iterator[Any]:
        """This rank's training batches of an epoch (``sampler``: its sample indices, for their count)."""
        if getattr(sampler, "offset", 0) and self.rank == 0:
            print("hvdtrain: warning: resuming inside an epoch from RecordIO on MXNet: the rest of the epoch reads "
                  "the record file in a fresh order (the C++ reader's order and augmentation cannot be replayed)",
                  file=sys.stderr, flush=True)
        return self.iterate(dataset, len(sampler) // batch_size, batch_size, threads)

    def iterate(self, dataset: RecordIODataset, steps: int, batch_size: int, threads: int) -> Iterator[Any]:
        """Training batches from MXNet's C++ ImageRecordIter, this rank's part of the file (num_parts/part_index),
        with the same augmentation as ImageTransform; exactly ``steps`` batches (the iterator restarts if a short
        part runs out), so every rank runs the same number of steps."""
        mx, t = self.mx, dataset.transform
        mean, std = (255 * np.asarray(t.mean).ravel()), (255 * np.asarray(t.std).ravel())
        it = mx.io.ImageRecordIter(
            path_imgrec=dataset.rec_path, path_imgidx=dataset.idx_path, data_shape=(3, t.size, t.size),
            batch_size=batch_size, shuffle=True, seed=dataset.seed + dataset.epoch,
            # Crops, flips and colours from (--seed, epoch, rank): without it the same stream every epoch and rank.
            seed_aug=int(np.random.SeedSequence([dataset.seed, dataset.epoch, self.rank]).generate_state(1)[0] >> 1),
            # Horovod: each rank reads its own part of the record file.
            num_parts=self.size, part_index=self.rank,
            random_resized_crop=True, min_random_area=t.min_area, max_random_area=1.0,
            min_aspect_ratio=3 / 4, max_aspect_ratio=4 / 3, rand_mirror=t.flip,
            # The same colour augmentation, MXNet's C++ implementation of it.
            brightness=t.jitter, contrast=t.jitter, saturation=t.jitter, pca_noise=t.lighting,
            mean_r=mean[0], mean_g=mean[1], mean_b=mean[2], std_r=std[0], std_g=std[1], std_b=std[2],
            preprocess_threads=threads, round_batch=True)
        done = 0
        while done < steps:
            before = done
            for batch in it:
                if done == steps:
                    break
                yield self.to_device((batch.data[0], batch.label[0]))
                done += 1
            if done == before:
                raise RuntimeError(f"{dataset.rec_path}: part {self.rank} of {self.size} holds no records")
            it.reset()
