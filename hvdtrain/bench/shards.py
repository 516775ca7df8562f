"""``python -m hvdtrain bench shards``: the ImageNet recipe trained from tar shards at s3:// through a rate-limited
link, against the same shards on local disk and against the ImageFolder they were packed from.

The namespace hosts of ``bench network`` (``scripts/netns_cluster.sh``, root only), every link limited to ``--rate``
each way; an S3 server (moto's server mode) in the root namespace, reached by the hosts over their links through the
bridge. One rank per host trains ``recipe imagenet --decoder turbo`` (ResNet-18 at ``--image-size``) on ImageNet-like
JPEGs (``scripts/make_photo_folder.py --imagenet-like``) for 2 epochs, in three arms:

- ``imagefolder``: the ImageFolder on the local file system (``--data-format imagefolder``);
- ``shards local``: the packed shards in a local directory, read in place;
- ``shards s3``: the same shards at ``s3://``, into an empty cache each round: its first epoch fetches every shard
  through the links (cold), its second reads the cache (warm: each rank keeps its shards from epoch to epoch).

The figures: each arm's img/s in epoch 2, the ratio of the warm S3 epoch to local shards (the aim: at least 0.95),
and the cold epoch's img/s beside what the link allows (its rate over the mean image's bytes, per host). Rounds
interleave the arms. The hosts share one file system here, so the cache directory is one for all of them; each rank
reads its own shards, so each still fetches its share through its own link.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from ..config import ConfigError
from .costmodel import rate_bits
from .cluster import _launch, run_records, shaped_cluster
from .runner import check_sizes, compare, free_port, save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMS = ("imagefolder", "shards local", "shards s3")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _corpus(out: str, per_class: int, shard_mb: float) -> Dict[str, str]:
    photos, shards = os.path.join(out, "photos"), os.path.join(out, "shards")
    if not os.path.isdir(os.path.join(photos, "train")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_photo_folder.py"), photos,
                        "--imagenet-like", "--train-per-class", str(per_class), "--val-per-class", "8"], check=True)
    if not os.path.exists(os.path.join(shards, "index.json")):
        from ..shards import pack
        pack(photos, shards, int(shard_mb * (1 << 20)))
    return {"photos": photos, "shards": shards}


def _server(port: int) -> subprocess.Popen:
    import socket
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError("bench shards: moto's S3 server did not start (pip install 'moto[server]')")
            time.sleep(0.2)


def _train(cluster, hosts: int, data_dir: str, args, env: Dict[str, str], extra: List[str]) -> Dict:
    """Two epochs of the recipe on ``hosts`` hosts; the img/s of each epoch."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        cmd = _launch(cluster, hosts, ["-m", "hvdtrain", "recipe", "imagenet", "--data-dir", data_dir,
                                       "--framework", args.framework, "--model", "resnet18_v1b",
                                       "--image-size", str(args.image_size), "--val-resize", str(args.image_size),
                                       "--batch-size", str(args.batch_size), "--epochs", "2", "--warmup-epochs", "0",
                                       "--decoder", "turbo", "--num-workers", "1", "--precision", "fp32",
                                       "--resume", "never", "--output-dir", out, *extra])
        first, second = run_records(cmd, out, args.timeout, env, f"training from {data_dir}")[:2]
        return {"images_per_sec": float(second["images_per_sec"]), "epoch1_images_per_sec":
                float(first["images_per_sec"]), "epoch1_data_seconds": first["phase_seconds"]["data"],
                "epoch2_data_seconds": second["phase_seconds"]["data"],
                "epoch2_cpu_seconds_per_step": second.get("cpu_seconds_per_step")}


def run(args) -> int:
    check_sizes(rounds=args.rounds, hosts=args.hosts, per_class=args.per_class, batch_size=args.batch_size)
    if os.geteuid() != 0:
        raise ConfigError("bench shards needs root (network namespaces and tc)")
    os.makedirs(args.output_dir, exist_ok=True)
    data = _corpus(args.output_dir, args.per_class, args.shard_mb)
    with open(os.path.join(data["shards"], "index.json")) as f:
        index = json.load(f)
    train = index["splits"]["train"]
    image_bytes = sum(s["bytes"] for s in train["shards"]) / train["samples"]
    port = free_port()
    server = _server(port)
    caches = tempfile.mkdtemp(prefix="hvdtrain-bench-cache-")
    try:
        local_env = dict(os.environ, **CREDENTIALS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        subprocess.run([sys.executable, "-c", "import s3fs; s3fs.S3FileSystem().mkdir('bench')"], env=local_env,
                       check=True)
        subprocess.run([sys.executable, "-m", "hvdtrain", "data", "pack", data["photos"], "s3://bench/photos",
                        "--shard-mb", str(args.shard_mb)], env=local_env, check=True, stdout=subprocess.DEVNULL)
        with shaped_cluster(args.hosts, args.rate) as cluster:
            subnet = dict(line.strip().split("=", 1) for line in open(os.path.join(cluster.state, "env"))
                          if "=" in line)["NETNS_SUBNET"]
            env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{subnet}.1:{port}", "OMP_NUM_THREADS": "1"}
            count = [0]

            def s3_arm():
                count[0] += 1
                cache = os.path.join(caches, str(count[0]))  # empty: the first epoch fetches every shard
                return _train(cluster, args.hosts, "s3://bench/photos", args, env, ["--data-cache", cache])
            variants = {
                "imagefolder": lambda: _train(cluster, args.hosts, data["photos"], args, env,
                                              ["--data-format", "imagefolder"]),
                "shards local": lambda: _train(cluster, args.hosts, data["shards"], args, env, []),
                "shards s3": s3_arm,
            }
            res = compare(variants, args.rounds)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        subprocess.run(["rm", "-rf", caches])
    link_images = rate_bits(args.rate) / 8 / image_bytes
    s3, local = res["shards s3"], res["shards local"]
    cold = sorted(r["epoch1_images_per_sec"] for r in s3["rounds"])
    result = {"benchmark": "shards", "hosts": args.hosts, "rate": args.rate, "image_bytes": image_bytes,
              "train_images": train["samples"], "shards": len(train["shards"]), "image_size": args.image_size,
              "batch_size": args.batch_size, "framework": args.framework, "rounds": args.rounds, "variants": res,
              "warm_s3_over_local_shards": s3["images_per_sec"] / local["images_per_sec"],
              "cold_s3_images_per_sec": cold[len(cold) // 2], "link_images_per_sec_per_host": link_images,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"{'arm':14s} {'epoch 2 img/s (min-max)':>26s} {'epoch 1 img/s':>14s}")
    for name in ARMS:
        v = res[name]
        firsts = sorted(r["epoch1_images_per_sec"] for r in v["rounds"])
        print(f"{name:14s} {v['images_per_sec']:12.1f} ({v['min']:.1f}-{v['max']:.1f})".ljust(41)
              + f"{firsts[len(firsts) // 2]:14.1f}")
    print(f"warm S3 / local shards: {result['warm_s3_over_local_shards']:.3f}; the cold S3 epoch: "
          f"{result['cold_s3_images_per_sec']:.1f} img/s, where {args.rate} per host carries "
          f"{link_images:.0f} images of {image_bytes / 1000:.0f} KB per second per host")
    save(args.output_dir, "shards", result, {f"{args.hosts} hosts at {args.rate}": res},
         f"ImageNet recipe from shards over {args.rate} links: img/s in the second epoch")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("shards", help="training from tar shards at s3:// over rate-limited links, against local "
                                      "shards and an ImageFolder (root)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="each host's link, each way (tc's units)")
    p.add_argument("--per-class", type=int, default=100, help="training JPEGs per class (two classes)")
    p.add_argument("--shard-mb", type=float, default=2.0)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--framework", default="torch", choices=("torch", "mxnet"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds a training run may take")
    p.add_argument("--output-dir", default="runs/bench/shards")
