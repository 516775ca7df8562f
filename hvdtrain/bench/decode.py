"""``python -m hvdtrain bench decode``: decoded and augmented training images per second **per core**, for each
input path of the ImageNet recipe, at 1..N cores, and the cores a GPU needs at 700 and 2,500 img/s.

The input is an ImageFolder (and its RecordIO, ``scripts/make_recordio.py``) of ImageNet-like JPEGs
(``scripts/make_photo_folder.py --imagenet-like``: about 476x419 px and 106 KB). Each path runs the recipe's training
augmentation at ``--image-size`` (random-resized crop over 8-100% of the image, aspect 3/4-4/3, a flip, then the
float CHW normalised array the loaders hand to the model):

- ``imagefolder``: hvdtrain.vision's ImageFolder (PIL decode, numpy), what PyTorch's loader workers run;
- ``recordio``: hvdtrain.vision's RecordIODataset, the same decode reading the record file;
- ``mxnet-iter``: MXNet's C++ ImageRecordIter (OpenCV decode) as the MXNet backend builds it, with N decode threads;
- ``turbo``: the ImageFolder with ``--decoder turbo`` (:class:`hvdtrain.vision.TurboTransform`: libjpeg-turbo's fast
  DCT, OpenCV's resize, uint8 pixels that the backend normalizes on the device);
- ``turbo-shards``: the same decoder reading the images from tar shards (``DIR/shards``, packed by the benchmark
  when missing), as ``--data-dir`` of shards reads them.

At N cores the Python paths run N processes, each pinned to its own core and decoding its own images, started
together; MXNet's runs one process pinned to N cores with N threads. The figure is images / slowest wall time / N.
Rounds interleave the variants (A B C, then C B A); the report gives median, min and max. Then the Python paths'
stages, each timed alone on one core (:func:`stages`): where a faster decode path has to save.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

from .runner import check_sizes, compare, cores, save

PATHS = ("imagefolder", "recordio", "mxnet-iter", "turbo", "turbo-shards")
GPU_RATES = (700, 2500)
"""img/s a GPU trains ResNet-50 at: a V100 in the seed article's run (45,000 img/s on 64), an A100 with AMP."""


def _dataset(path: str, data_dir: str, image_size: int):
    from ..vision import ImageFolder, RecordIODataset, image_transform
    transform = image_transform("turbo" if path.startswith("turbo") else "pil", train=True, size=image_size)
    if path == "turbo-shards":
        from ..shards import ShardedImages, ShardStore
        return ShardedImages(ShardStore(os.path.join(data_dir, "shards")), "train", transform, seed=0)
    if path in ("imagefolder", "turbo"):
        return ImageFolder(os.path.join(data_dir, "train"), transform, seed=0)
    return RecordIODataset(os.path.join(data_dir, "train.rec"), os.path.join(data_dir, "train.idx"), transform, seed=0)


def worker(args) -> int:
    """One measuring process: decode ``--count`` images from ``--first`` on (the Python paths), or ``--count``
    images in batches (MXNet's iterator, ``--threads`` threads), starting at ``--start`` (a wall-clock time), and
    write the seconds taken to ``--result``."""
    dataset = _dataset("recordio" if args.path == "mxnet-iter" else args.path, args.data_dir, args.image_size)
    if args.path == "mxnet-iter":
        from ..backends.gluoncv_compat import import_mxnet
        from ..backends.mxnet_records import MXNetRecords
        mx = import_mxnet()
        batch, skip = 32, 6
        steps = max(2, args.count // batch)
        batches = MXNetRecords(mx, 0, 1, lambda b: b).iterate(dataset, skip + steps, batch, args.threads)
        _wait(args.start)
        # The iterator decodes ahead into a queue of its own: timed from the batch after the first few (its
        # start-up and whatever it had queued), to the last.
        for _ in range(skip):
            next(batches)[0].wait_to_read()
        begin = time.perf_counter()
        for data, _ in batches:
            data.wait_to_read()
        images = steps * batch
    else:
        n = len(dataset)
        dataset[args.first % n]  # imports and the first file's open are not decoding
        _wait(args.start)
        begin = time.perf_counter()
        for i in range(args.count):
            dataset[(args.first + i) % n]
        images = args.count
    with open(args.result, "w") as f:
        json.dump({"seconds": time.perf_counter() - begin, "images": images}, f)
    return 0


def _wait(start: float) -> None:
    time.sleep(max(0.0, start - time.time()))


def measure(path: str, n_cores: int, data_dir: str, image_size: int, count: int, timeout: float = 600) -> float:
    """Images per second per core of ``path`` on ``n_cores`` cores (cores 0..n-1 of this process's)."""
    allowed = sorted(os.sched_getaffinity(0))[:n_cores]
    procs = 1 if path == "mxnet-iter" else n_cores
    env = {**os.environ, "OMP_NUM_THREADS": str(n_cores if path == "mxnet-iter" else 1), "MKL_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    start = time.time() + 8.0  # after every process has imported what it needs
    with tempfile.TemporaryDirectory(prefix="hvdtrain-decode-") as tmp:
        running = []
        for i in range(procs):
            result = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, "-m", "hvdtrain.bench.decode", "--worker", "--path", path, "--data-dir", data_dir,
                   "--image-size", str(image_size), "--count", str(count * (n_cores if procs == 1 else 1)),
                   "--first", str(i * count), "--threads", str(n_cores), "--start", str(start), "--result", result]
            cores_of = allowed if procs == 1 else [allowed[i]]
            running.append((subprocess.Popen(cmd, env=env, preexec_fn=lambda c=cores_of: os.sched_setaffinity(0, c)),
                            result))
        outs = []
        for proc, result in running:
            if proc.wait(timeout=timeout) != 0:
                raise RuntimeError(f"bench decode: the {path} worker exited {proc.returncode}")
            with open(result) as f:
                outs.append(json.load(f))
    images = sum(o["images"] for o in outs)
    return images / max(o["seconds"] for o in outs) / n_cores


def stages(data_dir: str, image_size: int, count: int) -> Dict[str, float]:
    """Milliseconds per image of each stage of the Python paths' training transform, in this process (one core):
    reading the file, decoding it (PIL), the random-resized crop with its resize, the flip, and the float CHW
    normalised array. Each stage is timed over ``count`` images in turn (the best of 3 passes)."""
    from PIL import Image

    from ..vision import ImageFolder, ImageTransform, decode_image
    folder = ImageFolder(os.path.join(data_dir, "train"))
    paths = [p for p, _ in folder.samples[:count]]
    t = ImageTransform(train=True, size=image_size)

    def timed(fn, items):
        """(ms per item, the outputs) of ``fn`` over ``items``, the best of 3 passes."""
        seconds = []
        for _ in range(3):
            begin = time.perf_counter()
            out = [fn(x) for x in items]
            seconds.append(time.perf_counter() - begin)
        return 1000 * min(seconds) / len(items), out

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    rng = np.random.default_rng(0)
    ms = {}
    ms["read"], data = timed(read, paths)
    ms["decode"], images = timed(lambda d: decode_image(d, "bench"), data)
    ms["crop_resize"], crops = timed(lambda img: t._random_resized_crop(img, rng), images)
    ms["flip"], _ = timed(lambda img: img.transpose(Image.FLIP_LEFT_RIGHT), crops)
    ms["to_float_normalize"], _ = timed(lambda img: (np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0
                                                     - t.mean) / t.std, crops)
    return ms


def run(args) -> int:
    check_sizes(rounds=args.rounds, count=args.count, image_size=args.image_size)
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        print(f"bench decode: unknown --paths {','.join(unknown)}: choose from {','.join(PATHS)}", file=sys.stderr)
        return 2
    needs = ["train"] if {"imagefolder", "turbo", "turbo-shards"} & set(paths) else []
    needs += ["train.rec", "train.idx"] if {"recordio", "mxnet-iter"} & set(paths) else []
    missing = [n for n in needs if not os.path.exists(os.path.join(args.data_dir, n))]
    if missing:
        print(f"bench decode: --data-dir {args.data_dir} lacks {', '.join(missing)}: make it with python "
              f"scripts/make_photo_folder.py DIR --imagenet-like, then python scripts/make_recordio.py DIR DIR",
              file=sys.stderr)
        return 2
    if "turbo-shards" in paths and not os.path.exists(os.path.join(args.data_dir, "shards", "index.json")):
        from ..shards import pack
        pack(args.data_dir, os.path.join(args.data_dir, "shards"), splits=("train",))
    counts = [int(c) for c in args.cores.split(",")] if args.cores else sorted({1, cores()})
    variants = {f"{p} x{c}": (lambda p=p, c=c: measure(p, c, args.data_dir, args.image_size, args.count))
                for p in paths for c in counts}
    res = compare(variants, args.rounds)
    rows: List[Dict] = []
    for p in paths:
        for c in counts:
            v = res[f"{p} x{c}"]
            per_core = v["images_per_sec"]
            rows.append({"path": p, "cores": c, "per_core": per_core, "min": v["min"], "max": v["max"],
                         **{f"cores_per_gpu_at_{r}": r / per_core for r in GPU_RATES}})
    steps = stages(args.data_dir, args.image_size, args.count) if "imagefolder" in paths else {}
    result = {"benchmark": "decode", "data_dir": args.data_dir, "image_size": args.image_size, "count": args.count,
              "rounds": args.rounds, "cores": cores(), "rows": rows, "variants": res,
              "stages_ms_per_image": steps, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"{'path':13s} {'cores':>4s} {'img/s per core (min-max)':>26s} " +
          " ".join(f"{'cores/GPU @' + str(r):>16s}" for r in GPU_RATES))
    for r in rows:
        print(f"{r['path']:13s} {r['cores']:4d} {r['per_core']:12.1f} ({r['min']:.1f}-{r['max']:.1f})".ljust(51) +
              " ".join(f"{r[f'cores_per_gpu_at_{g}']:16.1f}" for g in GPU_RATES))
    if steps:
        total = sum(steps.values())
        print("imagefolder's stages, ms per image on one core: " + ", ".join(
            f"{k} {v:.2f} ({100 * v / total:.0f}%)" for k, v in steps.items()))
    save(args.output_dir, "decode", result, {f"{c} core(s)": {p: res[f"{p} x{c}"] for p in paths} for c in counts},
         f"decoded and augmented images per second per core at {args.image_size} px")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="decoded and augmented images per second per core, per input path")
    p.add_argument("--data-dir", required=True, help="train/ (ImageFolder) and train.rec/.idx of ImageNet-like JPEGs")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {','.join(PATHS)}")
    p.add_argument("--cores", default="", help="comma-separated core counts (default: 1 and all)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--count", type=int, default=300, help="images per core per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-dir", default="runs/bench/decode")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.decode")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--path", choices=PATHS, required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--image-size", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--start", type=float, required=True)
    p.add_argument("--result", required=True)
    return worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
