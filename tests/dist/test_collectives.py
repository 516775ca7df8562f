"""Horovod's own collectives across the ranks, on the framework chosen by --framework."""
import numpy as np


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
