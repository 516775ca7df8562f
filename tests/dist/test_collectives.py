"""Horovod's own collectives across the ranks, on the framework chosen by --framework."""
import numpy as np
import pytest


def test_allreduce_sums_and_averages(ops):
    hvd = ops.hvd
    size, rank = hvd.size(), hvd.rank()
    assert size >= 2, "run with at least 2 ranks"
    summed = ops.to_numpy(hvd.allreduce(ops.tensor([rank + 1.0, 10.0 * rank]), name="t.sum", op=hvd.Sum))
    np.testing.assert_allclose(summed, [size * (size + 1) / 2, 10.0 * size * (size - 1) / 2])
    averaged = ops.to_numpy(hvd.allreduce(ops.tensor([float(rank)]), name="t.avg", op=hvd.Average))
    np.testing.assert_allclose(averaged, [(size - 1) / 2])


def test_broadcast_from_root(ops):
    hvd = ops.hvd
    value = ops.to_numpy(hvd.broadcast(ops.tensor([hvd.rank() + 5.0] * 3), root_rank=0, name="t.bcast"))
    np.testing.assert_allclose(value, [5.0] * 3)


def test_allgather_concatenates_in_rank_order(ops):
    hvd = ops.hvd
    rows = hvd.rank() + 1  # ranks contribute different numbers of rows
    gathered = ops.to_numpy(hvd.allgather(ops.tensor([[float(hvd.rank())]] * rows), name="t.gather"))
    expected = [[float(r)] for r in range(hvd.size()) for _ in range(r + 1)]
    np.testing.assert_allclose(gathered, expected)


def test_backend_object_broadcast_and_metric_sum(framework):
    from hvdtrain.backends import make_backend
    from hvdtrain.config import TrainConfig
    backend = make_backend(framework)
    backend.init(TrainConfig(framework=framework))
    got = backend.broadcast_object({"rank": backend.rank, "text": "é" * 3} if backend.rank == 0 else None)
    assert got == {"rank": 0, "text": "é" * 3}
    total = backend.allreduce_sum({"one": 1.0, "rank": float(backend.rank)})
    assert total == {"one": float(backend.size), "rank": float(sum(range(backend.size)))}
    assert backend.threads >= 1


def test_the_stop_rule_is_decided_at_the_next_step_without_a_wait_at_its_own(framework):
    # Health's collective decision (every CHECK_EVERY steps) starts at its step and is read at the next: a wait at
    # once queued behind the step's gradients and held the next step back until they had all arrived (with
    # --overlap-forward, the second half's transfer that the next forward pass overlaps). Here rank 1 starts step
    # 10's decision only once rank 0 has got past its own step 10 (a file says so); a wait there would hold rank 0
    # until rank 1 gave up after 20 s, and this test fails. Both ranks then stop together at step 11.
    import os
    import tempfile
    import time
    from hvdtrain.backends import make_backend
    from hvdtrain.config import TrainConfig
    from hvdtrain.health import Health
    backend = make_backend(framework)
    backend.init(TrainConfig(framework=framework))
    rank = backend.rank
    passed = os.path.join(backend.broadcast_object(tempfile.mkdtemp() if rank == 0 else None), "rank 0 past step 10")
    health = Health(backend, 2, "ckpt")
    for step in range(1, 10):
        health.observe(float("nan") if rank == 1 and step == 9 else 0.5, step)
    if rank == 1:
        deadline = time.monotonic() + 20
        while not os.path.exists(passed) and time.monotonic() < deadline:
            time.sleep(0.02)
    health.observe(float("nan") if rank == 1 else 0.5, 10)  # rank 1: 2 in a row, the limit
    if rank == 0:
        open(passed, "w").close()
    with pytest.raises(FloatingPointError, match=r"at least 2 steps in a row \(up to step 10\)"):
        health.observe(0.5, 11)
    assert os.path.exists(passed), "rank 0 waited at step 10 for the stop rule's decision"
    health.observe(0.5, 20)
    health.conclude()  # the end of an epoch: nobody over the limit now
    assert health.pending is None
    if rank == 0:  # every rank has seen the file (the decision at step 10 needed them all)
        os.remove(passed)
        os.rmdir(os.path.dirname(passed))


def test_a_rank_waiting_for_a_late_partner_does_not_spin(ops, monkeypatch):
    # horovod.torch 0.28.1 waits for a collective by polling its handle in a loop: the waiting thread keeps a core
    # busy for as long as the slowest rank takes, which under a CPU quota is the share Horovod's background thread
    # needs to move the bytes (scripts/patch_horovod.py, fix 5: hvdtrain blocks under a quota, HOROVOD_SPIN_WAIT=0,
    # and keeps the spin on cores of the rank's own, where it measured faster). Rank 0 waits about 3 s for rank 1; its waiting
    # thread's own CPU time (time.thread_time: this thread only, not Horovod's) stays near zero. A spinning wait takes
    # about 1 s of CPU per second of waiting, half of that on a machine loaded with as many spinners as cores.
    import time
    hvd = ops.hvd
    if ops.framework != "torch":
        return  # horovod.mxnet waits through MXNet's engine, which blocks
    monkeypatch.setenv("HOROVOD_SPIN_WAIT", "0")  # read at each wait
    hvd.allreduce(ops.tensor([0.0]), name="t.late.ready")  # both ranks here
    late = 3.0
    if hvd.rank() == 1:
        time.sleep(late)
    wall, cpu = time.monotonic(), time.thread_time()
    total = ops.to_numpy(hvd.allreduce(ops.tensor([1.0]), name="t.late", op=hvd.Sum))
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    np.testing.assert_allclose(total, [float(hvd.size())])
    if hvd.rank() == 0:
        assert wall > 0.5 * late, wall  # it did wait for rank 1
        assert cpu < 0.1 * wall, f"the waiting thread used {cpu:.2f} s of CPU in {wall:.2f} s of waiting"
