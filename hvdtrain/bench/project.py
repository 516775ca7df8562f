"""``python -m hvdtrain bench project``: what a job would do on a larger cluster, before one is rented.

    python -m hvdtrain bench project --model resnet50 --img-per-sec-per-gpu 1400 --link 25gbit \\
        --ranks-per-host 8 --hosts 1,2,4,8,16,32,64

The step of one rank (forward, backward, optimizer, and when each gradient is ready during the backward pass) is
measured on this machine from the model's real PyTorch definition (the recipe's, or VGG-16 for Horovod's published
comparison), then scaled to the per-GPU rate the user gives; gradient sizes are the model's own. The cost model
(:mod:`hvdtrain.bench.costmodel`) then gives the step time at each host count for Horovod's ring (flat, or
hierarchical with ``--hierarchical``) and for MXNet's parameter server with one server and with one per host.
Prints a table and writes ``project.json`` and ``project.png`` (img/s and efficiency against ranks).
"""
from __future__ import annotations

import time
from typing import Dict, List

from ..config import ConfigError
from .costmodel import Compute, Link, efficiency, horovod_step, ps_step, rate_bits
from .profile import MODELS, measure
from .runner import write

# Published global batches up to which ImageNet ResNet-50 kept its accuracy (top-1 within about a point of the
# small-batch baseline in the same number of epochs): momentum SGD with linear scaling and warmup to 8K (Goyal et al.
# 2017, 76.3% at 256 and 76.2% at 8K, lost beyond it), LARS to 32K (You et al. 2017). hvdtrain's own measurement on
# its recipes is issue 48's study (docs/convergence.md): MEASURED_HERE.
KEPT_ACCURACY = (("sgd", 8192, "Goyal et al. 2017"), ("lars", 32768, "You et al. 2017"))
MEASURED_HERE = {"study": "docs/convergence.md, Large batches", "ratio": 32,
                 "what": "the ImageNet recipe's ResNet-18 on 10,240 Fashion photos, 6 epochs (1,920 steps at 1x, 60 at 32x)",
                 "points_lost": {"sgd": 24.1, "lars": 3.2, "lamb": 3.7}, "seeds": 3}
"""This project's own large-batch study: top-1 points each optimizer lost at ``ratio`` times the recipe's batch,
against momentum SGD at 1x, the same epochs (mean of ``seeds`` seeds)."""


def accuracy_limit(global_batch: int) -> str:
    """'' up to 8K; past it, which published recipe still kept accuracy at this batch ('lars'), or 'none'."""
    kept = [name for name, limit, _ in KEPT_ACCURACY if global_batch <= limit]
    return "" if "sgd" in kept else (kept[0] if kept else "none")


def project(compute: Compute, batch_size: int, img_per_sec: float, hosts: List[int], per_host: int, net: Link,
            local: Link, cycle_time: float, threshold: float, hierarchical: bool, epochs: float = 90.0,
            dataset_images: int = 1281167) -> List[Dict]:
    """Rows of projected img/s and efficiency per host count: Horovod, PS with 1 server, PS with a server per
    host; with the global batch, its steps per epoch and each arm's hours to ``epochs`` epochs of
    ``dataset_images`` (the global batch grows with the ranks, so the steps per epoch fall)."""
    step = compute.scaled(batch_size / img_per_sec)
    rows = []
    for h in hosts:
        ranks = h * per_host
        global_batch = ranks * batch_size
        row: Dict = {"hosts": h, "ranks": ranks, "global_batch": global_batch,
                     "steps_per_epoch": -(-dataset_images // global_batch),
                     "accuracy_past_published_limit": accuracy_limit(global_batch)}
        arms = {"horovod": horovod_step(step, h, per_host, net, local, cycle_time, threshold, hierarchical),
                "ps 1 server": ps_step(step, h, per_host, 1, net),
                "ps server per host": ps_step(step, h, per_host, h, net)}
        for arm, res in arms.items():
            ips = global_batch / res["seconds"]
            row[arm] = {"step_seconds": res["seconds"], "images_per_sec": ips,
                        "efficiency": efficiency(step.seconds, res["seconds"]),
                        "exposed_communication_seconds": res["exposed_communication"],
                        "hours_to_epochs": epochs * dataset_images / ips / 3600}
        rows.append(row)
    return rows


ARMS = ("horovod", "ps 1 server", "ps server per host")


def plot(result: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        ax.bar([x + (i - 1) * width for x in xs], [r[arm]["images_per_sec"] for r in rows], width, alpha=0.6,
               label=f"{arm} (img/s)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([str(r["ranks"]) for r in rows])
    ax.set_xlabel(f"ranks ({result['ranks_per_host']} per host), links {result['link']}")
    ax.set_ylabel("images / s (projected)")
    eff = ax.twinx()
    for arm, marker in zip(ARMS, "osd"):
        eff.plot(list(xs), [100 * r[arm]["efficiency"] for r in rows], marker=marker, label=f"{arm} (%)")
    eff.set_ylim(0, 105)
    eff.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"Projection: {result['model_description']}, {result['img_per_sec_per_gpu']:g} img/s per GPU",
                 fontsize=9)
    lines, more = ax.get_legend_handles_labels(), eff.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_hosts(text: str) -> List[int]:
    try:
        hosts = sorted({int(h) for h in text.split(",") if h.strip()})
    except ValueError:
        hosts = []
    if not hosts or hosts[0] < 1:
        raise ConfigError(f"--hosts {text!r}: give host counts of at least 1, e.g. 1,2,4,8")
    return hosts


def run(args) -> int:
    if args.model not in MODELS:
        raise ConfigError(f"--model {args.model!r}: choose from {', '.join(MODELS)}")
    if not args.link:
        raise ConfigError("--link: give the network link's rate in tc's syntax, e.g. 25gbit")
    if args.img_per_sec_per_gpu is None or args.img_per_sec_per_gpu <= 0:
        raise ConfigError("--img-per-sec-per-gpu: give one GPU's measured training rate (images/s), e.g. 1400")
    hosts = parse_hosts(args.hosts)
    if args.ranks_per_host < 1 or args.batch_size < 1:
        raise ConfigError("--ranks-per-host and --batch-size must be at least 1")
    net = Link.from_rate(rate_bits(args.link, "--link"), args.alpha_us * 1e-6)
    local = Link.from_rate(rate_bits(args.local_link, "--local-link"), args.local_alpha_us * 1e-6)
    compute = measure(args.model, grad_bytes=args.grad_bytes)
    if args.epochs <= 0 or args.dataset_images < 1:
        raise ConfigError("--epochs and --dataset-images must be positive")
    rows = project(compute, args.batch_size, args.img_per_sec_per_gpu, hosts, args.ranks_per_host, net, local,
                   args.cycle_time_ms * 1e-3, args.fusion_mb * 2 ** 20, args.hierarchical, args.epochs,
                   args.dataset_images)
    result = {"benchmark": "project", "model": args.model, "model_description": MODELS[args.model][0],
              "gradient_mb": compute.gradient_bytes / 1e6, "tensors": len(compute.gradients),
              "img_per_sec_per_gpu": args.img_per_sec_per_gpu, "batch_size": args.batch_size,
              "ranks_per_host": args.ranks_per_host, "link": args.link, "alpha_us": args.alpha_us,
              "local_link": args.local_link, "local_alpha_us": args.local_alpha_us, "hierarchical": args.hierarchical,
              "cycle_time_ms": args.cycle_time_ms, "fusion_mb": args.fusion_mb, "grad_bytes": args.grad_bytes,
              "profile_measured_here": {"forward": compute.forward, "backward": compute.backward,
                                        "update": compute.update},
              "epochs": args.epochs, "dataset_images": args.dataset_images,
              "published_accuracy_limits": [{"optimizer": n, "global_batch": b, "source": src}
                                            for n, b, src in KEPT_ACCURACY],
              "measured_here": MEASURED_HERE,
              "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"project: {result['model_description']}: {len(compute.gradients)} gradient tensors, "
          f"{result['gradient_mb']:.1f} MB per step; {args.img_per_sec_per_gpu:g} img/s per GPU at batch "
          f"{args.batch_size}; links {args.link}, {args.ranks_per_host} rank(s) per host")
    marks = {"": "", "lars": " *", "none": " **"}
    print(f"{'hosts':>5} {'ranks':>6} {'batch':>9}  " + "  ".join(f"{arm + ' img/s (eff)':>28}" for arm in ARMS)
          + f"  {'horovod: ' + format(args.epochs, 'g') + ' epochs':>18}")
    for row in rows:
        print(f"{row['hosts']:>5} {row['ranks']:>6} {row['global_batch']:>9,}  " + "  ".join(
            f"{row[arm]['images_per_sec']:>20,.0f} ({100 * row[arm]['efficiency']:>3.0f}%)" for arm in ARMS)
            + f"  {row['horovod']['hours_to_epochs']:>16.2f} h" + marks[row["accuracy_past_published_limit"]])
    if any(row["accuracy_past_published_limit"] for row in rows):
        print("  *  global batch past 8K: momentum SGD with linear scaling lost ImageNet accuracy there (Goyal et al. "
              "2017); LARS kept it to 32K (You et al. 2017): --optimizer lars")
        if any(row["accuracy_past_published_limit"] == "none" for row in rows):
            print("  ** past 32K: no published recipe here kept the accuracy; fewer ranks or a smaller --batch-size")
    lost = MEASURED_HERE["points_lost"]
    print(f"  measured here ({MEASURED_HERE['study']}): at {MEASURED_HERE['ratio']}x a recipe's batch, same epochs, "
          f"top-1 fell {lost['sgd']:g} points with momentum SGD and the linear rule, {lost['lars']:g} with LARS, "
          f"{lost['lamb']:g} with LAMB (mean of {MEASURED_HERE['seeds']} seeds): LARS keeps most of what SGD loses, "
          f"none kept it within a point in so few steps; measure a large batch's accuracy before buying its speed")
    write(args.output_dir, "project", result, lambda path: plot(result, path))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("project", help="project img/s and scaling efficiency to larger clusters (docs/scaling.md)")
    p.add_argument("--model", default="resnet50", help=f"whose gradients: {', '.join(MODELS)}")
    p.add_argument("--img-per-sec-per-gpu", type=float, default=None,
                   help="one GPU's training rate at --batch-size (measured, or the vendor's figure)")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--link", default="", help="each host's network link, in tc's syntax (25gbit, 100gbit)")
    p.add_argument("--alpha-us", type=float, default=25.0, help="seconds per message on the network, in us")
    p.add_argument("--local-link", default="800gbit", help="the path between a host's GPUs (NVLink: 800gbit)")
    p.add_argument("--local-alpha-us", type=float, default=5.0)
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--hosts", default="1,2,4,8,16,32,64", help="host counts, comma-separated")
    p.add_argument("--hierarchical", action="store_true", help="Horovod's hierarchical allreduce")
    p.add_argument("--cycle-time-ms", type=float, default=1.0, help="HOROVOD_CYCLE_TIME")
    p.add_argument("--fusion-mb", type=float, default=128.0, help="HOROVOD_FUSION_THRESHOLD in MiB")
    p.add_argument("--grad-bytes", type=int, default=4, choices=[2, 4], help="bytes per gradient value")
    p.add_argument("--epochs", type=float, default=90.0, help="epochs to time (ImageNet ResNet-50: 90)")
    p.add_argument("--dataset-images", type=int, default=1281167, help="images per epoch (ImageNet: 1,281,167)")
    p.add_argument("--output-dir", default="runs/bench")
