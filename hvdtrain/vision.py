"""Image datasets for both frameworks, with no framework inside: ImageFolder, MXNet RecordIO, and the ImageNet
transforms, all on PIL and numpy. A sample is (float32 CHW array, int label).

Augmentation is deterministic per (seed, epoch, sample index): every sample draws from its own generator, so results
do not depend on which loader worker decoded it, and a resumed run replays the same crops.

RecordIO is MXNet's format (what GluonCV and Horovod's MXNet example train on), read and written here in pure
Python: each record is ``0xced7230a``, a uint32 whose low 29 bits are the length, the payload padded to 4 bytes; the
payload of an image record is the IRHeader ``<IfQQ`` (flag, label, id, id2) followed by the encoded image. The
``.idx`` file lists ``key<TAB>byte offset`` per line.
"""
from __future__ import annotations

import io
import math
import os
import struct
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")


# AlexNet's PCA lighting noise (Krizhevsky et al. 2012): the eigenvalues and eigenvectors of ImageNet's RGB covariance
# on the 0-255 scale, as GluonCV's RandomLighting and MXNet's ImageRecordIter (pca_noise) use them.
PCA_EIGVAL = np.array([55.46, 4.794, 1.148], np.float32)
PCA_EIGVEC = np.array([[-0.5675, 0.7192, 0.4009], [-0.5808, -0.0045, -0.8140], [-0.5836, -0.6948, 0.4203]],
                      np.float32)
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


def color_jitter(arr: np.ndarray, strength: float, rng: np.random.Generator) -> np.ndarray:
    """Brightness, contrast and saturation of an H x W x 3 float image, each scaled by a factor drawn from
    [1 - strength, 1 + strength], in random order (GluonCV's RandomColorJitter)."""
    for kind in rng.permutation(3):
        alpha = np.float32(1.0 + rng.uniform(-strength, strength))
        if kind == 0:  # brightness
            arr = arr * alpha
        elif kind == 1:  # contrast: towards the image's mean grey
            arr = arr * alpha + np.float32(1 - alpha) * float((arr @ _LUMA).mean())
        else:  # saturation: towards each pixel's grey
            arr = arr * alpha + np.float32(1 - alpha) * (arr @ _LUMA)[..., None]
    return arr


def pca_lighting(arr: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """AlexNet-style lighting noise on an H x W x 3 float image on the 0-255 scale (GluonCV's RandomLighting)."""
    alpha = rng.normal(0.0, std, 3).astype(np.float32)
    return arr + PCA_EIGVEC @ (alpha * PCA_EIGVAL)


class ImageTransform:
    """train: random-resized-crop to ``size`` (area ``min_area``-100% of the image, aspect 3/4-4/3), with ``flip`` a
    horizontal flip, then ``jitter`` (brightness, contrast, saturation) and ``lighting`` (PCA noise) where set; val:
    resize the shorter side to ``resize`` and center-crop ``size``. Then scale to [0, 1] and normalize."""

    def __init__(self, train: bool, size: int = 224, resize: int = 256,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, min_area: float = 0.08,
                 flip: bool = True, jitter: float = 0.0, lighting: float = 0.0):
        self.train, self.size, self.resize = train, size, resize
        self.min_area, self.flip, self.jitter, self.lighting = min_area, flip, jitter, lighting
        self.mean = np.asarray(mean, np.float32).reshape(3, 1, 1)
        self.std = np.asarray(std, np.float32).reshape(3, 1, 1)

    def crop_box(self, w: int, h: int, rng: np.random.Generator) -> Tuple[int, int, int, int]:
        """(x, y, width, height) of a random-resized crop of a ``w`` x ``h`` image: every decoder draws the same."""
        area = w * h
        for _ in range(10):
            target = area * rng.uniform(self.min_area, 1.0)
            aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                return int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1)), cw, ch
        side = min(w, h)  # fallback: the central square
        return (w - side) // 2, (h - side) // 2, side, side

    def _random_resized_crop(self, img, rng: np.random.Generator):
        from PIL import Image
        x, y, cw, ch = self.crop_box(*img.size, rng)
        return img.resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + cw, y + ch))

    def _resize_center_crop(self, img):
        from PIL import Image
        w, h = img.size
        scale = self.resize / min(w, h)
        img = img.resize((max(self.size, round(w * scale)), max(self.size, round(h * scale))), Image.BILINEAR)
        w, h = img.size
        x, y = (w - self.size) // 2, (h - self.size) // 2
        return img.crop((x, y, x + self.size, y + self.size))

    normalize_on_device = None
    """(mean, std) when the transform hands out uint8 pixels that the backend normalizes on the device."""

    def load(self, data: bytes, name: str):
        """The decoded image that :meth:`__call__` takes, from the file's bytes."""
        return decode_image(data, name)

    def __call__(self, img, rng: Optional[np.random.Generator]) -> np.ndarray:
        from PIL import Image
        if self.train:
            img = self._random_resized_crop(img, rng)
            if rng.random() < 0.5 and self.flip:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            img = self._resize_center_crop(img)
        arr = np.asarray(img, dtype=np.float32)
        if self.train and self.jitter:
            arr = color_jitter(arr, self.jitter, rng)
        if self.train and self.lighting:
            arr = pca_lighting(arr, self.lighting, rng)
        arr = arr.transpose(2, 0, 1) / 255.0
        return (arr - self.mean) / self.std


class TurboTransform(ImageTransform):
    """:class:`ImageTransform`'s augmentation, about 2.3x faster per core on ImageNet-sized JPEGs (docs/data-at-scale.md):
    JPEGs decoded by libjpeg-turbo through simplejpeg with its fast integer DCT and plain chroma upsampling (other
    formats by PIL), the same crop boxes and flips drawn from the same generator, the crop resized by OpenCV
    (area-averaging when it shrinks, bilinear when it enlarges), and uint8 CHW pixels handed out: the backend scales
    and normalizes them on the device (a quarter of the bytes to move, and no float work in the loader). Colour
    jitter and lighting, where set, are computed in float and rounded back to uint8."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.normalize_on_device = (tuple(self.mean.ravel().tolist()), tuple(self.std.ravel().tolist()))

    def load(self, data: bytes, name: str) -> np.ndarray:
        return decode_rgb(data, name)

    def _resize(self, arr: np.ndarray, width: int, height: int) -> np.ndarray:
        import cv2
        if cv2.getNumThreads() != 1:  # one thread per loader process: the processes are the parallelism
            cv2.setNumThreads(1)
        shrink = width * height < arr.shape[0] * arr.shape[1]
        return cv2.resize(arr, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)

    def __call__(self, arr: np.ndarray, rng: Optional[np.random.Generator]) -> np.ndarray:
        h, w = arr.shape[:2]
        if self.train:
            x, y, cw, ch = self.crop_box(w, h, rng)
            arr = self._resize(arr[y:y + ch, x:x + cw], self.size, self.size)
            if rng.random() < 0.5 and self.flip:
                arr = arr[:, ::-1]
            if self.jitter or self.lighting:
                f = arr.astype(np.float32)
                if self.jitter:
                    f = color_jitter(f, self.jitter, rng)
                if self.lighting:
                    f = pca_lighting(f, self.lighting, rng)
                arr = np.clip(np.rint(f), 0, 255).astype(np.uint8)
        else:
            scale = self.resize / min(w, h)
            arr = self._resize(arr, max(self.size, round(w * scale)), max(self.size, round(h * scale)))
            h, w = arr.shape[:2]
            x, y = (w - self.size) // 2, (h - self.size) // 2
            arr = arr[y:y + self.size, x:x + self.size]
        return np.ascontiguousarray(arr.transpose(2, 0, 1))


class EncodedImages:
    """Images still encoded, with what the device needs to finish them: each one's bytes, its crop box in the
    stored image (x, y, width, height) and whether to flip it, the side ``size`` the crops are resized to; or, with
    ``resize``, no box: the image's shorter side resized to ``resize``, then its centre ``size`` cropped (validation).
    A sample holds one image, a batch (:meth:`DeviceDecodeTransform.collate`) several. ``shape`` and ``dtype``
    describe one finished image (C x H x W float), for a model that needs a sample's shape before training."""

    dtype = np.float32

    def __init__(self, data: List[bytes], boxes: np.ndarray, flips: np.ndarray, size: int, names: List[str],
                 resize: int = 0):
        self.data, self.boxes, self.flips, self.size, self.names = data, boxes, flips, size, names
        self.resize = resize
        self.shape = (3, size, size)

    def __len__(self) -> int:
        return len(self.data)


def image_size(data: bytes, name: str) -> Tuple[int, int]:
    """(width, height) of an encoded image from its header, without decoding it."""
    from PIL import Image
    try:
        return Image.open(io.BytesIO(data)).size
    except Exception as e:  # noqa: BLE001 - PIL raises many types; all mean the same to the user
        raise RuntimeError(f"cannot decode image {name}: {type(e).__name__}: {e}") from None


class DeviceDecodeTransform(ImageTransform):
    """``--decoder device``: the loader only reads the file and draws the crop box and flip (the same draws as
    :class:`ImageTransform`'s, from the same generator); the backend decodes the batch on its device (nvJPEG through
    torchvision on a GPU, libjpeg-turbo on the CPU: the CPU stand-in that the tests run), then crops, resizes
    (bilinear, antialiased), flips and normalizes there; validation images are resized and centre-cropped there. No
    colour jitter or lighting."""

    decode_on_device = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.normalize_on_device = (tuple(self.mean.ravel().tolist()), tuple(self.std.ravel().tolist()))

    def load(self, data: bytes, name: str):
        return data, name

    def __call__(self, loaded, rng: Optional[np.random.Generator]) -> EncodedImages:
        data, name = loaded
        w, h = image_size(data, name)
        if not self.train:
            return EncodedImages([data], np.asarray([(0, 0, w, h)], np.int32), np.asarray([False]), self.size,
                                 [name], resize=self.resize)
        box = self.crop_box(w, h, rng)
        flip = bool(rng.random() < 0.5 and self.flip)
        return EncodedImages([data], np.asarray([box], np.int32), np.asarray([flip]), self.size, [name])

    @staticmethod
    def collate(samples):
        """A batch of (EncodedImages, label) samples: one EncodedImages and the labels' array."""
        images = [s[0] for s in samples]
        return (EncodedImages([d for i in images for d in i.data], np.concatenate([i.boxes for i in images]),
                              np.concatenate([i.flips for i in images]), images[0].size,
                              [n for i in images for n in i.names], images[0].resize),
                np.asarray([s[1] for s in samples]))


def image_transform(decoder: str, *args, **kwargs) -> ImageTransform:
    """The transform of ``--decoder``: ``pil`` (:class:`ImageTransform`), ``turbo`` (:class:`TurboTransform`) or
    ``device`` (:class:`DeviceDecodeTransform`)."""
    return {"pil": ImageTransform, "turbo": TurboTransform, "device": DeviceDecodeTransform}[decoder](*args, **kwargs)


def decode_rgb(data: bytes, name: str) -> np.ndarray:
    """An H x W x 3 uint8 RGB array: a JPEG by libjpeg-turbo (simplejpeg: fast DCT, plain chroma upsampling), any
    other image, or a JPEG simplejpeg cannot read (CMYK, arithmetic coding), by PIL, which names a corrupt one."""
    import simplejpeg
    if data[:2] == b"\xff\xd8":
        try:
            return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=True)
        except ValueError:
            pass
    return np.asarray(decode_image(data, name))


def decode_image(data_or_path, name: str):
    """An RGB PIL image; an unreadable or corrupt image raises an error that names it."""
    from PIL import Image
    try:
        img = Image.open(io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path)
        img.load()
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises many types; all mean the same to the user
        raise RuntimeError(f"cannot decode image {name}: {type(e).__name__}: {e}") from None


class AugmentedImages:
    """Per-sample generators from (seed, epoch, index); ``set_epoch`` is called by the Trainer."""

    seed: int = 0
    epoch: int = 0
    transform: Optional[Callable] = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, index])

    @property
    def normalize_on_device(self):
        """(mean, std): the samples' images are uint8 pixels for the backend to normalize on the device."""
        return getattr(self.transform, "normalize_on_device", None)

    @property
    def collate(self):
        """How a batch of samples is put together, where the transform says (None: the loader's default)."""
        return getattr(self.transform, "collate", None)

    def _finish(self, data: bytes, name: str, label: int, index: int):
        if self.transform is None:
            return np.asarray(decode_image(data, name)), label
        return self.transform(self.transform.load(data, name), self._rng(index)), label


class ImageFolder(AugmentedImages):
    """``root/CLASS/*.jpg``: classes are the sorted subdirectory names, samples sorted by path within a class."""

    def __init__(self, root: str, transform: Optional[Callable] = None, seed: int = 0):
        self.root, self.transform, self.seed = root, transform, seed
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.samples: List[Tuple[str, int]] = []
        for label, cls in enumerate(self.classes):
            for dirpath, _, files in sorted(os.walk(os.path.join(root, cls))):
                for name in sorted(files):
                    if name.lower().endswith(EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, name), label))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return self._finish(f.read(), path, label, index)


# --- RecordIO --------------------------------------------------------------------------------------------------------
_MAGIC = 0xCED7230A
_IR_FORMAT = "<IfQQ"
_IR_SIZE = struct.calcsize(_IR_FORMAT)


def pack_image_record(label: float, image_bytes: bytes, key: int) -> bytes:
    return struct.pack(_IR_FORMAT, 0, float(label), key, 0) + image_bytes


def write_record(f, payload: bytes) -> None:
    f.write(struct.pack("<II", _MAGIC, len(payload)))
    f.write(payload)
    f.write(b"\x00" * ((4 - len(payload) % 4) % 4))


def read_record(f, offset: int, name: str, limit: Optional[int] = None) -> bytes:
    """The payload of the record at ``offset`` (only its first ``limit`` bytes, when given)."""
    f.seek(offset)
    head = f.read(8)
    if len(head) < 8:
        raise RuntimeError(f"{name}: record at byte {offset} is past the end of the file")
    magic, lrec = struct.unpack("<II", head)
    if magic != _MAGIC:
        raise RuntimeError(f"{name}: no RecordIO record at byte {offset} (bad magic); is the .idx from this .rec?")
    if lrec >> 29:
        raise RuntimeError(f"{name}: multi-part record at byte {offset} is not supported")
    size = lrec & ((1 << 29) - 1)
    want = size if limit is None else min(size, limit)
    payload = f.read(want)
    if len(payload) != want:
        raise RuntimeError(f"{name}: record at byte {offset} is truncated")
    return payload


def unpack_image_record(payload: bytes) -> Tuple[float, int, bytes]:
    flag, label, key, _ = struct.unpack(_IR_FORMAT, payload[:_IR_SIZE])
    body = payload[_IR_SIZE:]
    if flag > 0:  # label is an array of `flag` floats; the first is the class
        label = struct.unpack(f"<{flag}f", body[:4 * flag])[0]
        body = body[4 * flag:]
    return label, key, body


def recordio_num_classes(rec_path: str, idx_path: str) -> int:
    """1 + the largest class label among an indexed RecordIO file's records, reading each record's header only."""
    top = -1
    with open(rec_path, "rb") as f:
        for _key, offset in read_index(idx_path):
            head = read_record(f, offset, rec_path, limit=_IR_SIZE + 4)  # the header and a first array label
            flag, label, _, _ = struct.unpack(_IR_FORMAT, head[:_IR_SIZE])
            if flag > 0:  # an array of labels: the first is the class
                label = struct.unpack("<f", head[_IR_SIZE:_IR_SIZE + 4])[0]
            top = max(top, int(label))
    return top + 1


def read_index(idx_path: str) -> List[Tuple[int, int]]:
    out = []
    with open(idx_path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) != 2:
                raise RuntimeError(f"{idx_path}:{n}: expected 'key<TAB>offset'")
            out.append((int(parts[0]), int(parts[1])))
    return out


class RecordIODataset(AugmentedImages):
    """Random access to an indexed RecordIO file (``.rec`` + ``.idx``), in the order of the records' keys.

    ``train`` and the transform's ``size`` / ``resize`` also tell the MXNet backend how to build its C++
    ``ImageRecordIter`` for training (sharded with num_parts/part_index)."""

    def __init__(self, rec_path: str, idx_path: str, transform: Optional[ImageTransform] = None, seed: int = 0):
        self.rec_path, self.idx_path, self.transform, self.seed = rec_path, idx_path, transform, seed
        self.index = sorted(read_index(idx_path))  # key order: the ImageFolder's sample order (write_recordio)
        self._file = None
        self._pid = None

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):  # loader workers open their own file handle
        state = dict(self.__dict__)
        state["_file"] = None
        return state

    def read(self, index: int) -> Tuple[float, bytes]:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.rec_path, "rb"), os.getpid()
        key, offset = self.index[index]
        label, _, body = unpack_image_record(read_record(self._file, offset, self.rec_path))
        return label, body

    def stored_sizes(self, samples: int = 64) -> set:
        """(width, height) of up to ``samples`` images spread over the file, from their headers (no decoding)."""
        from PIL import Image
        picks = np.unique(np.linspace(0, len(self) - 1, num=min(samples, len(self))).astype(int))
        return {Image.open(io.BytesIO(self.read(int(i))[1])).size for i in picks}

    def __getitem__(self, index: int):
        label, body = self.read(index)
        key = self.index[index][0]
        return self._finish(body, f"{self.rec_path} record {key}", int(label), index)


def write_recordio(folder: ImageFolder, prefix: str, max_side: int = 0, quality: int = 95, seed: int = 0) -> int:
    """Pack an ImageFolder into ``prefix.rec`` / ``prefix.idx`` (labels by class index). Images are stored as their
    original bytes, or re-encoded as JPEG with the longer side capped at ``max_side`` when it is set.

    The records are written in a shuffled order (fixed by ``seed``), as im2rec does: MXNet's ImageRecordIter gives
    each rank a contiguous part of the file (num_parts/part_index) and shuffles only within it, so records in class
    order would give each rank only some of the classes. Each record's key is still its sample index in the
    ImageFolder, and RecordIODataset reads in key order, so both formats give the same sample for the same index."""
    tmp_rec, tmp_idx = prefix + ".rec.tmp", prefix + ".idx.tmp"
    try:
        _write_records(folder, tmp_rec, tmp_idx, max_side, quality, seed)
    except BaseException:
        for tmp in (tmp_rec, tmp_idx):
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    os.replace(tmp_rec, prefix + ".rec")
    os.replace(tmp_idx, prefix + ".idx")
    return len(folder.samples)


def _write_records(folder: ImageFolder, rec_path: str, idx_path: str, max_side: int, quality: int,
                   seed: int) -> None:
    from PIL import Image
    order = np.random.default_rng(seed).permutation(len(folder.samples))
    with open(rec_path, "wb") as rec, open(idx_path, "w") as idx:
        for key in order.tolist():
            path, label = folder.samples[key]
            if max_side:
                img = decode_image(path, path)
                img.thumbnail((max_side, max_side), Image.BILINEAR)
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=quality)
                data = buf.getvalue()
            else:
                with open(path, "rb") as f:
                    data = f.read()
                decode_image(data, path)  # refuse a corrupt image now, not in the middle of training
            idx.write(f"{key}\t{rec.tell()}\n")
            write_record(rec, pack_image_record(label, data, key))
