"""Where a rank's CPU goes, by thread: the training thread, Horovod's background thread, the transport's threads
(Gloo's or MPI's, or c10d's for DDP), the framework's own pools, Python threads, and threads that ended.

Linux keeps each thread's CPU time in ``/proc/self/task/TID/stat`` (user + system clock ticks). Threads have no
useful names (Horovod, Gloo, OpenMP and MXNet's engine leave them as the process's), so they are told apart by when
they were born and where they wait: the threads a collective library's start-up creates (``hvd.init()``,
``init_process_group``) are recorded around that one call (:func:`created_by`). Gloo's and MPI's threads wait in the
kernel's epoll/poll between messages (``/proc/self/task/TID/wchan``, sampled a few times: a running thread shows
none); of the others, the first born is Horovod's background thread (``hvd.init()`` starts it, and it builds the
transport). A thread that names itself is known by its name (:data:`NAMED`: hvdtrain's Horovod's thread for a large
allreduce, started later). Checked with gdb on a 2-rank job: the background thread in ``BackgroundThreadLoop``, the
two pollers in ``gloo::transport::tcp::Loop::run``. Python threads carry their own names. Every other thread is the
framework's (its intra-op and engine pools). Nothing here imports a framework; reading the table costs a few system
calls per thread.

A thread's wake-ups are its voluntary context switches (``/proc/self/task/TID/status``): each time it slept (in
epoll, on a lock, on a condition) and was woken. A transport thread's CPU is mostly paid per wake-up, so the two
counts together say whether it wakes too often or works too long each time.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Dict, Iterator, List, Optional, Set

ROLES = ("main", "horovod", "transport", "framework", "python", "ended")
"""The fixed order of the roles (an allgather sends them as one vector): the training (main) thread; Horovod's
background thread; the transport's threads (Gloo's, MPI's, c10d's); the framework's pools; Python threads other than
the main one (the heartbeat, loader threads); CPU of threads that ended during the interval."""

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_born: Dict[int, str] = {}  # TID -> role, for the threads recorded by created_by()


def _per_thread(pid: str, name: str, parse: Callable[[str], int]) -> Dict[int, int]:
    """``parse`` of every live thread's ``/proc/PID/task/TID/NAME``, by thread id; {} where /proc is missing (a thread
    that ended between the listing and the read is left out)."""
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return {}
    out = {}
    for tid in tids:
        try:
            with open(f"{base}/{tid}/{name}") as f:
                out[int(tid)] = parse(f.read())
        except (OSError, IndexError, ValueError, StopIteration):
            continue
    return out


def _cpu_ticks(stat: str) -> int:
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def _voluntary_switches(status: str) -> int:
    return int(next(line for line in status.splitlines() if line.startswith("voluntary_ctxt_switches:")).split()[1])


def thread_ticks(pid: str = "self") -> Dict[int, int]:
    """Every live thread's CPU time (user + system) in clock ticks, by thread id; {} where /proc is missing."""
    return _per_thread(pid, "stat", _cpu_ticks)


def thread_wakeups(pid: str = "self") -> Dict[int, int]:
    """Every live thread's voluntary context switches (its wake-ups from sleep), by thread id; {} without /proc."""
    return _per_thread(pid, "status", _voluntary_switches)


@contextlib.contextmanager
def created_by(first: str = "horovod", rest: str = "transport") -> Iterator[None]:
    """Record the threads created inside the block: the first created as ``first``, the others as ``rest``
    (``first=None``: all as ``rest``). Wrap exactly the library's start-up call, nothing else."""
    before = set(thread_ticks())
    yield
    new = sorted(set(thread_ticks()) - before)
    pollers = _pollers(new)
    others = [t for t in new if t not in pollers]
    for tid in new:
        _born[tid] = first if first and others and tid == others[0] else rest


def _pollers(tids, samples: int = 10, interval: float = 0.005) -> Set[int]:
    """Those of ``tids`` seen waiting in epoll or poll at least once in ``samples`` looks at their wchan."""
    import time
    seen: Set[int] = set()
    for _ in range(samples):
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/wchan") as f:
                    if "poll" in f.read():
                        seen.add(tid)
            except OSError:
                continue
        time.sleep(interval)
    return seen


NAMED = {"hvd beside": "horovod"}
"""Threads that name themselves, by their kernel name (``/proc/self/task/TID/comm``): hvdtrain's Horovod runs a large
allreduce on a thread of its own, started at the first one (scripts/patch_horovod.py fix 11)."""


def thread_names(pid: str = "self") -> Dict[int, str]:
    """Every live thread's kernel name, by thread id; {} where /proc is missing."""
    return _per_thread(pid, "comm", str.strip)


def role_of(tid: int, python: Dict[int, str], main: int, names: Optional[Dict[int, str]] = None) -> str:
    if tid == main:
        return "main"
    if tid in _born:
        return _born[tid]
    if names and names.get(tid) in NAMED:
        return NAMED[names[tid]]
    if tid in python:
        return "python"
    return "framework"


class ThreadCpu:
    """CPU seconds by role over an interval: ``start()``, then ``stop()`` returns {role: seconds} for every role of
    :data:`ROLES`, summing to the process's CPU time over the interval (threads that ended count as "ended")."""

    def __init__(self):
        self._start: Optional[Dict[int, int]] = None
        self._wakeups0: Dict[int, int] = {}
        self._cpu0 = 0.0
        self.wakeups: Dict[str, int] = {}
        """After ``stop()``: the live threads' wake-ups over the interval, by role (see the module's notes)."""

    def start(self) -> None:
        import time
        self._wakeups0 = thread_wakeups()
        self._start = thread_ticks()
        self._cpu0 = time.process_time()

    def stop(self) -> Dict[str, float]:
        import time
        out = {role: 0.0 for role in ROLES}
        if self._start is None:
            return out
        now, cpu = thread_ticks(), time.process_time() - self._cpu0
        python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        main = threading.main_thread().native_id or os.getpid()
        names = thread_names()
        for tid, ticks in now.items():
            out[role_of(tid, python, main, names)] += (ticks - self._start.get(tid, 0)) / _TICKS
        self.wakeups = {role: 0 for role in ROLES if role != "ended"}
        for tid, count in thread_wakeups().items():
            self.wakeups[role_of(tid, python, main, names)] += count - self._wakeups0.get(tid, 0)
        live = sum(out.values())
        out["ended"] = max(0.0, cpu - live)  # threads gone before stop() (ticks make the sum coarse: 10 ms)
        return out


def per_step(seconds: Dict[str, float], steps: int) -> List[float]:
    """The roles' seconds per step, in :data:`ROLES` order."""
    return [seconds.get(role, 0.0) / max(steps, 1) for role in ROLES]


def known_threads() -> Set[int]:
    """The thread ids recorded by :func:`created_by` (for tests)."""
    return set(_born)
