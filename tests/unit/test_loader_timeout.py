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
