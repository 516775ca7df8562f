"""Callbacks observe training; they never change its state. The Trainer gives them to rank 0 only.

Every record a callback sees has already been averaged across ranks by the Trainer.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from .phases import format_phases, stragglers


class Callback:
    """Hooks called by the Trainer on rank 0. ``record`` is one epoch's metrics (see metrics.jsonl).

    Pass instances to ``Trainer(cfg, callbacks=[...])``; each method does nothing unless overridden."""

    def on_train_start(self, trainer, start_epoch: int) -> None:
        """Before the first epoch; ``start_epoch`` epochs are already complete (a resumed run)."""

    def on_epoch_start(self, trainer, epoch: int, steps: int) -> None:
        """Before epoch ``epoch`` (counted from 0), which has ``steps`` optimizer steps left to run."""

    def on_step_end(self, trainer, epoch: int, step_in_epoch: int, global_step: int, lr: float) -> None:
        """After each optimizer step: its place in the epoch and in the run, and the learning rate it used. With
        ``--overlap-forward`` one layer's update is still on its way here: call ``trainer.backend.settle()`` before
        reading the weights."""

    def on_log(self, trainer, global_step: int, metrics: Dict[str, float]) -> None:
        """Every ``--log-every`` steps: the running training means (``loss``...), averaged across ranks."""

    def on_epoch_end(self, trainer, record: Dict[str, Any]) -> None:
        """After each epoch's evaluation, before its checkpoint: its record (a line of metrics.jsonl)."""

    def on_train_end(self, trainer, last: Optional[Dict[str, Any]]) -> None:
        """After the last epoch (or --max-steps, --early-stop): the last record, None when nothing was trained."""


def _is_share(key: str) -> bool:
    """Whether a record key is an accuracy (``val_accuracy``, ``val_topK``), shown as a percentage."""
    name = key[4:] if key.startswith("val_") else key
    return name == "accuracy" or (name.startswith("top") and name[3:].isdigit())


def format_figures(figures: Dict[str, Any]) -> str:
    """Validation figures as ``key value`` pairs, accuracies (``val_accuracy``, ``val_topK``) as percentages."""
    def one(key, value):
        return f"{key} {100 * value:.2f}%" if _is_share(key) else f"{key} {value:.6g}"
    return ", ".join(one(k, v) for k, v in figures.items() if v is not None)


def format_record(r: Dict[str, Any], epochs: int) -> str:
    """An epoch's record as one line: losses, every val_ metric (accuracies as percentages), throughput."""
    parts = [f"epoch {r['epoch']}/{epochs}", f"train_loss {r['train_loss']:.4f}"]
    if r.get("val_loss") is not None:
        parts.append(f"val_loss {r['val_loss']:.4f}")
        for key, value in r.items():
            if key.startswith("val_") and key != "val_loss" and value is not None:
                if _is_share(key):
                    parts.append(f"{'val_acc' if key == 'val_accuracy' else key[4:]} {100 * value:.2f}%")
                else:
                    parts.append(f"{key} {value:.4g}")
    if "images_per_sec" in r:
        parts.append(f"{r['images_per_sec']:.0f} img/s")
    else:
        parts.append(f"{r['samples_per_sec']:.0f} samples/s")
    if "tokens_per_sec" in r:
        parts.append(f"{r['tokens_per_sec']:.0f} tokens/s")
    parts += [f"{r['epoch_seconds']:.1f}s", f"lr {r['lr']:.4g}"]
    return "  ".join(parts)


class ProgressLogger(Callback):
    """A tqdm bar per epoch when stderr is a terminal; always one plain line per epoch on stdout."""

    def __init__(self, stream=None, bar: Optional[bool] = None):
        self.stream = stream or sys.stdout
        self.bar_enabled = sys.stderr.isatty() if bar is None else bar
        self.bar = None

    def on_epoch_start(self, trainer, epoch, steps):
        if self.bar_enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{trainer.cfg.epochs}", leave=False,
                            dynamic_ncols=True)

    def on_step_end(self, trainer, epoch, step_in_epoch, global_step, lr):
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, trainer, global_step, metrics):
        text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(f"step {global_step}  {text}", file=self.stream, flush=True)

    def on_epoch_end(self, trainer, record):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        print(format_record(record, trainer.cfg.epochs), file=self.stream, flush=True)
        if record.get("phase_seconds"):
            print(f"  step {1000 * record['step_seconds']:.1f}ms: {format_phases(record['phase_seconds'])}",
                  file=self.stream, flush=True)
        for line in stragglers(record):
            print(f"  straggler: {line}", file=self.stream, flush=True)


class MetricsFile(Callback):
    """``metrics.jsonl``: one JSON object per epoch. On resume, records after the resumed epoch are dropped."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, start_epoch):
        kept: List[str] = []
        if start_epoch > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["epoch"] <= start_epoch:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue
        with open(self.path, "w") as f:
            f.writelines(kept)

    def on_epoch_end(self, trainer, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class TensorBoard(Callback):
    """Scalars to ``tensorboard/`` event files, written with the tensorboard package alone (no framework needed)."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.writer = None

    def _scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def on_train_start(self, trainer, start_epoch):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        os.makedirs(self.logdir, exist_ok=True)
        self.writer = EventFileWriter(self.logdir)

    def on_log(self, trainer, global_step, metrics):
        for k, v in metrics.items():
            self._scalar(f"step/{k}", v, global_step)

    def on_epoch_end(self, trainer, record):
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch":
                self._scalar(f"epoch/{k}", v, record["epoch"])
        for phase, seconds in (record.get("phase_seconds") or {}).items():
            self._scalar(f"phase_seconds/{phase}", seconds, record["epoch"])
        for phase, slowest in (record.get("phase_slowest") or {}).items():
            self._scalar(f"phase_slowest_seconds/{phase}", slowest["seconds"], record["epoch"])
        self.writer.flush()

    def on_train_end(self, trainer, last):
        if self.writer is not None:
            self.writer.close()
