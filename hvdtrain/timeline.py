"""``--timeline-steps A:B``: Horovod's timeline recorded for a window of global steps, on every rank; and its summary
(:func:`summarize`: per collective, the medians of its negotiation, fusion copies and transfer, and how long the link
carried transfers per step), which ``hvdtrain report`` prints and ``bench network --timeline-steps`` records."""
from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any, Dict, List, Tuple


DEFAULT_WINDOW = "1:20"
"""The window of a timeline asked for by --timeline-file alone."""


def parse_window(text: str) -> Tuple[int, int]:
    """(A, B) of ``--timeline-steps A:B``; a ConfigError in one line otherwise."""
    from .basics import ConfigError
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        raise ConfigError(f"--timeline-steps must be A:B (global steps, e.g. 100:110), got {text!r}") from None
    if not 1 <= a <= b:
        raise ConfigError(f"--timeline-steps A:B needs 1 <= A <= B, got {text!r}")
    return a, b


def recorded_steps(text: str, last_step: int) -> Tuple[int, int]:
    """The first and last step a window ``text`` (A:B) recorded in a run whose last global step was ``last_step``
    (a window past the run's end closed at it)."""
    first, last = parse_window(text)
    return first, min(last, last_step)


class TimelineWindow:
    """Starts Horovod's timeline before global step A and stops it after step B (or at the end of training)."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend = cfg, backend
        self.state = "off"  # then the file being written, then "done"

    def before_step(self, step: int) -> None:
        """Before global step ``step`` (counted from 1)."""
        window = self.cfg.timeline_window()
        if window is None or self.state != "off" or not window[0] <= step <= window[1]:
            return
        path = self.cfg.timeline_file or os.path.join(self.cfg.output_dir, "timeline.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.backend.start_timeline(path)
        self.state = path

    def after_step(self, step: int, end: bool = False) -> None:
        """After global step ``step``; ``end``: training is over."""
        window = self.cfg.timeline_window()
        if window is None or self.state in ("off", "done") or not (step >= window[1] or end):
            return
        self.backend.stop_timeline()
        if self.backend.rank == 0:
            print(f"hvdtrain: Horovod timeline of steps {window[0]}..{min(window[1], step)} written to "
                  f"{self.state} (open it in chrome://tracing or ui.perfetto.dev)", flush=True)
        self.state = "done"


def read_events(path: str) -> List[Dict[str, Any]]:
    """The events of a Horovod timeline file (Chrome trace JSON); a file whose writer was cut off before its closing
    bracket is read up to its last whole event."""
    with open(path) as f:
        text = f.read().strip()
    if not text.endswith("]"):
        text = text.rstrip().rstrip(",")
        text = text[:text.rfind("}") + 1] + "]"
    return json.loads(text)


_MEMBER = re.compile(r"_\d+of\d+$")


def summarize(path: str, steps: int) -> Dict[str, Any]:
    """Where the window's collectives spent their time, from rank 0's timeline of ``steps`` steps: per collective (a
    grouped allreduce's members taken together), how many it ran and the median of its negotiation (from this rank's
    request to the agreement of all: the wait for the slowest rank's tensor and for the transfers queued before it),
    its copies into and out of the fusion buffer and its transfer (Gloo's or MPI's operation); and the time the
    transfers kept the link busy (the union of their spans), per step and as a fraction of the window (the first
    event to the last)."""
    names: Dict[int, str] = {}
    members: Dict[str, int] = {}
    spans: Dict[Tuple[str, str], Dict[float, float]] = {}  # (collective, activity) -> start of each run -> seconds
    open_: Dict[int, List[Tuple[str, float]]] = {}
    transfers: List[Tuple[float, float]] = []
    first, last = float("inf"), float("-inf")
    for e in read_events(path):
        pid, phase = e.get("pid"), e.get("ph")
        if phase == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[pid] = _MEMBER.sub("", e["args"]["name"])
            members[names[pid]] = members.get(names[pid], 0) + 1
        elif phase == "B":
            open_.setdefault(pid, []).append((e["name"], e["ts"] / 1e6))
            first = min(first, e["ts"] / 1e6)
        elif phase == "E" and open_.get(pid):
            activity, start = open_[pid].pop()
            end = e["ts"] / 1e6
            last = max(last, end)
            kind = ("negotiation" if activity.startswith("NEGOTIATE_") else
                    "copy in" if activity == "MEMCPY_IN_FUSION_BUFFER" else
                    "copy out" if activity == "MEMCPY_OUT_FUSION_BUFFER" else
                    "transfer" if activity.startswith(("GLOO_", "MPI_", "NCCL_", "CCL_")) else None)
            if kind is None or pid not in names:
                continue
            runs = spans.setdefault((names[pid], kind), {})
            # a group's members run together: the run is the earliest start among them within a millisecond
            key = next((s for s in runs if abs(s - start) < 1e-3), start)
            runs[key] = max(runs.get(key, 0.0), end - start)
            if kind == "transfer":
                transfers.append((start, end))
    return _summary(spans, members, transfers, first, last, steps)


def summarize_transfers(runs: List[Tuple[str, int, float, float]], steps: int) -> Dict[str, Any]:
    """:func:`summarize`'s result from transfers timed elsewhere (``bench network``'s DDP arms time each bucket's
    allreduce in a comm hook): ``runs`` as (collective, its tensors, start, end) in seconds; the window from the first
    start to the last end."""
    spans: Dict[Tuple[str, str], Dict[float, float]] = {}
    members: Dict[str, int] = {}
    for name, tensors, start, end in runs:
        spans.setdefault((name, "transfer"), {})[start] = end - start
        members[name] = tensors
    first = min((r[2] for r in runs), default=0.0)
    last = max((r[3] for r in runs), default=0.0)
    return _summary(spans, members, [(r[2], r[3]) for r in runs], first, last, steps)


def _summary(spans: Dict[Tuple[str, str], Dict[float, float]], members: Dict[str, int],
             transfers: List[Tuple[float, float]], first: float, last: float, steps: int) -> Dict[str, Any]:
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(transfers):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    collectives: Dict[str, Dict[str, Any]] = {}
    for (name, kind), runs in sorted(spans.items()):
        entry = collectives.setdefault(name, {"tensors": members.get(name, 1), "runs": 0})
        if kind == "transfer" or not entry["runs"]:
            entry["runs"] = len(runs)  # the transfers (a window may cut a negotiation off from its transfer)
        entry[kind] = statistics.median(runs.values())
    window = max(0.0, last - first)
    return {"steps": steps, "window_seconds": window, "transfer_busy_seconds_per_step": busy / max(1, steps),
            "transfer_busy_fraction": busy / window if window else 0.0, "collectives": collectives}


def describe_summary(summary: Dict[str, Any], whose: str = "the timeline's") -> List[str]:
    """:func:`summarize` in lines, the longest transfers first; ``whose`` steps they were."""
    lines = [f"{whose} {summary['steps']} steps ({summary['window_seconds']:.2f} s): the link carried "
             f"transfers {1e3 * summary['transfer_busy_seconds_per_step']:.1f} ms a step, "
             f"{100 * summary['transfer_busy_fraction']:.0f}% of the window"]
    ordered = sorted(summary["collectives"].items(), key=lambda kv: -kv[1].get("transfer", 0.0) * kv[1]["runs"])
    for name, c in ordered:
        lines.append(f"{name} ({c['tensors']} tensor{'s' if c['tensors'] > 1 else ''}): {c['runs']} run(s), medians: "
                     + ", ".join(
            f"{kind} {1e3 * c[kind]:.1f} ms" for kind in ("negotiation", "copy in", "transfer", "copy out")
            if kind in c))
    return lines
