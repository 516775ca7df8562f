"""``python -m hvdtrain bench allreduce``: allreduce bandwidth per message size, and fusion settings on ResNet-50's
gradients."""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

from ..config import ConfigError
from .runner import check_sizes, free_port, run_worker


def _allreduce_cmd(variant: str, np_: int, args: List[str]) -> List[str]:
    binary = os.path.dirname(sys.executable)
    worker = ["-m", "hvdtrain.bench.allreduce_worker"]
    if variant == "horovod-gloo":
        return [os.path.join(binary, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                sys.executable, *worker, "horovod", *args]
    if variant == "horovod-mpi":
        return ["mpirun", "-np", str(np_), "-H", f"localhost:{np_}", "-bind-to", "none", "-map-by", "slot",
                "-mca", "pml", "ob1", "-mca", "btl", "^openib", "-x", "PATH", "-x", "PYTHONPATH",
                sys.executable, *worker, "horovod", *args]
    if variant == "torch-gloo":
        return [os.path.join(binary, "torchrun"), "--nproc_per_node", str(np_), "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), *worker, "torch", *args]
    return [sys.executable, *worker, "memcpy", *args]


FUSION_GRID = [(0, 1.0), (8 << 20, 1.0), (32 << 20, 1.0), (128 << 20, 1.0), (0, 10.0), (32 << 20, 10.0),
               (128 << 20, 10.0)]
"""(HOROVOD_FUSION_THRESHOLD bytes, HOROVOD_CYCLE_TIME ms) tried on ResNet-50's gradients; Horovod's (and so
hvdtrain's) default is 128 MB and 1 ms."""


DEFAULT_FUSION = (128 << 20, 1.0)


def allreduce(np_: int, rounds: int, sizes: List[int], fusion_rounds: int, grid=None, timeout: float = 600) -> Dict:
    """Bus bandwidth per message size for Horovod on Gloo and on MPI, torch.distributed on Gloo and memcpy; then
    ResNet-50's 161 gradients under each fusion threshold and cycle time of :data:`FUSION_GRID`."""
    import shutil
    variants = ["horovod-gloo"] + (["horovod-mpi"] if shutil.which("mpirun") else []) + ["torch-gloo", "memcpy"]
    size_arg = ["--sizes", ",".join(map(str, sizes))]
    samples: Dict[str, List[Dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        for r in range(rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
                samples[v].append(run_worker(_allreduce_cmd(v, np_, [*size_arg, "sizes", "--result", result]),
                                              result, timeout, f"allreduce {v}", env))
                print(f"bench: round {r + 1}/{rounds} {v}: " + ", ".join(
                    f"{row['bytes'] >> 10}K {row['busbw_gbps']:.2f} GB/s" for row in samples[v][-1]["rows"]),
                    flush=True)
        rows = []
        for i, nbytes in enumerate(sizes):
            row: Dict = {"bytes": nbytes}
            for v in variants:
                secs = [s["rows"][i]["seconds"] for s in samples[v]]
                med = statistics.median(secs)
                factor = 2 * (np_ - 1) / np_ if v != "memcpy" and np_ > 1 else 1.0
                row[v] = {"seconds": med, "min": min(secs), "max": max(secs),
                          "algbw_gbps": nbytes / med / 1e9, "busbw_gbps": nbytes / med / 1e9 * factor}
            rows.append(row)
        fusion: Dict[str, List[float]] = {}
        names = {f"{t >> 20}MB/{c:g}ms": (t, c) for t, c in (grid or FUSION_GRID)}
        order = list(names)
        for r in range(fusion_rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                t, c = names[name]
                env = {"HOROVOD_FUSION_THRESHOLD": str(t), "HOROVOD_CYCLE_TIME": str(c), "OMP_NUM_THREADS": "1"}
                res = run_worker(_allreduce_cmd("horovod-gloo", np_, ["resnet50", "--result", result]), result,
                                  timeout, f"resnet50 allreduce {name}", env)
                fusion.setdefault(name, []).append(res["seconds"])
                print(f"bench: round {r + 1}/{fusion_rounds} fusion {name}: {1000 * res['seconds']:.1f} ms",
                      flush=True)
    settings = [{"setting": n, "fusion_threshold_bytes": names[n][0], "cycle_time_ms": names[n][1],
                 "seconds": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
                for n, s in fusion.items()]
    best = min(settings, key=lambda s: s["seconds"])
    default = next(s for s in settings if (s["fusion_threshold_bytes"], s["cycle_time_ms"]) == DEFAULT_FUSION)
    return {"benchmark": "allreduce", "np": np_, "rounds": rounds, "variants": variants, "rows": rows,
            "resnet50": {"tensors": 161, "bytes": 25557032 * 4, "settings": settings, "best": best["setting"],
                         "default": default["setting"], "default_over_best": default["seconds"] / best["seconds"],
                         "within_target": default["seconds"] <= 1.10 * best["seconds"]},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def plot_allreduce(result: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    sizes = [r["bytes"] for r in result["rows"]]
    for v in result["variants"]:
        left.plot(sizes, [r[v]["busbw_gbps"] for r in result["rows"]], "o-", label=v)
    left.set_xscale("log", base=2)
    left.set_xlabel("message size (bytes)")
    left.set_ylabel("bus bandwidth (GB/s, median)")
    left.set_title(f"allreduce, np={result['np']}")
    left.legend()
    settings = result["resnet50"]["settings"]
    colors = ["#DD8452" if s["setting"] == result["resnet50"]["default"] else "#4C72B0" for s in settings]
    right.bar([s["setting"] for s in settings], [1000 * s["seconds"] for s in settings], color=colors,
              yerr=[[1000 * (s["seconds"] - s["min"]) for s in settings],
                    [1000 * (s["max"] - s["seconds"]) for s in settings]], capsize=3)
    right.set_ylabel("ms per round of 161 gradients (median)")
    right.set_title("ResNet-50 gradients: fusion threshold / cycle time (orange: default)")
    right.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> int:
    try:
        sizes = [int(v) for v in args.sizes.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--sizes must be byte counts separated by commas, got {args.sizes!r}") from None
    check_sizes(np=args.np, rounds=args.rounds, fusion_rounds=args.fusion_rounds, smallest_size=min(sizes or [0]))
    grid = None
    if args.fusion:
        try:
            grid = [(int(float(mb) * (1 << 20)), float(ms)) for mb, ms in (p.split("/") for p in args.fusion.split(","))]
        except ValueError:
            raise ConfigError(f"--fusion must be MB/ms pairs separated by commas, got {args.fusion!r}") from None
        if DEFAULT_FUSION not in grid:
            grid.append(DEFAULT_FUSION)
    result = allreduce(args.np, args.rounds, sizes, args.fusion_rounds, grid)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "allreduce.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot_allreduce(result, os.path.join(args.output_dir, "allreduce.png"))
    for r in result["rows"]:
        print(f"{r['bytes']:>10} bytes: " + "  ".join(f"{v} {r[v]['busbw_gbps']:.3f} GB/s" for v in result["variants"]))
    rn = result["resnet50"]
    print(f"ResNet-50 gradients: best {rn['best']}, default {rn['default']} takes {rn['default_over_best']:.3f}x the "
          f"best ({'within' if rn['within_target'] else 'over'} the 1.10 target)")
    print(f"bench: wrote {args.output_dir}/allreduce.json and allreduce.png")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("allreduce", help="allreduce bandwidth (Horovod Gloo/MPI, torch.distributed, memcpy) and "
                                         "fusion settings on ResNet-50's gradients")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fusion-rounds", type=int, default=2)
    p.add_argument("--sizes", default="4096,65536,1048576,16777216,134217728", help="bytes, comma-separated")
    p.add_argument("--fusion", default="", help="settings to try as MB/ms pairs, e.g. 0/1,128/1 (default: a grid "
                                                 "around Horovod's default 128/1, which is always included)")
    p.add_argument("--output-dir", default="runs/bench")
