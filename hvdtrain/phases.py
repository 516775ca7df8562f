"""Where a training step's time goes: data wait, forward, backward, allreduce wait, optimizer step, the rest.

The Trainer opens a step and the backend marks each phase it enters; a phase ends when the next one begins, so the
phases of a step always add up to the step's time. Clocks are the host's: exact on CPU PyTorch, where every operation
returns when it is done. On an asynchronous engine (MXNet always, PyTorch on CUDA) the host clock measures the launch,
and the wait lands in the phase that first needs a result. ``--profile-steps N`` synchronises the device between
phases on every N-th step and takes the phase times from those steps only; the other steps add no synchronisation.

Framework-agnostic: the backend hands in its ``synchronize`` function.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .threads import ROLES, per_step

PHASES = ("data", "forward", "backward", "allreduce", "step", "other")
"""The phases in the order a step runs them. ``other``: reading the loss back (where an asynchronous engine's queued
work is waited for), callbacks, logging and mid-epoch checkpoints."""


class PhaseTimer:
    """Per-phase seconds of the steps of one epoch on this rank.

    ``observer(phase)`` (the heartbeat) is told of every phase entered; it must be cheap.
    """

    def __init__(self, synchronize: Optional[Callable[[], None]] = None, profile_every: int = 0,
                 observer: Optional[Callable[[str], None]] = None):
        self.synchronize, self.profile_every, self.observer = synchronize, profile_every, observer
        self.reset()
        self._phase: Optional[str] = None
        self._since = 0.0
        self._timing = False

    def configure(self, profile_every: int = 0, observer: Optional[Callable[[str], None]] = None) -> "PhaseTimer":
        """Time every step (0) or each ``profile_every``-th with the device synchronised; tell ``observer``."""
        self.profile_every, self.observer = profile_every, observer
        return self

    def reset(self) -> None:
        """A new epoch: zero the sums."""
        self.totals: Dict[str, float] = {p: 0.0 for p in PHASES}
        self.steps = 0

    def begin_step(self, global_step: int) -> None:
        """Opens step ``global_step`` (counted from 1) in its ``data`` phase."""
        every = self.profile_every
        self._timing = not every or global_step % every == 0
        self._phase, self._since = None, time.perf_counter()
        self.enter("data")

    def enter(self, phase: str) -> None:
        """Ends the current phase and starts ``phase`` (a phase may be entered several times in one step, e.g. the
        forward and backward of each accumulated micro-batch)."""
        if self.observer is not None:
            self.observer(phase)
        if self._phase is None and phase != "data":
            return  # outside a step (evaluation, setup): nothing is timed
        self._close()
        self._phase = phase

    def end_step(self) -> None:
        self._close()
        if self._timing:
            self.steps += 1
        self._phase = None

    def _close(self) -> None:
        if self._phase is None:
            return
        if self._timing and self.profile_every and self.synchronize is not None:
            self.synchronize()
        now = time.perf_counter()
        if self._timing:
            self.totals[self._phase] += now - self._since
        self._since = now

    def local_means(self) -> Dict[str, float]:
        """Seconds per timed step, by phase, on this rank."""
        n = max(self.steps, 1)
        return {p: self.totals[p] / n for p in PHASES}


CLOCKS = {
    "host": "host clocks on a synchronous device (CPU PyTorch): exact",
    "launch": "host clocks on an asynchronous device: launch times; waits land in the first phase that needs a "
              "result ('other' on MXNet, where the loss is read); --profile-steps N for exact phases",
    "synchronized": "the device synchronised between phases every --profile-steps steps: exact",
}
"""The values of the record's ``phase_clock`` and what they mean."""


def summarize(per_rank: List[Dict[str, float]], clock: str, step_seconds: List[float]) -> Dict[str, object]:
    """The epoch record's timing fields from every rank's per-phase means (rank order): the mean across ranks, the
    slowest rank of each phase, how the clocks were read (a key of :data:`CLOCKS`), and ``step_seconds``, the
    mean across ranks of each rank's own training time per step, measured apart from the phases."""
    size = len(per_rank)
    means = {p: sum(r[p] for r in per_rank) / size for p in PHASES}
    slowest = {}
    for p in PHASES:
        rank = max(range(size), key=lambda i: per_rank[i][p])
        slowest[p] = {"rank": rank, "seconds": per_rank[rank][p]}
    return {"phase_seconds": means, "phase_slowest": slowest, "step_seconds": sum(step_seconds) / size,
            "phase_clock": clock}


COMPUTE_PHASES = ("data", "forward", "backward", "step", "other")
"""The phases a rank spends on its own work. The allreduce phase is waiting for the others: the longest wait is on
the fastest rank, so it names no straggler."""


def stragglers(record: Dict[str, object], ratio: float = 1.25, share: float = 0.10) -> List[str]:
    """Lines naming each rank that is slower than the mean of the ranks in a compute phase by ``ratio``, where the
    difference is at least ``share`` of the step time."""
    out = []
    means, slowest = record.get("phase_seconds") or {}, record.get("phase_slowest") or {}
    step = sum(means.values())
    # Launch times say nothing of the work; only the data wait, on the host, is measured there.
    for p in ("data",) if record.get("phase_clock") == "launch" else COMPUTE_PHASES:
        if p not in means or p not in slowest:
            continue
        s, m = slowest[p]["seconds"], means[p]
        if s > ratio * m and s - m > share * step:
            out.append(f"rank {slowest[p]['rank']} is slowest in {p}: {1000 * s:.1f} ms/step against "
                       f"{1000 * m:.1f} ms/step on average")
    return out


def format_phases(means: Dict[str, float], phases: Iterable[str] = PHASES) -> str:
    total = sum(means.get(p, 0.0) for p in phases) or 1.0
    return "  ".join(f"{p} {1000 * means.get(p, 0.0):.1f}ms ({100 * means.get(p, 0.0) / total:.0f}%)" for p in phases)


def epoch_timing(timer: PhaseTimer, backend, profiled: bool, steps: int, train_seconds: float, epoch_seconds: float,
                 cpu_seconds: float, threads: Optional[Dict[str, float]] = None
                 ) -> Tuple[Dict[str, Any], Dict[str, float]]:
    """An epoch's per-phase step times across the job: every rank's phase means, its training time, its time for the
    whole epoch and its process's CPU time while training, by thread role too (:mod:`hvdtrain.threads`), gathered in
    one collective (``backend.allgather_floats``); the phases averaged with the slowest rank of each
    (:func:`summarize`), every rank's CPU seconds per step, in all and by thread role, and the slowest rank's training
    and epoch time, which are the job's."""
    local = timer.local_means()
    by_role = per_step(threads or {}, steps)
    rows = backend.allgather_floats([local[p] for p in PHASES] + [train_seconds, epoch_seconds, cpu_seconds] + by_role)
    clock = "synchronized" if profiled else "launch" if backend.asynchronous else "host"
    n = len(PHASES)
    timing = summarize([dict(zip(PHASES, row)) for row in rows], clock, [row[n] / max(steps, 1) for row in rows])
    timing["cpu_seconds_per_step"] = [round(row[n + 2] / max(steps, 1), 6) for row in rows]  # by rank
    if threads is not None:
        timing["thread_cpu_per_step"] = {role: [round(row[n + 3 + i], 6) for row in rows]  # by role, then rank
                                         for i, role in enumerate(ROLES)}
    return timing, {"train_seconds": max(row[n] for row in rows), "epoch_seconds": max(row[n + 1] for row in rows)}
