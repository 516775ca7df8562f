"""ImageNet with ResNet: the large-batch recipe of Goyal et al. on PyTorch or MXNet Gluon.

    horovodrun -np 16 -H server1:4,server2:4,server3:4,server4:4 \\
        python -m hvdtrain recipe imagenet --framework mxnet --data-dir /data/imagenet

Data (``--data-format``, one flag for both frameworks):
  imagefolder  DIR/train/CLASS/*.JPEG and DIR/val/CLASS/*.JPEG, decoded in loader workers;
  recordio     DIR/train.rec + train.idx and DIR/val.rec + val.idx (scripts/make_recordio.py builds them); MXNet
               trains from them with its C++ ImageRecordIter, one part per rank;
  shards       DIR/index.json and WebDataset tar shards (python -m hvdtrain data pack builds them); DIR may be a URL
               (s3://bucket/prefix, any fsspec protocol), streamed into a per-host cache (docs/data-at-scale.md);
  auto         shards for a URL or a DIR with index.json, imagefolder when DIR/train/ exists, else recordio.
Decoding (``--decoder``): pil (PIL, float arrays), turbo (libjpeg-turbo and OpenCV, uint8 pixels normalized on the
device: about 2.2x the images per core), or device (PyTorch: decoded on the GPU by nvJPEG).
Models: GluonCV's model zoo on MXNet; the same architectures written with torchvision's names on PyTorch.
Schedule: lr 0.1 per 256 images of global batch, 5 warmup epochs, step decay at 30/60/80 (or --lr-mode cosine),
momentum 0.9, weight decay 1e-4. A full run should reach GluonCV's published 77.67% top-1 for ResNet50_v1b.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal, Tuple

from hvdtrain import ConfigError, TrainConfig, Trainer
from hvdtrain.basics import is_url
from hvdtrain.shards import INDEX, ShardedImages, ShardStore
from hvdtrain.vision import (IMAGENET_MEAN, IMAGENET_STD, ImageFolder, RecordIODataset, image_transform,
                             recordio_num_classes)

# --model -> (architecture of recipes.resnet_torch, stride in the first 1x1 convolution: ResNet v1)
MODELS = {"resnet50_v1b": ("resnet50", False), "resnet50_v1": ("resnet50", True),
          "resnet18_v1b": ("resnet18", False), "resnet101_v1b": ("resnet101", False)}


@dataclass
class ImageNetConfig(TrainConfig):
    """ImageNet defaults: Goyal et al.'s schedule, per-worker batch 32."""

    epochs: int = 90
    batch_size: int = 32
    base_lr: float = 0.0
    """Learning rate for one worker and one micro-batch (0: --lr-per-256 x batch-size / 256)."""
    lr_per_256: float = 0.0
    """Learning rate per 256 images of global batch, used when --base-lr is 0 (0: the rate of --optimizer: sgd 0.1
    (Goyal et al.), adam and adamw 2.5e-4 (DeiT: 5e-4 per 512), lamb 6.25e-4 (timm's ResNet strikes back A1: 5e-3 at
    2048), lars 0.8 (MLPerf's ResNet-50 on MXNet: 10.5 at 3264))."""
    warmup_epochs: float = 5.0
    lr_mode: Literal["step", "cosine", "poly", "constant"] = "step"
    lr_milestones: Tuple[int, ...] = (30, 60, 80)
    weight_decay: float = 1e-4
    num_workers: int = 4
    model: Literal["resnet50_v1b", "resnet50_v1", "resnet18_v1b", "resnet101_v1b"] = "resnet50_v1b"
    """Network: GluonCV's model of this name on MXNet, the same architecture on PyTorch (v1b = torchvision's)."""
    last_gamma: bool = False
    """Zero-initialise the last BatchNorm gamma of each residual block."""
    data_dir: str = "data/imagenet"
    """ImageFolder (train/, val/) or RecordIO (train.rec/.idx, val.rec/.idx) directory, or shards (index.json and
    tar shards) in a directory or at a URL (s3://bucket/prefix)."""
    data_format: Literal["auto", "imagefolder", "recordio", "shards"] = "auto"
    """Data layout in --data-dir: auto, imagefolder, recordio or shards."""
    decoder: Literal["pil", "turbo", "device"] = "pil"
    """Image decoding: pil; turbo (libjpeg-turbo's fast DCT and OpenCV's resize, uint8 pixels normalized on the
    device: about 2.2x the images per core on ImageNet-sized JPEGs); or device (PyTorch: the JPEGs decoded, cropped
    and resized on the GPU by nvJPEG through torchvision; on a CPU by libjpeg-turbo in the training process)."""
    data_cache: str = ""
    """Where shards read from a URL are cached on each host (default ~/.cache/hvdtrain/shards)."""
    data_cache_gb: float = 0.0
    """Most GB of shards the cache keeps while they are not in use (0: no bound)."""
    data_timeout: float = 300.0
    """Seconds a shard's store may fail (retried with backoff) before the job ends naming it."""
    num_classes: int = 0
    """Classes (0: the number of class directories of an ImageFolder, 1 + the largest label of train.rec for RecordIO,
    1000 with --synthetic)."""
    image_size: int = 224
    """Side of the training and validation crops."""
    val_resize: int = 256
    """Validation images are resized to this shorter side, then center-cropped to --image-size."""
    min_crop_area: float = 0.08
    """Training crops cover between this fraction of the image and all of it (Inception-style random-resized-crop;
    raise it for small images, whose objects fill the frame)."""
    flip: bool = True
    """Flip training images horizontally at random (--no-flip for data whose mirror image is another class)."""
    color_jitter: float = 0.0
    """Scale brightness, contrast and saturation of training images by factors from [1-F, 1+F], in random order
    (GluonCV's train_imagenet.py uses 0.4; 0: off)."""
    lighting: float = 0.0
    """AlexNet-style PCA lighting noise on training images with this standard deviation (GluonCV: 0.1; 0: off)."""

    lrs_per_256 = {"sgd": 0.1, "adam": 2.5e-4, "adamw": 2.5e-4, "lamb": 6.25e-4, "lars": 0.8}

    def optimizer_base_lr(self) -> float:
        return (self.lr_per_256 or self.lrs_per_256[self.optimizer]) * self.batch_size / 256

    def base_lr_reason(self) -> str:
        if self.base_lr != self.optimizer_base_lr():
            return "--base-lr"
        per_256 = "--lr-per-256" if self.lr_per_256 else f"{self.optimizer}'s rate per 256 images"
        return f"{per_256} x {self.batch_size} / 256"

    def validate(self) -> None:
        super().validate()
        if self.image_size < 16 or self.val_resize < self.image_size:
            raise ConfigError(f"--image-size must be at least 16 and --val-resize at least --image-size, got "
                              f"{self.image_size} and {self.val_resize}")
        if not 0 < self.min_crop_area <= 1:
            raise ConfigError(f"--min-crop-area must be in (0, 1], got {self.min_crop_area}")
        if not 0 <= self.color_jitter < 1 or self.lighting < 0:
            raise ConfigError(f"--color-jitter must be in [0, 1) and --lighting at least 0, got {self.color_jitter} "
                              f"and {self.lighting}")
        if self.num_classes < 0:
            raise ConfigError(f"--num-classes must be 0 (auto) or more, got {self.num_classes}")
        if self.decoder == "device" and self.framework == "mxnet":
            raise ConfigError("--decoder device decodes with torchvision's nvJPEG, which MXNet cannot use; on MXNet "
                              "use --decoder turbo")
        if self.decoder == "device" and (self.color_jitter or self.lighting):
            raise ConfigError("--decoder device applies no --color-jitter or --lighting; use --decoder turbo or pil "
                              "with them")
        if self.decoder != "pil":
            for module in ("simplejpeg", "cv2"):
                try:
                    __import__(module)
                except ImportError:
                    raise ConfigError(f"--decoder {self.decoder} needs simplejpeg and OpenCV ({module} is missing): pip "
                                      f"install 'hvdtrain[vision]' (make install does), or use --decoder pil") from None
        if self.data_cache_gb < 0 or self.data_timeout <= 0:
            raise ConfigError(f"--data-cache-gb must be at least 0 and --data-timeout above 0, got "
                              f"{self.data_cache_gb:g} and {self.data_timeout:g}")


def _blocks(net, kind) -> list:
    """Every child block of ``net`` (recursively) that is a ``kind``."""
    found, stack = [], [net]
    while stack:
        block = stack.pop()
        if isinstance(block, kind):
            found.append(block)
        stack.extend(block._children.values())
    return found


class ImageNetTrainer(Trainer):
    """ResNet on ImageNet (ImageFolder or RecordIO), fp32/fp16/bf16, PyTorch or MXNet."""

    name = "imagenet"
    config_class = ImageNetConfig
    report_top5 = True
    sample_unit = "images"

    @property
    def input_shape(self):
        return (3, self.cfg.image_size, self.cfg.image_size)

    @property
    def num_classes(self) -> int:
        if self.cfg.num_classes:
            return self.cfg.num_classes
        d = self.cfg.data_dir
        if self._format() == "shards" and not self.cfg.synthetic:
            return self._index()["num_classes"]
        if self._format() == "imagefolder" and os.path.isdir(os.path.join(d, "train")):
            return len(ImageFolder(os.path.join(d, "train")).classes)
        if not self.cfg.synthetic and os.path.isfile(os.path.join(d, "train.idx")):
            if getattr(self, "_recordio_classes", None) is None:  # a scan of the record headers: once
                self._recordio_classes = recordio_num_classes(os.path.join(d, "train.rec"),
                                                              os.path.join(d, "train.idx"))
            return self._recordio_classes
        return 1000

    def _format(self) -> str:
        cfg = self.cfg
        if cfg.data_format != "auto":
            return cfg.data_format
        if is_url(cfg.data_dir) or os.path.isfile(os.path.join(cfg.data_dir, INDEX)):
            return "shards"
        return "imagefolder" if os.path.isdir(os.path.join(cfg.data_dir, "train")) else "recordio"

    def _store(self) -> ShardStore:
        cfg = self.cfg
        return ShardStore(cfg.data_dir, cfg.data_cache, cfg.data_cache_gb * 1e9, cfg.data_timeout)

    def _index(self) -> dict:
        if getattr(self, "_shard_index", None) is None:  # read once: the store is asked before Horovod starts
            self._shard_index = self._store().read_index()
        return self._shard_index

    def check(self) -> None:
        super().check()
        cfg = self.cfg
        if cfg.synthetic:
            return
        d = cfg.data_dir
        if self._format() == "shards":
            index = self._index()
            missing = [split for split in ("train", "val") if split not in index["splits"]]
            if missing:
                raise ConfigError(f"--data-dir {d}: its {INDEX} has no {' or '.join(missing)} split")
            return
        if is_url(d):
            raise ConfigError(f"--data-dir {d} is a URL: only shards are read from URLs (--data-format shards); "
                              f"pack the dataset there with 'python -m hvdtrain data pack SRC {d}'")
        if not os.path.isdir(d):
            raise ConfigError(f"--data-dir {d} does not exist; it needs train/ and val/ class folders (ImageFolder) "
                              f"or train.rec, train.idx, val.rec, val.idx (RecordIO); or pass --synthetic")
        if self._format() == "imagefolder":
            for split in ("train", "val"):
                path = os.path.join(d, split)
                if not os.path.isdir(path):
                    raise ConfigError(f"--data-dir {d} lacks {split}/ (ImageFolder layout: {split}/CLASS/*.JPEG)")
                if len(ImageFolder(path)) == 0:
                    raise ConfigError(f"{path} holds no images (.jpg, .jpeg, .png, ...) in class folders")
        else:
            missing = [n for n in ("train.rec", "train.idx", "val.rec", "val.idx")
                       if not os.path.isfile(os.path.join(d, n))]
            if missing:
                raise ConfigError(f"--data-dir {d} lacks {', '.join(missing)} (RecordIO); build them from an "
                                  f"ImageFolder with 'python scripts/make_recordio.py IMAGEFOLDER_DIR {d}'")

    def preprocessing(self):
        return {"image": "RGB", "resize_shorter_side": self.cfg.val_resize, "center_crop": self.cfg.image_size,
                "scale": "pixel / 255", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
                "layout": f"N x 3 x {self.cfg.image_size} x {self.cfg.image_size} (channels first)"}

    def datasets(self):
        cfg, d = self.cfg, self.cfg.data_dir
        train_t = image_transform(cfg.decoder, train=True, size=cfg.image_size, resize=cfg.val_resize,
                                  min_area=cfg.min_crop_area, flip=cfg.flip, jitter=cfg.color_jitter,
                                  lighting=cfg.lighting)
        val_t = image_transform(cfg.decoder, train=False, size=cfg.image_size, resize=cfg.val_resize)
        if self._format() == "shards":
            store, index = self._store(), self._index()
            return (ShardedImages(store, "train", train_t, seed=cfg.seed, index=index),
                    ShardedImages(store, "val", val_t, seed=cfg.seed, index=index))
        if self._format() == "imagefolder":
            return (ImageFolder(os.path.join(d, "train"), train_t, seed=cfg.seed),
                    ImageFolder(os.path.join(d, "val"), val_t, seed=cfg.seed))
        return (RecordIODataset(os.path.join(d, "train.rec"), os.path.join(d, "train.idx"), train_t, seed=cfg.seed),
                RecordIODataset(os.path.join(d, "val.rec"), os.path.join(d, "val.idx"), val_t, seed=cfg.seed))

    def build_torch(self):
        from recipes.resnet_torch import resnet
        arch, stride_in_1x1 = MODELS[self.cfg.model]
        return resnet(arch, self.num_classes, last_gamma=self.cfg.last_gamma, stride_in_1x1=stride_in_1x1)

    def build_mxnet(self):
        from hvdtrain.backends.gluoncv_compat import import_gluoncv
        import mxnet as mx
        gcv = import_gluoncv()
        net = gcv.model_zoo.get_model(self.cfg.model, pretrained=False, classes=self.num_classes,
                                      last_gamma=self.cfg.last_gamma)
        if self.cfg.last_gamma:
            # GluonCV zeroes the last gamma of its bottlenecks only; its BasicBlockV1b (ResNet-18/34) ignores
            # last_gamma. Its last BatchNorm starts at zero here, as in the PyTorch model.
            for block in _blocks(net, gcv.model_zoo.resnetv1b.BasicBlockV1b):
                block.bn2.gamma.init = mx.init.Zero()
        # The PyTorch model's initialisation (recipes/resnet_torch.py), so that both frameworks start alike:
        # convolutions He-normal over fan-out (kaiming_normal_, mode="fan_out"), the classifier PyTorch's Linear
        # default, uniform(+-1/sqrt(fan_in)) for weight and bias; BatchNorm gamma 1, beta 0 on both. (GluonCV's
        # Xavier over fan-in gave the first convolution 4.6x the spread of PyTorch's, the classifier 2.5x.)
        fc = getattr(net, "fc", None)
        if isinstance(fc, mx.gluon.nn.Dense):
            fan_in = fc.weight.shape[1]
            fc.weight.init = mx.init.Xavier(rnd_type="uniform", factor_type="in", magnitude=1)
            fc.bias.init = mx.init.Uniform(1.0 / math.sqrt(fan_in))
        net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="out", magnitude=2))
        return net
