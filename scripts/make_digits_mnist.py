#!/usr/bin/env python
"""Write scikit-learn's bundled handwritten digits as MNIST IDX files: the embedded default data set.

    python scripts/make_digits_mnist.py DIR [--test-fraction 0.2] [--seed 0]

1,797 real 8x8 digits (0..16 grey levels) are scaled to 0..255, resized to 20x20 with bilinear interpolation and
centred in a 28x28 frame, as MNIST's digits are. The split into train and t10k files is fixed by the seed and
stratified by class. Nothing is downloaded: the digits ship inside scikit-learn.
"""
import argparse
import os
import sys

import numpy as np


def digits_as_mnist(seed: int = 0, test_fraction: float = 0.2):
    from PIL import Image
    from sklearn.datasets import load_digits
    digits = load_digits()
    small = np.clip(digits.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    images = np.zeros((len(small), 28, 28), dtype=np.uint8)
    for i, img in enumerate(small):
        images[i, 4:24, 4:24] = np.asarray(Image.fromarray(img).resize((20, 20), Image.BILINEAR))
    labels = digits.target.astype(np.uint8)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test[idx[:int(round(test_fraction * len(idx)))]] = True
    return (images[~test], labels[~test]), (images[test], labels[test])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from recipes.mnist import FILES, write_idx
    (xtr, ytr), (xte, yte) = digits_as_mnist(args.seed, args.test_fraction)
    os.makedirs(args.out_dir, exist_ok=True)
    for key, array in (("train_images", xtr), ("train_labels", ytr), ("test_images", xte), ("test_labels", yte)):
        write_idx(os.path.join(args.out_dir, FILES[key]), array)
    print(f"wrote {len(ytr)} training and {len(yte)} test digits as MNIST IDX files in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
