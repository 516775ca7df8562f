"""torch_groups.plan: the grouped allreduces follow the backward pass (last registered first), as DDP's buckets do."""
import pytest
import torch

from hvdtrain.backends.torch_groups import BUCKETS, BUCKET_BYTES, FIRST_BUCKET_BYTES, plan
from hvdtrain.config import GROUPS_BUCKETS


def tensors(*numels):
    return [torch.zeros(n) for n in numels]


def ids(groups):
    return [[id(p) for p in g] for g in groups]


def test_buckets_put_the_mnist_heads_fully_connected_layers_first_and_the_convolutions_after():
    # the MNIST recipe's CNN in registration order: conv1 w, b; conv2 w, b; fc1 w, b; fc2 w, b
    params = tensors(288, 32, 18432, 64, 1605632, 512, 5120, 10)
    groups = plan(params, BUCKETS)
    assert ids(groups) == ids([params[7:3:-1], params[3::-1]])  # fc2, fc1 (6.4 MB) first; the convolutions after


def test_buckets_close_at_ddps_sizes_and_hold_every_parameter_once_in_reverse_order():
    mib = 1 << 20
    numels = [mib // 4] * 60 + [mib // 8]  # 60 parameters of 1 MiB, then one of half a MiB (registered last)
    params = tensors(*numels)
    groups = plan(params, BUCKETS)
    flat = [p for g in groups for p in g]
    assert [id(p) for p in flat] == [id(p) for p in reversed(params)]
    sizes = [sum(p.numel() * 4 for p in g) for g in groups]
    assert sizes[0] == FIRST_BUCKET_BYTES + mib // 2  # the half MiB, then the first whole MiB reaches the cap
    assert all(s == BUCKET_BYTES for s in sizes[1:-1]) and 0 < sizes[-1] <= BUCKET_BYTES, sizes


@pytest.mark.parametrize("groups", [1, 2, 3, 8, 20])
def test_n_groups_are_runs_of_about_equal_bytes_in_reverse_order(groups):
    params = tensors(100, 100, 100, 100, 100, 100, 100, 100)
    planned = plan(params, groups)
    assert len(planned) == min(groups, len(params))
    assert [id(p) for g in planned for p in g] == [id(p) for p in reversed(params)]
    assert max(map(len, planned)) - min(map(len, planned)) <= 1, planned


def test_one_large_parameter_cannot_starve_the_groups_after_it():
    params = tensors(10, 10, 10, 10_000)  # the large one registered last: first in the backward pass
    planned = plan(params, 3)
    assert len(planned) == 3 and ids(planned)[0] == [id(params[3])]
    with pytest.raises(ValueError, match="groups must be at least 1"):
        plan(params, 0)


def test_auto_is_ddps_buckets_on_pytorchs_cpu_and_one_group_on_mxnets():
    from types import SimpleNamespace
    from hvdtrain.backends.mxnet import MXNetBackend
    from hvdtrain.backends.torch import TorchBackend
    cfg = SimpleNamespace(allreduce_groups=-1, elastic=False, adasum=False)
    assert TorchBackend().allreduce_groups(cfg) == BUCKETS and MXNetBackend().allreduce_groups(cfg) == 1
    assert TorchBackend().allreduce_groups(SimpleNamespace(allreduce_groups=2, elastic=False, adasum=False)) == 2
    assert TorchBackend().allreduce_groups(SimpleNamespace(allreduce_groups=-1, elastic=True, adasum=False)) == 0


def test_auto_is_one_group_after_the_backward_pass_when_any_rank_has_less_than_a_core(monkeypatch):
    """Under a CPU quota of less than a core per rank the first bucket, sent while the backward pass runs, slows both
    (8 shaped hosts of a quarter core: 295.5 img/s with DDP's buckets, 325.8 with one group). The ranks agree in one
    allgather (every rank must send the same groups); --overlap-forward asks for groups and keeps them."""
    from types import SimpleNamespace
    from hvdtrain.backends import base
    from hvdtrain.backends.mxnet import MXNetBackend
    from hvdtrain.backends.torch import TorchBackend
    cfg = SimpleNamespace(allreduce_groups=-1, elastic=False, adasum=False, overlap_forward=False)

    def backend(rows, cls=TorchBackend):
        b = cls()
        b.size, b.on_gpu, b.gathered = len(rows), False, []
        b.allgather_floats = lambda values: (b.gathered.append(values), rows)[1]
        return b

    monkeypatch.setattr(base, "below_a_core", lambda: False)
    b = backend([[0.0], [1.0]])  # rank 1's host is below a core
    assert b.allreduce_groups(cfg) == 1 and b.gathered == [[0.0]]
    assert "rank 1 has less than a core under a CPU quota" in b.allreduce_groups_reason
    b = backend([[0.0], [0.0]])
    assert b.allreduce_groups(cfg) == BUCKETS and b.allreduce_groups_reason == ""
    monkeypatch.setattr(base, "below_a_core", lambda: True)
    b = backend([[1.0], [1.0]])
    assert b.allreduce_groups(SimpleNamespace(**{**vars(cfg), "overlap_forward": True})) == BUCKETS
    assert b.gathered == []  # no collective where nothing is to be decided
    assert backend([[1.0], [1.0]]).allreduce_groups(SimpleNamespace(**{**vars(cfg), "allreduce_groups": 3})) == 3
    assert backend([[1.0], [1.0]], MXNetBackend).allreduce_groups(cfg) == 1
    # --allreduce-groups buckets: DDP's buckets under the quota too, with no collective to decide it, and on a GPU
    buckets = SimpleNamespace(**{**vars(cfg), "allreduce_groups": GROUPS_BUCKETS})
    b = backend([[1.0], [1.0]])
    assert b.allreduce_groups(buckets) == BUCKETS and b.gathered == [] and b.allreduce_groups_reason == ""
    b.on_gpu = True
    assert b.allreduce_groups(buckets) == BUCKETS and b.allreduce_groups(cfg) == 0


@pytest.mark.parametrize("other, named", [
    (dict(framework="mxnet"), "--framework mxnet"), (dict(elastic=True), "--elastic"), (dict(adasum=True), "--adasum"),
    (dict(shard_optimizer=True), "--shard-optimizer"), (dict(allreduce_groups=0), "--allreduce-groups 0"),
    (dict(compile=True), "--compile"), (dict(precision="fp16"), "--precision fp16"),
    (dict(loss_scale="dynamic"), "--loss-scale dynamic")])
def test_overlap_forward_is_refused_in_one_line_with_what_it_cannot_work_with(other, named):
    from hvdtrain.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError, match=f"--overlap-forward cannot be combined with {named}:") as e:
        TrainConfig(overlap_forward=True, **other).validate()
    assert "\n" not in str(e.value)
    TrainConfig(overlap_forward=True).validate()  # grouped allreduces on PyTorch: accepted


def test_overlap_forward_is_refused_where_a_gpu_would_run_it_by_default():
    """On a GPU the groups are off and auto precision picks fp16 with a dynamic loss scale; neither reaches the
    config's check (both are decided by the backend), so the backend refuses them in one line before training."""
    from hvdtrain.backends.torch import TorchBackend
    from hvdtrain.config import ConfigError
    backend = TorchBackend()
    with pytest.raises(ConfigError, match="--overlap-forward needs grouped allreduces") as e:
        backend._overlap_forward(0)
    backend.scaler, backend.precision = object(), "fp16"
    with pytest.raises(ConfigError, match=r"dynamic loss scale \(--precision fp16 chose one\)"):
        backend._overlap_forward(-1)
    assert "\n" not in str(e.value)
