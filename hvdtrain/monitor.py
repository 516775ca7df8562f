"""--monitor and --early-stop: which epoch is the best by one record key, and when to stop waiting for a better one.

The monitored value is one of the epoch record's keys (``train_loss``, ``val_loss``, ``val_NAME`` of each metric), all
of them averaged or summed over the ranks by an allreduce, so every rank holds the same number and takes the same
decision with no further collective. The state (best value, its epoch and global step, epochs since) is saved in each
checkpoint and comes back on resume, so a resumed run stops where an uninterrupted one would. Only complete epochs
are judged: an epoch cut short by ``--max-steps`` is neither a best nor a miss (the run that resumes it judges it
whole, as an uninterrupted run does).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Optional

from .config import ConfigError, parse_monitor_spec

BEST_DIR = "best"
"""OUTPUT_DIR/best/ holds the checkpoint of the best epoch (one file and its digest)."""


class Monitor:
    def __init__(self, spec: str, patience: int, goals: Dict[str, str]):
        """``spec``: ``KEY`` or ``KEY:min|max``; ``goals``: every key the task's records carry and its direction."""
        key, direction = parse_monitor_spec(spec)
        if key not in goals:
            raise ConfigError(f"--monitor {key}: this task's records have {', '.join(sorted(goals))}; choose one")
        self.key, self.goal, self.patience = key, direction or goals[key], patience
        self.best: Optional[float] = None
        self.best_epoch = 0
        self.best_step = 0
        """The global step of the best epoch's checkpoint (what OUTPUT_DIR/best/ must hold)."""
        self.since = 0
        """Epochs since the best one."""

    def observe(self, record: Dict[str, Any]) -> bool:
        """An epoch's record; True when it is the best so far (a NaN never is)."""
        value = record.get(self.key)
        better = value is not None and math.isfinite(value) and (
            self.best is None or (value < self.best if self.goal == "min" else value > self.best))
        if better:
            self.best, self.best_epoch, self.since = float(value), int(record["epoch"]), 0
            self.best_step = int(record.get("global_step", 0))
        else:
            self.since += 1
        return better

    @property
    def stop(self) -> bool:
        """--early-stop: no improvement for ``patience`` epochs in a row."""
        return bool(self.patience) and self.since >= self.patience

    def stopped(self, epoch: int, report: bool, output_dir: str) -> bool:
        """Before the next epoch, ``epoch`` epochs done: --early-stop's verdict (every rank decides alike, from
        allreduced values); with ``report`` (rank 0) a line says so and where the best epoch's checkpoint is."""
        if self.stop and report:
            print(f"hvdtrain: early stop after epoch {epoch}: {self.describe()}; the best "
                  f"epoch's checkpoint is in {os.path.join(output_dir, BEST_DIR)}", flush=True)
        return self.stop

    def describe(self) -> str:
        best = "none yet" if self.best is None else f"{self.best:.6g} at epoch {self.best_epoch}"
        return f"{self.key} ({self.goal}) has not improved for {self.since} epoch(s); best {best}"

    def state(self) -> Dict[str, Any]:
        return {"key": self.key, "goal": self.goal, "best": self.best, "best_epoch": self.best_epoch,
                "best_step": self.best_step, "since": self.since}

    def load(self, state: Optional[Dict[str, Any]]) -> None:
        """A checkpoint's monitor state, when it monitored the same key the same way."""
        if state and state.get("key") == self.key and state.get("goal") == self.goal:
            self.best, self.best_epoch, self.since = state["best"], int(state["best_epoch"]), int(state["since"])
            self.best_step = int(state.get("best_step") or 0)
