#!/usr/bin/env python
"""Pack an ImageFolder (train/CLASS/*, val/CLASS/*) into MXNet RecordIO: OUT/train.rec, train.idx, val.rec, val.idx.

    python scripts/make_recordio.py IMAGEFOLDER_DIR OUT_DIR [--max-side 480]

Labels are the class indices of the sorted class folders (the same as hvdtrain's ImageFolder), so both formats give
the same label for the same sample index. With --max-side, images are re-encoded as JPEG with their longer side capped
(GluonCV packs ImageNet at 480); without it, the original bytes are stored. A corrupt image stops the packing with
its path. The files are readable by mxnet.recordio and mx.io.ImageRecordIter.
"""
import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image_folder")
    parser.add_argument("out_dir")
    parser.add_argument("--max-side", type=int, default=0, help="re-encode with the longer side capped (0: keep bytes)")
    args = parser.parse_args(argv)
    from hvdtrain.vision import ImageFolder, write_recordio
    os.makedirs(args.out_dir, exist_ok=True)
    for split in ("train", "val"):
        src = os.path.join(args.image_folder, split)
        if not os.path.isdir(src):
            print(f"make_recordio: error: {src} does not exist (expected {split}/CLASS/*.jpg)", file=sys.stderr)
            return 2
        try:
            n = write_recordio(ImageFolder(src), os.path.join(args.out_dir, split), max_side=args.max_side)
        except RuntimeError as e:
            print(f"make_recordio: error: {e}", file=sys.stderr)
            return 1
        print(f"{split}: {n} images -> {os.path.join(args.out_dir, split)}.rec/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
