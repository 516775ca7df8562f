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
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import List, Optional

COLLECTIVE_FAILURE_MARKERS = ("Horovod has been shut down", "Timed out waiting", "Connection reset by peer",
                              "Connection closed by peer", "HorovodInternalError", "Broken pipe")


class JobFailed(RuntimeError):
    """This rank stopped because the job's collectives failed; the message names the rank that failed first (or
    stalled, or was cut off) and its error."""


def report_line(rank: Optional[int], message: str) -> None:
    """One line on stderr, prefixed with the rank: ``[rank N] hvdtrain: error: MESSAGE``."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}hvdtrain: error: {message}", file=sys.stderr, flush=True)


def mark_reported(exc: BaseException, rank: Optional[int], message: str) -> None:
    """Report ``exc`` in one line and mark it, so that the command line does not report it a second time."""
    report_line(rank, message)
    exc.hvdtrain_reported = True  # type: ignore[attr-defined]


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` only says that the job's collectives broke (the cause is on another rank)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in COLLECTIVE_FAILURE_MARKERS)


def summary(e: BaseException) -> str:
    """``e`` in one line: its type and first line, or, for an error a loader worker raised (PyTorch re-raises it
    as "Caught X in DataLoader worker process N" followed by the worker's traceback), the worker's own last line."""
    text = str(e)
    if text.startswith("Caught ") and "Original Traceback" in text:
        name, sep, message = [line for line in text.splitlines() if line.strip()][-1].strip().partition(": ")
        return f"{name.rpartition('.')[2]}{sep}{message} (in a loader worker)"
    return f"{type(e).__name__}: {text}".splitlines()[0]


def failure_to_raise(e: BaseException, reporter: "RankReporter", output_dir: str) -> Optional[BaseException]:
    """A rank's failure: written to OUTPUT_DIR/errors/rank-N.txt and named in one line on stderr. When the rank
    stopped only because the job's collectives broke (Horovod's own message, "Horovod has been shut down" or a Gloo
    timeout, hides the cause), the :class:`JobFailed` to raise instead, naming the rank that failed first and its
    error (read from the other ranks' error files and heartbeats); None when ``e`` itself is the cause."""
    path = reporter.record_error(e)
    rank = reporter.rank
    if not is_collective_failure(e):
        mark_reported(e, rank, summary(e)[:400] + f" (traceback: {path})")
        return None
    why = explain_failure(output_dir, rank)
    failure = JobFailed(f"stopped because the job's collectives failed ({str(e).splitlines()[0][:160]}); "
                        + (why if why else "the cause is on another rank: see its output above")
                        + f"; this rank's traceback: {path}")
    mark_reported(failure, rank, str(failure))
    return failure


class RankReporter:
    """Heartbeats and error records of one rank in ``output_dir``.

    A daemon thread writes the heartbeat every ``interval`` seconds, also while the training thread waits inside a
    collective: a live rank that waits for others stays fresh, a stopped or killed rank goes stale, and among live
    ranks the one with the lowest step is the straggler. ``progress`` only sets two attributes: free on the fast path.
    """

    def __init__(self, output_dir: str, rank: int, interval: float = 1.0):
        self.interval = interval
        self.error_dir = os.path.join(output_dir, "errors")
        self.beat_dir = os.path.join(output_dir, "heartbeats")
        self.rank = rank
        self.step, self.phase = 0, "setup"
        self.since = time.monotonic()  # when the phase was entered
        self.output_dir = output_dir
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stall_after = 0.0
        # The heartbeat thread's wait ends when a byte arrives on this pair: SIGUSR1's number (watch() makes it the
        # signal's wakeup fd) or stop()'s zero, which ends the wait at once rather than after up to one interval
        # (every rank's exit waited for it: 0.9 s of a 2-epoch MNIST run here).
        self._wakeup, self._wakeup_writer = socket.socketpair()
        for sock in (self._wakeup, self._wakeup_writer):
            sock.setblocking(False)
        self._signal_wakes = False  # SIGUSR1 writes to the pair (watch())
        self.host = host_label()
        # A port that only answers "this rank's host is up and reachable": after a collective failure the other
        # ranks probe it to tell a host cut off from the network from a rank that failed.
        self._probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._probe.bind(("", 0))
        self._probe.listen(64)
        self._probe.setblocking(False)
        self.probe_port = self._probe.getsockname()[1]
        self.addresses = own_addresses()
        for path in (self.error_path, self.beat_path):  # a new run: no stale reports of this rank
            if os.path.exists(path):
                os.unlink(path)

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        """An elastic reset renumbers the ranks: this rank's error file and heartbeat follow its new number."""
        self._rank = value
        self.error_path = os.path.join(self.error_dir, f"rank-{value}.txt")
        self.beat_path = os.path.join(self.beat_dir, f"rank-{value}.json")

    def progress(self, step: int, phase: str) -> None:
        self.step, self.phase, self.since = step, phase, time.monotonic()

    def enter(self, phase: str) -> None:
        """The training thread entered ``phase`` of the current step."""
        self.phase, self.since = phase, time.monotonic()

    def start(self) -> "RankReporter":
        os.makedirs(self.beat_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._beat, name=f"hvdtrain-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def watch(self, stall_after: float) -> None:
        """On this rank (rank 0), print the table of ranks (:func:`heartbeat_table`) on SIGUSR1, and once whenever
        this rank has made no progress for ``stall_after`` seconds while another rank is behind or silent.

        The signal is read by the heartbeat thread through a wakeup socket, so the table comes also while the
        training thread is blocked inside a collective. Call from the main thread, before :meth:`start`.
        """
        self._stall_after = stall_after
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # the default action would kill the process
        signal.set_wakeup_fd(self._wakeup_writer.fileno(), warn_on_full_buffer=False)
        self._signal_wakes = True

    def forget_ranks_from(self, size: int) -> None:
        """Remove the heartbeats of ranks ``size`` and up, left by an earlier, larger run in this output directory."""
        for name in os.listdir(self.beat_dir) if os.path.isdir(self.beat_dir) else []:
            stem = name[len("rank-"):-len(".json")] if name.startswith("rank-") and name.endswith(".json") else ""
            if stem.isdigit() and int(stem) >= size:
                os.unlink(os.path.join(self.beat_dir, name))

    def stop(self) -> None:
        """Stop the heartbeat thread, after one last heartbeat (a finished rank reads "done")."""
        self._stop.set()
        try:
            self._wakeup_writer.send(b"\0")
        except OSError:  # a second stop: the pair is closed
            pass
        if self._signal_wakes and threading.current_thread() is threading.main_thread():
            # Ignored from now on: at interpreter exit Python resets its handlers, and a late SIGUSR1 would kill.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            signal.set_wakeup_fd(-1)
            self._signal_wakes = False
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
            self._write_beat()
        self._probe.close()
        if not self._signal_wakes:  # (still the signal's wakeup fd when stopped from another thread: left open)
            self._wakeup.close()
            self._wakeup_writer.close()

    def _write_beat(self) -> None:
        tmp = f"{self.beat_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"rank": self.rank, "step": self.step, "phase": self.phase, "time": time.time(),
                           "in_phase": time.monotonic() - self.since, "pid": os.getpid(), "host": self.host,
                           "addresses": self.addresses, "probe_port": self.probe_port}, f)
            os.replace(tmp, self.beat_path)
        except OSError:
            pass  # diagnostics must never fail training

    def _beat(self) -> None:
        reported = None  # the (step, phase, since) a stall table was printed for
        while not self._stop.is_set():
            self._write_beat()
            if self._wait_for_signal():
                print(heartbeat_table(self.output_dir, "on SIGUSR1"), file=sys.stderr, flush=True)
            here = (self.step, self.phase, self.since)
            waited = time.monotonic() - self.since
            if self._stall_after and waited >= self._stall_after and here != reported \
                    and self.phase not in ("setup", "done"):
                beats = read_heartbeats(self.beat_dir)
                if any(_behind(b, beats) or _silent(b) for b in beats):
                    reported = here
                    print(heartbeat_table(self.output_dir, f"rank {self.rank} has waited {waited:.0f}s in "
                                                           f"{self.phase} at step {self.step}"),
                          file=sys.stderr, flush=True)

    def _wait_for_signal(self) -> bool:
        """Wait one heartbeat interval, answering probes; True when SIGUSR1 arrived meanwhile."""
        deadline = time.monotonic() + self.interval
        signalled = False
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([self._probe, self._wakeup], [], [], left)
            for sock in ready:  # stop()'s byte: the loop's condition ends the wait
                try:
                    if sock is self._probe:
                        sock.accept()[0].close()
                    else:
                        signalled = signalled or signal.SIGUSR1 in sock.recv(64)
                except OSError:
                    pass
        return signalled

    def record_error(self, exc: BaseException) -> str:
        os.makedirs(self.error_dir, exist_ok=True)
        body = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        header = {"rank": self.rank, "time": time.time(), "host": self.host, "pid": os.getpid(),
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


def read_heartbeats(beat_dir: str) -> List[dict]:
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


def host_label() -> str:
    """The name of this rank's host as the user gave it to the launcher (horovodrun -H), else its hostname."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def own_addresses() -> List[str]:
    """This host's IPv4 addresses where the other ranks can reach it: those of Horovod's interface when the launcher
    chose one (HOROVOD_GLOO_IFACE), else every address but loopback."""
    try:
        import psutil
        nics = psutil.net_if_addrs()
    except Exception:  # noqa: BLE001 - diagnostics only
        return []
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    names = [iface] if iface in nics else list(nics)
    return [a.address for n in names for a in nics[n]
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


def unreachable(beats: List[dict], rank: int, timeout: float = 2.0) -> List[dict]:
    """The heartbeats of the other ranks whose host answers on none of their addresses: down, or cut off from this
    one. A refused connection means the host is up (the rank's process is gone) and does not count; a stopped
    process still answers (the kernel accepts for it)."""
    out = []
    for b in beats:
        if b.get("rank") == rank or not b.get("addresses") or not b.get("probe_port"):
            continue
        for addr in b["addresses"]:
            try:
                socket.create_connection((addr, b["probe_port"]), timeout=timeout).close()
                break
            except ConnectionRefusedError:
                break
            except OSError:  # timed out, no route to host, network unreachable
                continue
        else:
            out.append(b)
    return out


STALE_SECONDS = 5.0
"""A heartbeat older than this: the rank stopped (SIGSTOP, a hung system call) or died."""

_ORDER = ("setup", "data", "forward", "backward", "allreduce", "step", "other", "metrics", "eval", "checkpoint", "done")


def _progress(beat: dict) -> tuple:
    phase = beat.get("phase", "")
    return beat.get("step", 0), _ORDER.index(phase) if phase in _ORDER else 0


def _behind(beat: dict, beats: List[dict]) -> bool:
    """True when ``beat``'s rank is at the earliest point (step, phase) among ranks that are not all at the same one."""
    points = {_progress(b) for b in beats}
    return len(points) > 1 and _progress(beat) == min(points)


def _silent(beat: dict, now: Optional[float] = None) -> bool:
    return (now or time.time()) - beat.get("time", 0) > STALE_SECONDS


def heartbeat_table(output_dir: str, why: str) -> str:
    """Every rank's last step and phase, how long it has been in that phase, and when it was last seen; the rank
    that is behind the others and any rank that went silent are marked. Read from OUTPUT_DIR/heartbeats/
    (every rank's, when the output directory is shared; this host's otherwise)."""
    beats = read_heartbeats(os.path.join(output_dir, "heartbeats"))
    now = time.time()
    lines = [f"hvdtrain: ranks {time.strftime('%H:%M:%S')} ({why})",
             f"  {'rank':>4}  {'host':<16} {'pid':>7}  {'step':>7}  {'phase':<10} {'in phase':>9}  {'seen':>9}"]
    for b in beats:
        mark = ""
        if _silent(b, now):
            mark = "  <- silent: stopped or killed?"
        elif _behind(b, beats):
            mark = "  <- behind: the others wait for this rank"
        lines.append(f"  {b.get('rank', '?'):>4}  {str(b.get('host', '?'))[:16]:<16} {b.get('pid', '?'):>7}  "
                     f"{b.get('step', '?'):>7}  {b.get('phase', '?'):<10} {b.get('in_phase', 0.0):>8.1f}s  "
                     f"{now - b.get('time', now):>5.1f}s ago{mark}")
    if not beats:
        lines.append("  (no heartbeats found)")
    return "\n".join(lines)


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
    beats = read_heartbeats(os.path.join(output_dir, "heartbeats"))
    if len(beats) < 2:
        return None
    now = time.time()
    table = "; ".join(f"rank {b['rank']}: step {b['step']} ({b['phase']}), seen {now - b['time']:.0f}s ago"
                      for b in beats)
    cut_off = unreachable(beats, rank)
    if cut_off:
        me = next((b for b in beats if b.get("rank") == rank), {})
        names = ", ".join(f"rank {b['rank']} on {b['host']} ({', '.join(b['addresses'])})" for b in cut_off)
        return (f"cannot reach {names} from rank {rank}" + (f" on {me['host']}" if me.get("host") else "")
                + f": that host is down or cut off from the network [{table}]")
    stale = [b for b in beats if _silent(b, now)]
    if stale:
        b = min(stale, key=lambda b: b["time"])
        return (f"rank {b['rank']} ({b['host']}, pid {b['pid']}) stopped responding at step {b['step']} "
                f"({b['phase']}): stalled or killed [{table}]")
    if len({_progress(b) for b in beats}) > 1:  # a live rank the others waited for (Horovod's stall shutdown)
        b = min(beats, key=_progress)
        return (f"rank {b['rank']} ({b['host']}, pid {b['pid']}) fell behind: {b.get('in_phase', 0.0):.0f}s in "
                f"{b['phase']} at step {b['step']} while the others waited [{table}]")
    return None
