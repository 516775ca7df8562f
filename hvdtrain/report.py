"""``python -m hvdtrain report OUTPUT_DIR``: what a finished or running job did, from the files it wrote.

Reads config.json, metrics.jsonl, heartbeats/, errors/, autotune.csv and timeline.json; prints the epochs, accuracy,
throughput, where the step time goes and which rank is slow, and draws loss, accuracy and img/s per epoch
(report.png). Needs no framework and no Horovod: it runs on a laptop over a copied output directory, or
reads a URL's (``--output-dir s3://...``).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional

from . import schedule, timeline
from .config import ConfigError
from .faults import STALE_SECONDS, heartbeat_table, read_heartbeats
from .phases import PHASES, format_phases, stragglers

AUTOTUNE_FIELDS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
                   "cycle_time_ms", "tensor_fusion_threshold", "score")


def announce(trainer, steps: int) -> None:
    """Rank 0, at the start of training: the resolved configuration in OUTPUT_DIR/config.json and the start-up line."""
    cfg, b = trainer.cfg, trainer.backend
    with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
        resolved = {**json.loads(cfg.to_json()), "recipe": trainer.name, "world_size": b.size,
                    "threads_per_rank": b.threads, "threads_reason": b.threads_reason, "steps_per_epoch": steps,
                    "precision_requested": trainer.precision_requested, "precision_reason": b.precision_reason,
                    "base_lr_reason": cfg.base_lr_reason(),
                    "global_batch": trainer.global_batch,
                    # horovod.torch's wait for a collective (hvdtrain.backends.resources.spin_wait): "1" spins, "0" blocks
                    **({"horovod_spin_wait": os.environ.get("HOROVOD_SPIN_WAIT", "")} if b.name == "torch" else {}),
                    # Horovod's idle wait (resources.horovod_environment): "2" negotiates a queued group at once, "1"
                    # lets one cycle pass for more gradients, "0" is Horovod's own loop
                    "horovod_idle_wait": os.environ.get("HOROVOD_IDLE_WAIT", ""),
                    # glibc's malloc keeping what a step frees (resources.keep_freed_memory): "" where left as it was
                    "malloc": b.malloc,
                    # Gloo's read low-water mark (resources.gloo_rcvlowat): "" is the library's default, 32 KiB
                    "horovod_gloo_rcvlowat": os.environ.get("HOROVOD_GLOO_RCVLOWAT", ""),
                    # the size from which a Gloo allreduce runs beside Horovod's background thread (fix 11)
                    "horovod_gloo_async_bytes": os.environ.get("HOROVOD_GLOO_ASYNC_BYTES", ""),
                    # --allreduce-groups auto under a CPU quota (Backend.allreduce_groups): why one group, or ""
                    "allreduce_groups_reason": b.allreduce_groups_reason,
                    **({"output_url": trainer.output_url} if getattr(trainer, "output_url", "") else {})}
        json.dump(resolved, f, indent=2, sort_keys=True)
    target = schedule.scaled_lr(cfg.base_lr, b.lr_workers(cfg), cfg.accumulate)
    print(f"hvdtrain: {trainer.name} on {b.name}, {b.size} worker(s) x {b.threads} thread(s) ({b.threads_reason}) "
          f"on {b.device}; "
          f"global batch {cfg.batch_size} x {b.size}" + (f" x {cfg.accumulate}" if cfg.accumulate > 1 else "")
          + f" = {trainer.global_batch}; lr {cfg.base_lr:g} ({cfg.base_lr_reason()}) -> {target:g}; "
          + (f"optimizer sharded over {b.size} ranks; " if cfg.shard_optimizer else "")
          + f"{steps} steps/epoch; {cfg.precision} ({b.precision_reason}); output {trainer.output_location}", flush=True)
    print(f"hvdtrain: rank 0 is pid {os.getpid()}: kill -USR1 {os.getpid()} prints every rank's last step and "
          f"phase", flush=True)


def read_records(output_dir: str) -> List[Dict[str, Any]]:
    """metrics.jsonl's records (a line being written while we read is skipped)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    return records


def autotune_best(path: str) -> Optional[Dict[str, float]]:
    """The best-scoring row of Horovod's autotune log (score: bytes per microsecond); None when it has no sample."""
    if not os.path.exists(path):
        return None
    rows = []
    with open(path) as f:
        reader = csv.reader(f)
        next(reader, None)
        for row in reader:
            try:
                rows.append(dict(zip(AUTOTUNE_FIELDS, (float(v.strip()) for v in row))))
            except ValueError:
                continue
    if not rows:
        return None
    best = max(rows, key=lambda r: r["score"])
    best["samples"] = len(rows)
    return best


def format_autotune(best: Optional[Dict[str, float]]) -> str:
    if best is None:
        return ("no sample scored yet (Horovod's autotuner warms up first; run more steps, or lower "
                "HOROVOD_AUTOTUNE_WARMUP_SAMPLES / HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE)")
    return (f"fusion threshold {best['tensor_fusion_threshold']:g} MB, cycle time {best['cycle_time_ms']:g} ms, "
            f"cache {'on' if best['cache_enabled'] else 'off'}, hierarchical allreduce "
            f"{'on' if best['hierarchical_allreduce'] else 'off'} (score {best['score']:.4g} bytes/us, "
            f"best of {int(best['samples'])} samples)")


def job_state(output_dir: str) -> str:
    """finished, failed, running or stopped, from the error files and heartbeats."""
    errors_dir = os.path.join(output_dir, "errors")
    if os.path.isdir(errors_dir) and os.listdir(errors_dir):
        return "failed"
    beats = read_heartbeats(os.path.join(output_dir, "heartbeats"))
    if beats and all(b.get("phase") == "done" for b in beats):
        return "finished"
    if any(time.time() - b.get("time", 0) <= STALE_SECONDS for b in beats):
        return "running"
    return "stopped" if beats else "unknown"


def render_text(output_dir: str) -> str:
    if not os.path.isdir(output_dir):
        raise ConfigError(f"report: {output_dir} is not a directory; pass a job's --output-dir")
    records = read_records(output_dir)
    config_path = os.path.join(output_dir, "config.json")
    if not records and not os.path.exists(config_path):
        raise ConfigError(f"report: {output_dir} holds no config.json or metrics.jsonl; pass a job's --output-dir")
    cfg: Dict[str, Any] = {}
    if os.path.exists(config_path):
        with open(config_path) as f:
            cfg = json.load(f)
    state = job_state(output_dir)
    lines = [f"hvdtrain report: {output_dir}"]
    if cfg:
        lines.append(f"  {cfg.get('recipe', '?')} on {cfg.get('framework', '?')}, {cfg.get('world_size', '?')} "
                     f"worker(s) x {cfg.get('threads_per_rank', '?')} thread(s), global batch "
                     f"{cfg.get('global_batch', '?')}, {cfg.get('steps_per_epoch', '?')} steps/epoch, "
                     f"precision {cfg.get('precision', '?')}")
    lines.append(f"  state: {state}; epochs done: {len(records)} of {cfg.get('epochs', '?')}")
    if records:
        last = records[-1]
        accuracies = [(r["val_accuracy"], r["epoch"]) for r in records if r.get("val_accuracy") is not None]
        if accuracies:
            best = max(accuracies)
            lines.append(f"  val accuracy: {100 * last['val_accuracy']:.2f}% after epoch {last['epoch']} "
                         f"(best {100 * best[0]:.2f}% at epoch {best[1]})")
        unit = "img/s" if "images_per_sec" in last else "samples/s"
        speeds = [_speed(r) for r in records[1:] or records]  # the first epoch includes warm-up
        lines.append(f"  throughput: {statistics.median(speeds):.1f} {unit} median over "
                     f"{'epochs 2..' if len(records) > 1 else 'epoch '}{last['epoch']}"
                     f" (world size {last.get('world_size', '?')})")
        lines.append("")
        lines.append(f"  {'epoch':>5} {'train_loss':>10} {'val_loss':>9} {'val_acc':>8} {unit:>10} "
                     f"{'step ms':>8} {'lr':>9}")
        for r in records:
            val_loss = f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-"
            acc = f"{100 * r['val_accuracy']:.2f}%" if r.get("val_accuracy") is not None else "-"
            step = f"{1000 * r['step_seconds']:.1f}" if r.get("step_seconds") is not None else "-"
            lines.append(f"  {r['epoch']:>5} {r['train_loss']:>10.4f} {val_loss:>9} {acc:>8} "
                         f"{_speed(r):>10.1f} {step:>8} {r['lr']:>9.4g}")
        if last.get("phase_seconds"):
            lines += ["", f"  where the step time goes (epoch {last['epoch']}, mean of ranks, clock: "
                          f"{last.get('phase_clock', 'host')}):",
                      f"    {format_phases(last['phase_seconds'])}",
                      "    slowest rank per phase: " + ", ".join(
                          f"{p} rank {last['phase_slowest'][p]['rank']} "
                          f"({1000 * last['phase_slowest'][p]['seconds']:.1f}ms)" for p in PHASES
                          if p in last.get("phase_slowest", {}))]
            found = stragglers(last)
            lines += [f"    straggler: {s}" for s in found] or ["    no straggler: every rank within 25% of the "
                                                                  "mean in every compute phase"]
    best = autotune_best(os.path.join(output_dir, "autotune.csv"))
    if best is not None or os.path.exists(os.path.join(output_dir, "autotune.csv")):
        lines += ["", f"  autotune: {format_autotune(best)}"]
    lines += _timeline_lines(output_dir, cfg)
    if state in ("running", "stopped", "failed"):
        lines += ["", heartbeat_table(output_dir, f"job {state}")]
    errors_dir = os.path.join(output_dir, "errors")
    if os.path.isdir(errors_dir):
        for name in sorted(os.listdir(errors_dir)):
            with open(os.path.join(errors_dir, name)) as f:
                header = f.readline()
            try:
                info = json.loads(header)
                lines.append(f"  error on rank {info['rank']} ({info['host']}): {info['error']}")
            except (ValueError, KeyError):
                continue
    return "\n".join(lines)


def _timeline_lines(output_dir: str, cfg: Dict[str, Any]) -> List[str]:
    """The summary of the job's Horovod timeline (``--timeline-steps``), where rank 0 wrote one."""
    window = cfg.get("timeline_steps") or (timeline.DEFAULT_WINDOW if cfg.get("timeline_file") else "")
    path = cfg.get("timeline_file") or os.path.join(output_dir, "timeline.json")
    if not window or not os.path.exists(path):
        return []
    steps = [r["global_step"] for r in read_records(output_dir) if r.get("global_step")]
    try:
        first, last = timeline.recorded_steps(window, steps[-1] if steps else 2 ** 62)
        summary = timeline.summarize(path, last - first + 1)
    except (ValueError, KeyError) as e:  # ConfigError is a ValueError
        return ["", f"  Horovod timeline: {path} could not be read ({e})"]
    return ["", f"  Horovod timeline of steps {first}..{last} (rank 0):"] + \
        [f"    {line}" for line in timeline.describe_summary(summary)]


def plot(output_dir: str, path: str) -> Optional[str]:
    """Loss, accuracy and img/s per epoch, one panel each; None when there is no epoch to draw."""
    records = read_records(output_dir)
    if not records:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [r["epoch"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(epochs, [r["train_loss"] for r in records], marker="o", label="train")
    if any(r.get("val_loss") is not None for r in records):
        axes[0].plot(epochs, [r.get("val_loss") for r in records], marker="o", label="val")
    axes[0].set(title="loss", xlabel="epoch")
    axes[0].legend()
    if any(r.get("val_accuracy") is not None for r in records):
        axes[1].plot(epochs, [100 * r["val_accuracy"] if r.get("val_accuracy") is not None else None
                              for r in records], marker="o", color="tab:green")
    axes[1].set(title="validation accuracy (%)", xlabel="epoch")
    axes[2].bar(epochs, [_speed(r) for r in records], color="tab:blue")
    axes[2].set(title=f"throughput ({'img/s' if 'images_per_sec' in records[-1] else 'samples/s'}, all workers)",
                xlabel="epoch")
    fig.suptitle(os.path.basename(os.path.abspath(output_dir)))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _speed(record: Dict[str, Any]) -> float:
    """An epoch's throughput: images per second for image recipes (and records written before samples_per_sec)."""
    return record["images_per_sec"] if "images_per_sec" in record else record["samples_per_sec"]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain report",
                                     description="Summarize a job's output directory (finished or running).")
    parser.add_argument("output_dir", nargs="?", default="", help="the job's --output-dir")
    parser.add_argument("--png", default="", help="where to draw the chart (default OUTPUT_DIR/report.png)")
    parser.add_argument("--mlflow", default="", metavar="URI",
                        help="list the runs of an MLflow store instead (--track mlflow's, e.g. sqlite:///runs/mlflow.db)")
    args = parser.parse_args(argv)
    if args.mlflow:
        from .tracking import list_runs
        try:
            lines = list_runs(args.mlflow)
        except ImportError:
            raise ConfigError("report --mlflow needs MLflow: pip install 'hvdtrain[track]'") from None
        except Exception as e:  # noqa: BLE001 - an unreachable or malformed store: one line
            raise ConfigError(f"report --mlflow {args.mlflow}: {' '.join(str(e).split())[:300]}") from None
        print("\n".join(lines) if lines else f"no runs in {args.mlflow}")
        return 0
    if not args.output_dir:
        raise ConfigError("report: pass a job's --output-dir (or --mlflow URI)")
    from .remote import localize
    local = localize(args.output_dir, "report")  # a URL's files are fetched; the chart then goes to ./report.png
    print(render_text(local).replace(local, args.output_dir, 1))
    png = plot(local, args.png or (os.path.join(local, "report.png") if local == args.output_dir else "report.png"))
    if png:
        print(f"\n  chart: {png}")
    return 0
