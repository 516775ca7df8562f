"""A data loader worker that hangs fails the job within --stall-timeout, as a stalled collective does, instead of
leaving every rank waiting for its batch (the PyTorch backend's DataLoader with --num-workers); and a worker dies
with its rank, on both frameworks."""
import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from hvdtrain.backends import make_backend  # noqa: E402


class Hangs(torch.utils.data.Dataset):
    """The first sample never arrives (a worker stuck on a lock or a dead file system)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(600)


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(0.2)
        return torch.full((2,), float(i)), i


def backend(stall_timeout: float):
    b = make_backend("torch")
    b.device, b.worker_timeout = torch.device("cpu"), stall_timeout  # what init sets from --stall-timeout
    return b


def test_a_hung_worker_fails_within_the_stall_timeout_naming_the_option():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"delivered no batch within --stall-timeout \(2 s\)"):
        next(iter(backend(2).loader(Hangs(), range(4), 2, drop_last=True, num_workers=1)))
    assert time.monotonic() - start < 60  # 2 s and the worker's start, not the 600 s of the sleep


def test_a_worker_slower_than_the_main_thread_but_within_the_timeout_delivers_every_batch():
    batches = list(backend(5).loader(Slow(), range(4), 2, drop_last=True, num_workers=1))
    assert [b[1].tolist() for b in batches] == [[0, 1], [2, 3]]


KILLED_RANK = """
import os, sys, time
import torch
from hvdtrain.backends import make_backend

class Hangs(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        with open(sys.argv[1] + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(sys.argv[1] + ".part", sys.argv[1])
        time.sleep(600)

if sys.argv[2] == "torch":
    b = make_backend("torch")
    b.device = torch.device("cpu")
else:
    from hvdtrain.backends.gluoncv_compat import import_mxnet
    b = make_backend("mxnet")
    b.mx, b.rank, b.size = import_mxnet(), 0, 1
b.worker_timeout = 600.0
next(iter(b.loader(Hangs(), range(4), 2, drop_last=True, num_workers=1)))
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_worker_stuck_in_a_read_dies_with_its_killed_rank(framework, tmp_path):
    """A rank killed (by horovodrun after another rank failed, or the OOM killer) takes its loader workers with it:
    a worker stuck in a read used to live on, holding the rank's output pipes open, and horovodrun waited for them
    (a job that did not end after its failure)."""
    started = tmp_path / "worker.pid"
    if framework == "mxnet":
        pytest.importorskip("mxnet")
    rank = subprocess.Popen([sys.executable, "-c", KILLED_RANK, str(started), framework], start_new_session=True)
    worker = 0
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert rank.poll() is None and time.monotonic() < deadline, "the rank's worker never started its read"
            time.sleep(0.05)
        worker = int(started.read_text())
        assert _alive(worker)
        rank.send_signal(signal.SIGKILL)
        rank.wait(30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "the worker outlived its rank"
    finally:
        if rank.poll() is None:
            rank.kill()
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)


STUCK_AT_START = """
import os, sys, time
import torch
from hvdtrain.backends import make_backend
from hvdtrain.backends import torch as torch_backend

marks, mode = sys.argv[1], sys.argv[2]


def stuck():
    # As a child forked while another thread held CPython's list of threads (gh-112275): it never runs a line of the
    # worker, its worker_init_fn included. 'once': only the first child forked; 'always': every one.
    if mode == "once":
        try:
            os.close(os.open(marks + ".first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    with open(marks, "a") as f:
        f.write(f"{os.getpid()}\\n")
    while True:
        time.sleep(600)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((1,), float(i * i)), i


os.register_at_fork(after_in_child=stuck)
torch_backend.WORKER_START_SECONDS, torch_backend.WORKER_STARTS = 3.0, 3 if mode == "once" else 2
b = make_backend("torch")
b.device, b.worker_timeout = torch.device("cpu"), 30.0
torch.manual_seed(0)
try:
    got = [(x.flatten().tolist(), y.tolist())
           for x, y in b.loader(Squares(), range(24), 4, drop_last=False, num_workers=2)]
except RuntimeError as e:
    print(f"error: {e}")
    sys.exit(3)
want = [([float(i * i) for i in range(k, k + 4)], list(range(k, k + 4))) for k in range(0, 24, 4)]
print("batches equal" if got == want else f"batches differ: {got}")
print(f"rng {torch.rand(1).item()!r}")
"""


def _stuck_at_start(tmp_path, mode: str):
    marks = tmp_path / "stuck.pids"
    proc = subprocess.run([sys.executable, "-c", STUCK_AT_START, str(marks), mode], capture_output=True, text=True,
                          timeout=180)
    pids = [int(line) for line in marks.read_text().split()] if marks.exists() else []
    for pid in pids:  # whatever the outcome, nothing is left behind by the test
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    return proc, pids


def test_a_worker_stuck_at_its_start_is_killed_and_the_workers_start_again_with_the_same_batches(tmp_path):
    """A loader worker forked next to a starting or ending thread of its rank can hang before it runs a line
    (CPython gh-112275, in the Python this project runs on): it delivered no batch, so the job failed after
    --stall-timeout, and it outlived its rank, so the job did not end at all. Now the workers are started again,
    with the same random state: the same batches, and the rank's generator where it would have been."""
    proc, pids = _stuck_at_start(tmp_path, "once")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "batches equal" in proc.stdout, proc.stdout
    assert len(pids) == 1 and not _alive(pids[0]) or pytest.fail(f"the stuck worker {pids} was left running")
    # (3 s: a healthy worker takes milliseconds, and a slow one on a loaded machine is named too, and started again)
    warning = next((line for line in proc.stderr.splitlines() if "(start 1 of 3)" in line), "")
    assert warning.endswith("did not start within 3 s of their fork (start 1 of 3): killed, starting the loader's "
                            "workers again") and str(pids[0]) in warning, proc.stderr
    plain = subprocess.run([sys.executable, "-c", "import torch; torch.manual_seed(0); "
                            "import torch.utils.data as d; list(d.DataLoader(list(range(24)), batch_size=4, "
                            "num_workers=2)); print(f'rng {torch.rand(1).item()!r}')"],
                           capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip().splitlines()[-1] in proc.stdout  # one iterator's draw, not two


def test_workers_that_never_start_fail_the_rank_in_one_line_and_none_outlives_it(tmp_path):
    proc, pids = _stuck_at_start(tmp_path, "always")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "did not start 2 times in a row" in proc.stdout and "try --num-workers 0" in proc.stdout, proc.stdout
    assert len(pids) == 4, pids  # 2 workers, 2 starts
    left = [pid for pid in pids if _alive(pid)]
    assert not left, f"workers stuck at their start outlived the loader: {left}"
