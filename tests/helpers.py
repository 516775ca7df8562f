"""Running whole commands in tests: always under a hard timeout, killing every process of the job on expiry."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BIN = os.path.dirname(PY)
HOROVODRUN = os.path.join(BIN, "horovodrun")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    # Open MPI refuses root without these; harmless otherwise.
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # make test runs two jobs beside each other (pytest -n 2), so each job's ranks share the cores with another job's:
    # the case where horovod.torch's spinning wait takes the CPU the other ranks need, which spin_wait() cannot see
    # from one job (hvdtrain.backends.resources). The blocking wait instead: two MNIST jobs side by side on 2 cores
    # finished in 17-19 s against 20-23 s spinning. test_dist_suites runs the spinning wait (mpirun, torch).
    e.setdefault("HOROVOD_SPIN_WAIT", "0")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        parent = psutil.Process(proc.pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run(cmd, timeout: float, cwd: str = ROOT, **extra_env) -> Result:
    """Run ``cmd``; on timeout kill it with all its descendants and fail the test with the output so far."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = hang_report(proc, cmd)
        kill_tree(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s (a hang): {' '.join(cmd)}\n"
                             f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}\n--- where it hung\n{where}")
    return Result(proc.returncode, out, err)


def hang_report(proc: subprocess.Popen, cmd) -> str:
    """What every process of a job that ran past its timeout was doing, before it is killed: its state, CPU time and
    the kernel waits of its threads, its Python stacks (py-spy, a test dependency, where it can attach), and the
    job's heartbeat table when the command names an --output-dir: what a hang that does not repeat leaves to go by."""
    try:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    spy = shutil.which("py-spy", path=BIN + os.pathsep + os.environ.get("PATH", ""))
    lines = []
    for p in procs:
        try:
            with p.oneshot():
                head = (f"pid {p.pid} ({p.status()}, {sum(p.cpu_times()[:2]):.1f} CPU-s, {p.num_threads()} threads, "
                        f"waiting in {', '.join(sorted(_kernel_waits(p.pid))) or '?'}): {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            continue
        lines.append(head)
        if spy and "python" in p.name():
            try:  # with the native frames (a process frozen inside a C call shows which), else without them
                dump = subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True,
                                      timeout=30)
                if dump.returncode != 0:
                    dump = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                          timeout=30)
                lines.append("    " + (dump.stdout or dump.stderr).strip()[-3000:].replace("\n", "\n    "))
            except subprocess.TimeoutExpired:
                lines.append("    (py-spy did not answer in 30 s)")
    if "--output-dir" in cmd[:-1]:
        from hvdtrain.faults import heartbeat_table
        lines.append(heartbeat_table(cmd[cmd.index("--output-dir") + 1], "when the test's timeout expired"))
    return "\n".join(lines)


def _kernel_waits(pid: int) -> set:
    """The kernel functions the threads of ``pid`` sleep in (/proc/PID/task/TID/wchan): futex_wait, do_select, ..."""
    waits = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                waits.add(f.read().strip() or "running")
    except OSError:
        pass
    return waits


def hvdtrain(*args) -> list:
    return [PY, "-m", "hvdtrain", *args]


def horovodrun(np: int, *cmd, gloo: bool = True) -> list:
    return [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}"] + (["--gloo"] if gloo else []) + list(cmd)


def mpirun(np: int, *cmd) -> list:
    return ["mpirun", "-np", str(np), "-H", f"localhost:{np}", "-bind-to", "none", "-map-by", "slot",
            "-mca", "pml", "ob1", "-mca", "btl", "^openib", "-x", "PATH", "-x", "PYTHONPATH"] + list(cmd)


def have_mpirun() -> bool:
    return shutil.which("mpirun") is not None


def describe(result: Result) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"


def why_no_netns() -> str:
    """Why network-namespace hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"ip netns is unavailable here: {probe.stderr.strip()}"
    return ""


@contextlib.contextmanager
def cluster_up(script: str, state: str, hosts: int, why_not: str = ""):
    """``bash SCRIPT up STATE HOSTS`` (scripts/netns_cluster.sh, scripts/slurm_cluster.sh), then ``down STATE`` when
    the block ends, however it ends; ``down`` must succeed. Skips with the reason when ``why_not`` names one, or when
    the script says it needs something this machine lacks."""
    import pytest
    if why_not:
        pytest.skip(why_not)
    up = subprocess.run(["bash", script, "up", state, str(hosts)], capture_output=True, text=True, timeout=600)
    try:
        if up.returncode != 0 and "needs" in up.stderr:
            pytest.skip(up.stderr.strip())
        assert up.returncode == 0, up.stdout + up.stderr
        yield
    finally:
        down = subprocess.run(["bash", script, "down", state], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def cluster_state(state: str):
    """What ``netns_cluster.sh up STATE`` made: the namespaces' prefix, and the hosts' names -> addresses."""
    with open(os.path.join(state, "env")) as f:
        prefix = dict(line.strip().split("=", 1) for line in f if "=" in line)["NETNS_PREFIX"]
    with open(os.path.join(state, "hosts")) as f:
        return prefix, dict(line.split() for line in f if line.strip())


def hvdtrain_processes(namespace: str, also: tuple = ()) -> dict:
    """The hvdtrain processes running in network namespace ``namespace`` (and those whose command line holds one of
    ``also``): pid -> command line."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "hvdtrain" in args or any(a in args for a in also):
            out[pid] = args
    return out


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    """True once something accepts connections on the loopback at ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
