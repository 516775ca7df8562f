"""Weights between frameworks and files (hvdtrain.weights): BatchNorm renaming, fitting to a model (the classifier of
another class count starts fresh, anything else that differs is named), and the files users hold."""
import os

import numpy as np
import pytest

from hvdtrain import checkpoint, weights

torch = pytest.importorskip("torch")


def torch_resnet(classes: int = 10, arch: str = "resnet18"):
    from recipes.resnet_torch import resnet
    torch.manual_seed(0)
    return resnet(arch, classes)


def arrays_of(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_torch_and_gluon_names_differ_only_in_batchnorm():
    sd = arrays_of(torch_resnet())
    gluon = weights.rename(sd, weights.GLUON)
    assert weights.naming(sd) == weights.TORCH and weights.naming(gluon) == weights.GLUON
    assert "bn1.gamma" in gluon and "bn1.beta" in gluon and "layer2.0.downsample.1.gamma" in gluon
    assert not any(k.endswith(weights.COUNTER) for k in gluon)
    assert "fc.weight" in gluon and "fc.bias" in gluon and "conv1.weight" in gluon  # not BatchNorm: unchanged
    assert len(sd) - len(gluon) == sum(k.endswith(weights.COUNTER) for k in sd) == 20
    back = weights.rename(gluon, weights.TORCH)
    assert set(back) == set(sd)
    for k, v in sd.items():  # bitwise, the counters (reset to 0) aside
        if not k.endswith(weights.COUNTER):
            assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k


def test_gluoncv_resnet_and_the_torch_twin_share_every_name_and_shape():
    mx = pytest.importorskip("mxnet")
    from hvdtrain.backends.gluoncv_compat import import_gluoncv
    for name, arch in (("resnet18_v1b", "resnet18"), ("resnet50_v1b", "resnet50")):
        net = import_gluoncv().model_zoo.get_model(name, classes=7)
        net.initialize()
        net(mx.nd.zeros((1, 3, 32, 32)))
        gluon = {k: p.shape for k, p in net._collect_params_with_prefix().items()}
        renamed = weights.rename(arrays_of(torch_resnet(7, arch)),
                                 weights.GLUON)
        assert list(gluon) == list(renamed), name  # the same names in the same order
        assert all(gluon[k] == renamed[k].shape for k in gluon), name


def test_fit_reinitialises_a_classifier_of_another_class_count_and_loads_the_rest():
    ten, five = arrays_of(torch_resnet(10)), arrays_of(torch_resnet(5))
    five = {k: v + 1 if v.dtype.kind == "f" else v for k, v in five.items()}  # tell the model's values apart
    out, kept = weights.fit(five, ten, "ten.pt")
    assert kept == ["fc.bias", "fc.weight"]
    assert np.array_equal(out["fc.weight"], five["fc.weight"]) and np.array_equal(out["fc.bias"], five["fc.bias"])
    for k in ten:
        if not k.startswith("fc."):
            assert np.array_equal(out[k], ten[k]), k


def test_fit_names_the_parameter_that_does_not_fit():
    r18 = arrays_of(torch_resnet(10))
    r50 = arrays_of(torch_resnet(10, "resnet50"))
    with pytest.raises(weights.WeightsError, match=r"layer1.0.conv3.weight.*is not in r18.pt.*same architecture"):
        weights.fit(r50, r18, "r18.pt")
    wrong = dict(r18)
    wrong["layer2.0.conv1.weight"] = np.zeros((128, 64, 5, 5), np.float32)
    with pytest.raises(weights.WeightsError, match=r"layer2.0.conv1.weight has shape \(128, 64, 5, 5\) in x.pt"):
        weights.fit(r18, wrong, "x.pt")


def test_fit_renames_gluon_weights_for_torch_and_fills_the_counters():
    sd = arrays_of(torch_resnet())
    out, kept = weights.fit(sd, weights.rename(sd, weights.GLUON), "gluon.params")
    assert kept == [] and set(out) == set(sd)
    assert out["bn1.num_batches_tracked"].dtype == np.int64


def test_read_refuses_what_it_cannot_read_with_the_file_named(tmp_path):
    bad = tmp_path / "weights.h5"
    bad.write_bytes(b"x")
    with pytest.raises(weights.WeightsError, match=r"weights.h5: unknown weights format \.h5"):
        weights.read(str(bad))
    with pytest.raises(weights.WeightsError, match="neither a run directory"):
        weights.read(str(tmp_path))
    pickle = tmp_path / "evil.pt"  # a pickle that would run code: torch's weights-only loader refuses it
    import pickle as pkl
    pickle.write_bytes(pkl.dumps(os.system))
    with pytest.raises(weights.WeightsError, match="not a PyTorch state dict"):
        weights.read(str(pickle))


def test_read_takes_a_state_dict_wrapped_or_saved_from_ddp(tmp_path):
    model = torch_resnet()
    path = tmp_path / "ddp.pth"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)
    arrays, info = weights.read(str(path))
    assert info["framework"] == "torch" and set(arrays) == set(model.state_dict())


def test_read_takes_a_run_directory_through_its_newest_valid_checkpoint(tmp_path):
    sd = arrays_of(torch_resnet())
    state = {"trainer": {"epoch": 2, "recipe": "imagenet", "framework": "torch", "config": {"model": "resnet18_v1b"}},
             "backend": {"model": sd}}
    checkpoint.save(str(tmp_path / "checkpoints"), 2, 20, state)
    arrays, info = weights.read(str(tmp_path))
    assert info["recipe"] == "imagenet" and info["epoch"] == 2 and info["config"]["model"] == "resnet18_v1b"
    assert all(np.array_equal(arrays[k], sd[k]) for k in sd)
