"""A data loader worker that hangs fails the job within --stall-timeout, as a stalled collective does, instead of
leaving every rank waiting for its batch (the PyTorch backend's DataLoader with --num-workers)."""
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
