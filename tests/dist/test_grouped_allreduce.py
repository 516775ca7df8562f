"""Gradients as grouped allreduces (--allreduce-groups, the CPU default) mean what per-gradient allreduces mean, and
--fp16-allreduce and --predivide act on both.

Each rank's gradient is 40,000 per element: their sum (80,000 on 2 ranks) overflows float16 (max 65,504) when the
gradients are fp16-compressed for the allreduce, unless --predivide divides them before the sum. So a grouped path
that drops the predivide factor (Horovod 0.28.1's PyTorch one does) turns the average into inf here.
"""
import numpy as np
import pytest

GRAD = 40000.0


def _torch_optimizer(params, predivide=1.0, groups=1):
    """What the PyTorch backend builds: hvdtrain's grouped optimizer, or Horovod's per-gradient one (groups=0)."""
    import horovod.torch as hvd
    import torch
    from hvdtrain.backends.torch_groups import distributed_optimizer
    opt = torch.optim.SGD([p for _, p in params], lr=0.0)
    if groups == 0:
        return hvd.DistributedOptimizer(opt, named_parameters=params, compression=hvd.Compression.fp16,
                                        gradient_predivide_factor=predivide)
    return distributed_optimizer(opt, params, hvd.Compression.fp16, 1, predivide, groups)


def _average(framework, predivide: float, groups: int) -> np.ndarray:
    """The averaged gradient of a weight whose gradient is GRAD on every rank (fp16 compression)."""
    if framework == "torch":
        import torch
        w = torch.nn.Parameter(torch.zeros(4))
        opt = _torch_optimizer([("w", w)], predivide, groups)
        (w * GRAD).sum().backward()
        opt.synchronize()
        return w.grad.numpy()
    import horovod.mxnet as hvd
    import mxnet as mx
    net = mx.gluon.nn.Dense(4, in_units=1, use_bias=False)
    net.initialize(mx.init.Zero())
    trainer = hvd.DistributedTrainer(net.collect_params(), mx.optimizer.SGD(learning_rate=0.0),
                                     compression=hvd.Compression.fp16, gradient_predivide_factor=predivide,
                                     num_groups=groups)
    with mx.autograd.record():
        loss = (net(mx.nd.ones((1, 1))) * GRAD).sum()
    loss.backward()
    trainer.allreduce_grads()
    return net.weight.grad().asnumpy()


@pytest.mark.parametrize("groups", [1, 0])
@pytest.mark.parametrize("predivide", [1.0, 2.0])
def test_fp16_compression_and_predivide_reach_the_allreduce(framework, ops, predivide, groups):
    # With and without groups (the CPU default and the GPU one): --fp16-allreduce is what overflows, --predivide what
    # keeps the sum in range.
    average = _average(framework, predivide, groups)
    if ops.hvd.size() * GRAD <= 65504:
        pytest.skip(f"{ops.hvd.size()} rank(s): the sum of the gradients fits in float16 either way")
    if predivide == 1.0:  # the test can fail: without the factor the fp16 sum overflows
        assert not np.isfinite(average).any(), average
    else:
        np.testing.assert_array_equal(average, np.full_like(average, GRAD))


def test_torch_groups_pickle_nothing_and_count_an_uncomputed_gradient_as_zeros(framework, ops, monkeypatch):
    if framework != "torch":
        pytest.skip("PyTorch's grouped optimizer (horovod.mxnet's DistributedTrainer groups all of its gradients)")
    import horovod.torch.functions
    import horovod.torch.optimizer
    import torch

    def refuse(*_a, **_k):
        raise AssertionError("broadcast_object (a pickled collective) was called")
    monkeypatch.setattr(horovod.torch.optimizer, "broadcast_object", refuse)
    monkeypatch.setattr(horovod.torch.functions, "broadcast_object", refuse)
    rank = ops.hvd.rank()
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = _torch_optimizer([("a", a), ("b", b)], groups=1)
    loss = a.sum() * (rank + 1) + (b.sum() if rank == 0 else 0.0)  # b gets no gradient on the other ranks
    loss.backward()
    opt.synchronize()  # Horovod's grouped path would allreduce b alone here, under another name: a stall
    size = ops.hvd.size()
    np.testing.assert_allclose(a.grad.numpy(), np.full(3, (size + 1) / 2))
    np.testing.assert_allclose(b.grad.numpy(), np.full(2, 1.0 / size))


def test_torch_buckets_send_the_last_layers_group_before_the_backward_pass_reaches_the_first(framework, ops):
    """Auto on the CPU (DDP's buckets in the backward pass's order): the last layer's gradients (1.3 MB, a bucket of
    their own) are handed to Horovod while the backward pass still has the first layer to do; groups cut in forward
    order or by name waited for the first layer's gradients, so nothing left before the pass ended."""
    if framework != "torch":
        pytest.skip("PyTorch's grouped optimizer")
    import torch
    from hvdtrain.backends.torch_groups import BUCKETS
    torch.manual_seed(0)
    first, last = torch.nn.Linear(8, 16), torch.nn.Linear(16, 20000)
    model = torch.nn.Sequential(first, last)
    opt = _torch_optimizer(list(model.named_parameters()), groups=BUCKETS)
    submitted = []

    class Probe(torch.autograd.Function):  # its backward runs between the two layers' backward passes
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            submitted.append([[id(p) for p in key] for key in opt._handles if isinstance(key, tuple)])
            return grad

    last(Probe.apply(first(torch.ones(4, 8)))).sum().backward()
    assert submitted == [[[id(last.bias), id(last.weight)]]], "the last layer's group had not left mid-backward"
    opt.synchronize()
    np.testing.assert_allclose(last.bias.grad.numpy(), np.full(20000, 4.0))  # the same on every rank: the average
    assert not opt._handles  # every group waited for
