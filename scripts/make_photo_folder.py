#!/usr/bin/env python
"""A two-class ImageFolder of real photographs, with no download: cut from scikit-learn's two bundled JPEG photos
(china.jpg -> class 'china', flower.jpg -> class 'flower').

    python scripts/make_photo_folder.py OUT_DIR [--tile 96] [--train-per-class 24] [--val-per-class 8]
    python scripts/make_photo_folder.py OUT_DIR --imagenet-like [--train-per-class 500] [--val-per-class 50]

Tiles (the default) are square crops at random positions (fixed seed). ``--imagenet-like`` writes images shaped as
ImageNet's are instead, for measuring decoding: the longer side 500 px for 60% of them, else 400-640 px, aspects 4:3,
3:2, 5:4 and 1:1, a quarter of them portrait (ILSVRC-2012's training JPEGs: about 110 KB on average, 500x375 and
500x333 the most common sizes), each a random region of a photo (40-100% of the largest region of its aspect, mirrored
at random, at most 1.5x enlarged, with noise that brings the files to ImageNet's size: --noise), saved as JPEG at
quality 90 (mean 476x419 px and 106 KB with the defaults). Files go under OUT_DIR/train/CLASS and OUT_DIR/val/CLASS.
"""
import argparse
import os
import sys

import numpy as np


def imagenet_like(photo, rng: np.random.Generator, noise: float):
    """One image of ImageNet's shape from ``photo`` (a PIL image): its size drawn as the module docstring says, and
    sensor-like noise of standard deviation ``noise`` (0-255 scale) added to every pixel."""
    from PIL import Image
    long_side = 500 if rng.random() < 0.6 else int(rng.integers(400, 641))
    aspect = float(rng.choice([4 / 3, 3 / 2, 5 / 4, 1.0], p=[0.5, 0.25, 0.15, 0.1]))
    w, h = long_side, int(round(long_side / aspect))
    if rng.random() < 0.25:
        w, h = h, w
    pw, ph = photo.size
    fit = min(pw / w, ph / h, 1.0)  # the largest region of the image's aspect that fits, at most its own size ...
    fit = max(fit * rng.uniform(0.4, 1.0), fit / 1.5)  # ... 40-100% of it, enlarged at most 1.5x
    cw, ch = int(round(w * fit)), int(round(h * fit))
    x, y = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
    arr = np.asarray(photo.resize((w, h), Image.BICUBIC, box=(x, y, x + cw, y + ch)), np.float32)
    if rng.random() < 0.5:
        arr = arr[:, ::-1]
    arr = arr + rng.normal(0.0, noise, arr.shape).astype(np.float32)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tile", type=int, default=96)
    parser.add_argument("--imagenet-like", action="store_true", help="images of ImageNet's sizes, not tiles")
    parser.add_argument("--train-per-class", type=int, default=24)
    parser.add_argument("--val-per-class", type=int, default=8)
    parser.add_argument("--noise", type=float, default=18.0,
                        help="--imagenet-like: noise per pixel (standard deviation, 0-255), which brings the files to "
                             "ImageNet's size per pixel (about 110 KB at quality 90)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from PIL import Image
    from sklearn.datasets import load_sample_images
    photos = load_sample_images()
    rng = np.random.default_rng(args.seed)
    sizes = []
    for name, image in zip(("china", "flower"), photos.images):
        h, w, _ = image.shape
        photo = Image.fromarray(image)
        for split, count in (("train", args.train_per_class), ("val", args.val_per_class)):
            folder = os.path.join(args.out_dir, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                if args.imagenet_like:
                    img = imagenet_like(photo, rng, args.noise)
                else:
                    y, x = rng.integers(0, h - args.tile), rng.integers(0, w - args.tile)
                    img = Image.fromarray(image[y:y + args.tile, x:x + args.tile])
                path = os.path.join(folder, f"{name}_{i:04d}.jpg")
                img.save(path, quality=90)
                sizes.append((img.size, os.path.getsize(path)))
    kind = "ImageNet-like images" if args.imagenet_like else "photo tiles"
    mean_kb = np.mean([b for _, b in sizes]) / 1000
    mean_w, mean_h = (np.mean([s[k] for s, _ in sizes]) for k in (0, 1))
    print(f"wrote {len(sizes)} {kind} in {args.out_dir} (mean {mean_w:.0f}x{mean_h:.0f} px, {mean_kb:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
