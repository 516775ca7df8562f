#!/usr/bin/env python
"""A small two-class ImageFolder of real photographs, with no download: tiles of scikit-learn's two bundled JPEG
photos (china.jpg -> class 'china', flower.jpg -> class 'flower').

    python scripts/make_photo_folder.py OUT_DIR [--tile 96] [--train-per-class 24] [--val-per-class 8]

Tiles are cut at random positions (fixed seed) and saved as JPEG under OUT_DIR/train/CLASS and OUT_DIR/val/CLASS.
"""
import argparse
import os
import sys

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tile", type=int, default=96)
    parser.add_argument("--train-per-class", type=int, default=24)
    parser.add_argument("--val-per-class", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from PIL import Image
    from sklearn.datasets import load_sample_images
    photos = load_sample_images()
    rng = np.random.default_rng(args.seed)
    for name, image in zip(("china", "flower"), photos.images):
        h, w, _ = image.shape
        for split, count in (("train", args.train_per_class), ("val", args.val_per_class)):
            folder = os.path.join(args.out_dir, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                y, x = rng.integers(0, h - args.tile), rng.integers(0, w - args.tile)
                tile = image[y:y + args.tile, x:x + args.tile]
                Image.fromarray(tile).save(os.path.join(folder, f"{name}_{i:04d}.jpg"), quality=90)
    print(f"wrote {2 * (args.train_per_class + args.val_per_class)} photo tiles in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
