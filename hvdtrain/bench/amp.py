"""``python -m hvdtrain bench amp``: the ImageNet recipe against a bare Horovod AMP loop, per precision, on one device.

What a GPU user runs: ResNet-50 on synthetic data at fp32, fp16 (autocast with a GradScaler) and bf16 (autocast),
through hvdtrain (``recipe imagenet --synthetic``) and through the loop a user would write by hand
(:func:`hvdtrain.bench.loops.horovod_torch`: the recipe's model, one fixed batch on the device, Horovod's
DistributedOptimizer, the GradScaler in the order Horovod documents). Both run the same number of steps from a cold
start, so warm-up (cuDNN's algorithm search, the allocator) weighs the same in each; every round interleaves the
runs (A B, then B A). On a GPU host each rank takes the GPU of its local rank; without one the same runs go to the CPU
(the tests run it that way at a tiny size). Writes ``amp.json`` (img/s per precision for both, the ratio
hvdtrain / bare against the 0.97 target, the device and versions) and ``amp.png``.

For context (not measured here): NVIDIA's DeepLearningExamples report about 2,500 img/s for ResNet-50 v1.5 with
PyTorch AMP on one A100 80GB (batch 256, DALI input).
"""
from __future__ import annotations

import os
import platform
import time
from typing import Dict, List

from ..config import ConfigError
from .runner import check_sizes, compare, run_loop, run_recipe, save, threads_per_rank

PRECISIONS = ("fp32", "fp16", "bf16")
TARGET = 0.97
REFERENCE = {"source": "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, AMP, 1x A100 80GB, batch 256",
             "images_per_sec": 2500}


def device_info() -> Dict:
    """What the runs ran on: the GPU (name, count) or the CPU, and the versions that matter."""
    info: Dict = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
        else:
            info["device"] = f"cpu ({os.cpu_count()} cores)"
            info["gpus"] = 0
    except ImportError:
        info["device"] = "unknown (no torch)"
    try:
        import horovod
        import horovod.torch as hvd
        info["horovod"] = horovod.__version__
        info["horovod_nccl"] = bool(hvd.nccl_built())
    except ImportError:
        info["horovod"] = None
    return info


def amp(precisions: List[str], model: str, image_size: int, batch_size: int, steps: int, rounds: int,
        np_: int = 1, timeout: float = 900) -> Dict:
    recipe_args = ["--model", model, "--image-size", str(image_size), "--num-classes", "1000"]
    threads = threads_per_rank(np_)
    rows = {}
    for precision in precisions:
        hvdtrain_args = ["--synthetic", "--batch-size", str(batch_size), "--precision", precision, *recipe_args]
        loop_args = ["--precision", precision, "--", *recipe_args]
        res = compare({
            "hvdtrain": lambda: run_recipe("imagenet", "torch", np_, threads, steps, hvdtrain_args, timeout),
            "bare": lambda: run_loop("horovod-torch", "imagenet", np_, threads, steps, batch_size, timeout,
                                     loop_args),
        }, rounds)
        ratio = res["hvdtrain"]["images_per_sec"] / res["bare"]["images_per_sec"]
        rows[precision] = {"variants": res, "hvdtrain_over_bare": ratio, "within_target": ratio >= TARGET}
        print(f"bench: {precision}: hvdtrain {res['hvdtrain']['images_per_sec']:.1f} img/s, bare "
              f"{res['bare']['images_per_sec']:.1f} img/s, hvdtrain/bare {ratio:.3f}", flush=True)
    return {"benchmark": "amp", "recipe": "imagenet", "framework": "torch", "model": model, "image_size": image_size,
            "batch_size": batch_size, "np": np_, "steps": steps, "rounds": rounds, "target": TARGET,
            "precisions": rows, "environment": device_info(), "reference": REFERENCE,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(args) -> int:
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise ConfigError(f"--precisions must be a comma-separated subset of {','.join(PRECISIONS)}, got "
                          f"{args.precisions!r}")
    check_sizes(np=args.np, batch_size=args.batch_size, steps=args.steps, rounds=args.rounds,
                image_size=args.image_size)
    result = amp(precisions, args.model, args.image_size, args.batch_size, args.steps, args.rounds, args.np)
    save(args.output_dir, "amp", result, {p: r["variants"] for p, r in result["precisions"].items()},
         f"{args.model} at {args.image_size} px on {result['environment']['device']}: hvdtrain vs a bare AMP loop")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("amp", help="the ImageNet recipe against a bare Horovod AMP loop, per precision, one device")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--model", default="resnet50_v1b")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128, help="per worker")
    p.add_argument("--steps", type=int, default=50, help="steps per run, warm-up included")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--np", type=int, default=1, help="workers (one GPU each)")
    p.add_argument("--output-dir", default="runs/bench/amp")
