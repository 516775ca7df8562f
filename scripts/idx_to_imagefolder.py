"""Turn an MNIST-layout IDX data set (MNIST, Fashion-MNIST, the embedded digits) into an ImageFolder of PNGs.

    python scripts/idx_to_imagefolder.py IDX_DIR OUT_DIR [--size 32] [--train-per-class N] [--val-per-class N]
                                         [--names fashion|digits|NAME,NAME,...]

IDX_DIR holds train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte
(each optionally .gz). OUT_DIR gets train/CLASS/NNNNN.png from the training files and val/CLASS/NNNNN.png from the
test files, each image resized to --size pixels square (bilinear). Class folders are named "INDEX-NAME" with the index
zero-padded, so their sorted order is the label order and an ImageFolder reads the same labels as the IDX files.
--train-per-class / --val-per-class keep the first N images of each class (0: all). Then
'python scripts/make_recordio.py OUT_DIR REC_DIR' packs the same images as RecordIO, and 'recipe imagenet' trains on
either: the ImageNet code path (decoding, augmentation, both input pipelines) on real images.
"""
import argparse
import os
import sys

import numpy as np

NAMES = {
    "fashion": ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot"],
    "digits": [str(i) for i in range(10)],
}


def class_dirs(names):
    width = len(str(len(names) - 1))
    return [f"{i:0{width}d}-{name}" for i, name in enumerate(names)]


def write_split(images: np.ndarray, labels: np.ndarray, out: str, dirs, size: int, per_class: int) -> int:
    from PIL import Image
    written = 0
    for label, folder in enumerate(dirs):
        os.makedirs(os.path.join(out, folder), exist_ok=True)
        chosen = np.flatnonzero(labels == label)
        for i in chosen[:per_class] if per_class else chosen:
            img = Image.fromarray(images[i])
            if size and img.size != (size, size):
                img = img.resize((size, size), Image.BILINEAR)
            img.save(os.path.join(out, folder, f"{i:05d}.png"))
            written += 1
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("idx_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--size", type=int, default=32, help="side of the written images (0: keep)")
    parser.add_argument("--train-per-class", type=int, default=0)
    parser.add_argument("--val-per-class", type=int, default=0)
    parser.add_argument("--names", default="digits", help="fashion, digits, or comma-separated class names")
    args = parser.parse_args(argv)
    from recipes.mnist import FILES, find_file, read_idx
    missing = [stem for stem in FILES.values() if not find_file(args.idx_dir, stem)]
    if missing:
        print(f"idx_to_imagefolder: error: {args.idx_dir} lacks {', '.join(missing)} (IDX files, optionally .gz)",
              file=sys.stderr)
        return 2
    names = NAMES.get(args.names) or [n.strip() for n in args.names.split(",") if n.strip()]
    splits = {"train": ("train_images", "train_labels", args.train_per_class),
              "val": ("test_images", "test_labels", args.val_per_class)}
    counts = {}
    for split, (images, labels, per_class) in splits.items():
        x = read_idx(find_file(args.idx_dir, FILES[images]))
        y = read_idx(find_file(args.idx_dir, FILES[labels]))
        if x.ndim != 3 or len(x) != len(y) or int(y.max()) >= len(names):
            print(f"idx_to_imagefolder: error: {args.idx_dir}: {split} images {x.shape}, labels {y.shape} up to "
                  f"{int(y.max())}: expected (N, rows, cols) images and labels below {len(names)} (--names)",
                  file=sys.stderr)
            return 2
        counts[split] = write_split(x, y, os.path.join(args.out_dir, split), class_dirs(names), args.size, per_class)
    print(f"wrote {counts['train']} training and {counts['val']} validation images in {len(names)} classes to "
          f"{args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
