"""MXNet placement without a GPU: a context other than cpu(0) stands in for the rank's GPU (``mx.cpu(1)`` for
``mx.gpu(0)``), so anything left on MXNet's default context fails here as it would on a GPU. In process, no Horovod."""
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from hvdtrain.backends.mxnet import MXNetBackend, place_parameters, resolve_shapes  # noqa: E402
from hvdtrain.data import ArrayDataset, Synthetic  # noqa: E402
from recipes.imagenet import ImageNetConfig, ImageNetTrainer  # noqa: E402

STAND_IN = mx.cpu(1)


def imagenet_net():
    trainer = ImageNetTrainer(ImageNetConfig(framework="mxnet", model="resnet18_v1b", image_size=32, num_classes=10,
                                             synthetic=True, output_dir="unused"))
    return trainer.build_mxnet()


def test_recipe_network_lands_on_the_rank_context_with_the_recipes_initialiser():
    net = imagenet_net()
    params = net.collect_params()
    place_parameters(mx, params, STAND_IN)
    resolve_shapes(mx, net, (3, 32, 32), STAND_IN)
    assert {str(c) for p in params.values() for c in p.list_ctx()} == {"cpu(1)"}, "a parameter stayed elsewhere"
    # The recipe's initialiser (He: gaussian over fan-out, magnitude 2, as the PyTorch model) kept for the deferred
    # convolutions, not replaced by the backend's default (uniform, magnitude 1: a much smaller spread)
    for name, p in params.items():
        if name.endswith("weight") and len(p.shape) == 4 and np.prod(p.shape) > 10000:
            w = p.data(STAND_IN).asnumpy()
            fan_out = w.shape[0] * np.prod(w.shape[2:])
            assert w.std() == pytest.approx(np.sqrt(2 / fan_out), rel=0.1), name
    # resolving shapes ran nothing: BatchNorm's running variance is still its initial 1
    running = [p for n, p in params.items() if n.endswith("running_var")]
    assert running and all((p.data(STAND_IN).asnumpy() == 1).all() for p in running)
    net.hybridize(static_alloc=True)
    with mx.autograd.record():
        out = net(mx.nd.ones((2, 3, 32, 32), ctx=STAND_IN))
    out.backward()
    assert out.context == STAND_IN and out.shape == (2, 10)


def test_layers_the_recipe_left_uninitialised_get_the_default_on_the_rank_context():
    net = mx.gluon.nn.Dense(4, in_units=3)
    place_parameters(mx, net.collect_params(), STAND_IN)
    assert net.weight.list_ctx() == [STAND_IN] and np.abs(net.weight.data(STAND_IN).asnumpy()).max() > 0


@pytest.mark.parametrize("precision, dtype", [("fp32", np.float32), ("fp16", np.float16)])
def test_every_batch_has_the_networks_dtype(precision, dtype):
    backend = MXNetBackend()
    backend.mx, backend.ctx, backend.precision = mx, STAND_IN, precision
    backend.dtype = "float16" if precision == "fp16" else "float32"
    synthetic = next(backend.loader(Synthetic(8, (3, 4, 4), 10), range(8), 4, drop_last=True))
    arrays = ArrayDataset(np.zeros((8, 3, 4, 4), np.float32), np.zeros(8, np.int64))
    real = next(backend.loader(arrays, range(8), 4, drop_last=True))
    for x, y in (synthetic, real):  # what the network is called with: its own dtype for floating-point inputs
        (x,) = backend._compute_dtype((x,))
        assert x.dtype == dtype and x.context == STAND_IN and y.context == STAND_IN


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_token_ids_and_float_targets_keep_their_values(precision):
    # Token ids above 2048 are not exact in float16 (and above 2**24 not in float32): integers stay integers, and a
    # regression's float targets stay float32 whatever the network computes in.
    backend = MXNetBackend()
    backend.mx, backend.ctx, backend.precision = mx, STAND_IN, precision
    backend.dtype = "float16" if precision == "fp16" else "float32"
    ids = np.array([[2049, 70001], [16777217, 3]], np.int64)
    target = np.array([0.1, 1e-4], np.float64)
    batch = next(backend.loader(ArrayDataset(ids, ids + 1, target), range(2), 2, drop_last=True))
    inputs = backend._compute_dtype(batch[:2])
    assert [a.dtype for a in inputs] == [np.int32, np.int32] and batch[2].dtype == np.float32
    assert (inputs[0].asnumpy() == ids).all() and (inputs[1].asnumpy() == ids + 1).all()


@pytest.mark.parametrize("model, blocks", [("resnet18_v1b", 8), ("resnet50_v1b", 16)])
def test_last_gamma_zeroes_every_residual_branch_on_mxnet_as_on_pytorch(model, blocks):
    # GluonCV's BasicBlockV1b (ResNet-18/34) ignores last_gamma; the recipe zeroes its last BatchNorm itself.
    from recipes.imagenet import ImageNetConfig, ImageNetTrainer
    for last_gamma in (True, False):
        net = ImageNetTrainer(ImageNetConfig(framework="mxnet", model=model, image_size=32, num_classes=10,
                                             synthetic=True, last_gamma=last_gamma)).build_mxnet()
        net(mx.nd.zeros((1, 3, 32, 32)))
        last = [p for name, p in net._collect_params_with_prefix().items()
                if name.endswith(("bn2.gamma" if blocks == 8 else "bn3.gamma"))]
        assert len(last) == blocks
        assert all((float(p.data().abs().sum().asscalar()) == 0) == last_gamma for p in last), model


def test_resnet_starts_with_pytorchs_initialisation_on_mxnet():
    # Standard deviations per layer kind, MXNet over PyTorch: equal within sampling noise (they were 4.6x for the
    # first convolution, 1.41x for the stage downsamples and 2.46x for the classifier with GluonCV's Xavier).
    import torch
    from recipes.imagenet import ImageNetConfig, ImageNetTrainer
    cfg = ImageNetConfig(model="resnet18_v1b", image_size=32, num_classes=10, synthetic=True)
    net = ImageNetTrainer(cfg).build_mxnet()
    net(mx.nd.zeros((1, 3, 32, 32)))
    mine = {k: p.data().asnumpy() for k, p in net._collect_params_with_prefix().items()}
    torch.manual_seed(0)
    theirs = {k: v.numpy() for k, v in ImageNetTrainer(cfg).build_torch().state_dict().items()}
    pairs = [("conv1.weight", "conv1.weight"), ("layer2.0.downsample.0.weight", "layer2.0.downsample.0.weight"),
             ("layer4.1.conv2.weight", "layer4.1.conv2.weight"), ("fc.weight", "fc.weight")]
    for ours, torchs in pairs:
        assert mine[ours].shape == theirs[torchs].shape, ours
        ratio = mine[ours].std() / theirs[torchs].std()
        assert 0.8 < ratio < 1.25, (ours, ratio)
    bound = 1 / np.sqrt(512)  # the classifier's bias: uniform(+-1/sqrt(fan_in)) on both (10 values: no std to compare)
    for bias in (mine["fc.bias"], theirs["fc.bias"]):
        assert np.abs(bias).max() <= bound and np.abs(bias).max() > bound / 10


def test_the_record_readers_augmentation_differs_per_epoch_and_rank(monkeypatch):
    # MXNet's C++ ImageRecordIter draws its crops, flips and colours from seed_aug: the backend derives it from
    # (--seed, epoch, rank), so no two epochs and no two ranks see the same augmentation stream.
    from types import SimpleNamespace
    seen = []

    class Reader:
        def __init__(self, **kw):
            seen.append(kw)

        def __iter__(self):
            return iter([SimpleNamespace(data=[mx.nd.zeros((2, 3, 8, 8))], label=[mx.nd.zeros((2,))])])

        def reset(self):
            pass
    monkeypatch.setattr(mx.io, "ImageRecordIter", Reader)
    from hvdtrain.backends.mxnet_records import MXNetRecords
    transform = SimpleNamespace(size=8, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2), min_area=0.5, flip=True,
                                jitter=0.4, lighting=0.1)
    seeds = {}
    for rank in (0, 1):
        for epoch in (0, 1):
            records = MXNetRecords(mx, rank, 2, lambda batch: batch)
            data = SimpleNamespace(rec_path="x.rec", idx_path="x.idx", transform=transform, seed=42, epoch=epoch)
            next(records.iterate(data, 1, 2, 1))
            seeds[(rank, epoch)] = seen[-1]["seed_aug"]
            assert seen[-1]["part_index"] == rank and seen[-1]["num_parts"] == 2
    assert len(set(seeds.values())) == 4, seeds
    next(records.iterate(SimpleNamespace(rec_path="x.rec", idx_path="x.idx", transform=transform, seed=42,
                                              epoch=1), 1, 2, 1))
    assert seen[-1]["seed_aug"] == seeds[(1, 1)], "the same (seed, epoch, rank): the same stream, for a resume"
