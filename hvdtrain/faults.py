"""Failing loudly: per-rank error files, heartbeats, and a one-line account of why a distributed job stopped.

When one rank fails, Horovod shuts down and every other rank raises "Horovod has been shut down" (or, on Gloo, a
timeout), which hides the real error (horovod#243, #2975). So every rank writes its own failure to
``OUTPUT_DIR/errors/rank-N.txt``, and each rank records its progress (step, phase, time) in
``OUTPUT_DIR/heartbeats/rank-N.json`` about once a second. A rank that stopped because of the others reads those
files (when the output directory is shared, as on one host or on a cluster file system) and reports the rank that
failed first, or the rank that stopped making progress.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from typing import List, Optional

COLLECTIVE_FAILURE_MARKERS = ("Horovod has been shut down", "Timed out waiting", "Connection reset by peer",
                              "Connection closed by peer", "HorovodInternalError", "Broken pipe")


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` only says that the job's collectives broke (the cause is on another rank)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in COLLECTIVE_FAILURE_MARKERS)


class RankReporter:
    """Heartbeats and error records of one rank in ``output_dir``.

    A daemon thread writes the heartbeat every ``interval`` seconds, also while the training thread waits inside a
    collective: a live rank that waits for others stays fresh, a stopped or killed rank goes stale, and among live
    ranks the one with the lowest step is the straggler. ``progress`` only sets two attributes: free on the fast path.
    """

    def __init__(self, output_dir: str, rank: int, interval: float = 1.0):
        self.rank, self.interval = rank, interval
        self.error_dir = os.path.join(output_dir, "errors")
        self.beat_dir = os.path.join(output_dir, "heartbeats")
        self.error_path = os.path.join(self.error_dir, f"rank-{rank}.txt")
        self.beat_path = os.path.join(self.beat_dir, f"rank-{rank}.json")
        self.step, self.phase = 0, "setup"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        for path in (self.error_path, self.beat_path):  # a new run: no stale reports of this rank
            if os.path.exists(path):
                os.unlink(path)

    def progress(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def start(self) -> "RankReporter":
        os.makedirs(self.beat_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._beat, name=f"hvdtrain-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        host = socket.gethostname()
        while not self._stop.is_set():
            tmp = f"{self.beat_path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump({"rank": self.rank, "step": self.step, "phase": self.phase, "time": time.time(),
                               "pid": os.getpid(), "host": host}, f)
                os.replace(tmp, self.beat_path)
            except OSError:
                pass  # diagnostics must never fail training
            self._stop.wait(self.interval)

    def record_error(self, exc: BaseException) -> str:
        os.makedirs(self.error_dir, exist_ok=True)
        body = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        header = {"rank": self.rank, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                  "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                  "collective": is_collective_failure(exc)}
        with open(self.error_path, "w") as f:
            f.write(json.dumps(header) + "\n" + body)
        return self.error_path


def _read_errors(error_dir: str) -> List[dict]:
    out = []
    if os.path.isdir(error_dir):
        for name in sorted(os.listdir(error_dir)):
            try:
                with open(os.path.join(error_dir, name)) as f:
                    header = json.loads(f.readline())
                header["file"] = os.path.join(error_dir, name)
                out.append(header)
            except (OSError, ValueError):
                continue
    return out


def _read_heartbeats(beat_dir: str) -> List[dict]:
    out = []
    if os.path.isdir(beat_dir):
        for name in os.listdir(beat_dir):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(beat_dir, name)) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    continue
    return sorted(out, key=lambda b: b.get("rank", 0))


def explain_failure(output_dir: str, rank: int, wait: float = 3.0) -> Optional[str]:
    """Why the job stopped, as seen from ``rank`` after a collective failure: the first real error of another
    rank, else the rank whose heartbeat is oldest. None when nothing can be told (no shared output directory)."""
    deadline = time.time() + wait
    error_dir = os.path.join(output_dir, "errors")
    while True:
        causes = [e for e in _read_errors(error_dir) if not e.get("collective") and e.get("rank") != rank]
        if causes or time.time() >= deadline:
            break
        time.sleep(0.2)
    if causes:
        first = min(causes, key=lambda e: e["time"])
        return f"the first failure was on rank {first['rank']} ({first['host']}): {first['error']} [{first['file']}]"
    beats = _read_heartbeats(os.path.join(output_dir, "heartbeats"))
    if len(beats) < 2:
        return None
    now = time.time()
    table = "; ".join(f"rank {b['rank']}: step {b['step']} ({b['phase']}), seen {now - b['time']:.0f}s ago"
                      for b in beats)
    stale = [b for b in beats if now - b["time"] > 5.0]
    if stale:
        b = min(stale, key=lambda b: b["time"])
        return (f"rank {b['rank']} ({b['host']}, pid {b['pid']}) stopped responding at step {b['step']} "
                f"({b['phase']}): stalled or killed [{table}]")
    behind = min(beats, key=lambda b: b["step"])
    if behind["step"] < max(b["step"] for b in beats):
        return f"rank {behind['rank']} ({behind['host']}) fell behind at step {behind['step']} [{table}]"
    return None
