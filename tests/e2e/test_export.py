"""The trained model leaves hvdtrain: `eval` reproduces a run's figures, `export` writes files that plain PyTorch, plain
MXNet/GluonCV and onnxruntime load without hvdtrain, a ResNet moves between the frameworks exactly, and `--init-from`
starts a run from another's weights.

The ImageNet recipe's ResNet-18 trains one epoch on 2 ranks on the embedded digits written as 32 px photos; one
validation image is removed, so that 49 images split unevenly over the 2 ranks.

Bounds: the same weights in the other framework (or onnxruntime) compute the same logits up to float32 rounding of
different convolution kernels, measured here at about 1e-5 on logits of magnitude 15 (7e-7 of their scale); the bound
is 1e-4 of the scale. An export that lost a BatchNorm statistic, swapped gamma and beta or mis-shaped the classifier
moves logits by their own order of magnitude.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import PY, ROOT, describe, horovodrun, run

pytest.importorskip("torch")
pytest.importorskip("mxnet")

SMALL = ["--model", "resnet18_v1b", "--image-size", "32", "--val-resize", "32", "--min-crop-area", "0.6",
         "--batch-size", "8", "--epochs", "1", "--warmup-epochs", "0", "--base-lr", "0.02", "--num-workers", "0",
         "--precision", "fp32", "--resume", "never"]
CLOSE = 1e-4
"""Largest logit difference across frameworks or runtimes, relative to the logits' magnitude (module docstring)."""


@pytest.fixture(scope="module")
def photos(digits, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export_photos")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "idx_to_imagefolder.py"), digits, str(folder),
                    "--size", "32", "--train-per-class", "12", "--val-per-class", "5"], check=True,
                   capture_output=True, timeout=120)
    val0 = folder / "val" / sorted(os.listdir(folder / "val"))[0]
    os.unlink(val0 / sorted(os.listdir(val0))[0])  # 49 validation images: uneven over 2 ranks
    return str(folder)


@pytest.fixture(scope="module", params=["torch", "mxnet"])
def trained(request, photos, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(f"trained_{request.param}") / "run")
    result = run(horovodrun(2, PY, "-m", "hvdtrain", "recipe", "imagenet", "--framework", request.param,
                            "--data-dir", photos, *SMALL, "--output-dir", out), timeout=300)
    assert result.returncode == 0, describe(result)
    return request.param, out


def hvdtrain(*args, np_=1, timeout=300):
    cmd = [PY, "-m", "hvdtrain", *args]
    result = run(horovodrun(np_, *cmd) if np_ > 1 else cmd, timeout=timeout)
    assert result.returncode == 0, describe(result)
    return result


def test_eval_on_2_ranks_reproduces_the_last_epoch_and_counts_every_image_once(trained, tmp_path):
    framework, out = trained
    (last,) = read_metrics(out)
    result = hvdtrain("eval", out, "--output-dir", str(tmp_path / "eval"), np_=2)
    assert "over 49 samples on 2 worker(s)" in result.output, result.output
    with open(tmp_path / "eval" / "eval.json") as f:
        got = json.load(f)
    assert got["count"] == 49 and got["framework"] == framework
    assert got["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6), (got, last)
    assert got["val_accuracy"] == last["val_accuracy"] and got["val_top5"] == last["val_top5"]


FRESH = {
    # Each runs in a fresh interpreter, outside the repository, and must not import hvdtrain.
    "torch": """
import sys, numpy as np, torch
sys.path.insert(0, ROOT)                      # recipes/ ships beside hvdtrain: its ResNet has torchvision's names
from recipes.resnet_torch import resnet
model = resnet("resnet18", meta["num_classes"])
model.load_state_dict(torch.load(os.path.join(d, meta["weights"]), weights_only=True), strict=True)
with torch.no_grad():
    outs = [model.eval()(torch.from_numpy(x)).numpy()]
""",
    "mxnet": """
import sys, numpy as np, mxnet as mx
sys.modules["torch"] = None                   # gluoncv 0.10 refuses to import beside torch >= 2
from gluoncv import model_zoo
net = model_zoo.get_model(meta["model"], classes=meta["num_classes"])
net.load_parameters(os.path.join(d, meta["weights"]))
sym = mx.gluon.SymbolBlock.imports(os.path.join(d, meta["symbol"]), ["data"], os.path.join(d, meta["symbol_params"]))
outs = [net(mx.nd.array(x)).asnumpy(), sym(mx.nd.array(x)).asnumpy()]
""",
    "onnx": """
import onnxruntime
s = onnxruntime.InferenceSession(os.path.join(d, meta["onnx"]), providers=["CPUExecutionProvider"])
outs = [s.run(None, {"images": x})[0]]
""",
}


def load_fresh(directory: str, kind: str) -> float:
    """Load an export in a fresh process without hvdtrain; the largest difference of its logits on sample.npz's
    inputs from the logits stored there, relative to their magnitude."""
    code = ("import json, os, sys, numpy as np\n"
            f"ROOT, d = {ROOT!r}, {directory!r}\n"
            "meta = json.load(open(os.path.join(d, 'model.json')))\n"
            "sample = np.load(os.path.join(d, 'sample.npz')); x, ref = sample['inputs'], sample['logits']\n"
            + FRESH[kind] +
            "assert 'hvdtrain' not in sys.modules\n"
            "print('DIFF', max(float(np.abs(o - ref).max()) for o in outs) / max(1.0, float(np.abs(ref).max())))\n")
    result = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=180, cwd=directory)
    assert result.returncode == 0, result.stdout + result.stderr
    return float(result.stdout.split("DIFF")[-1])


@pytest.mark.parametrize("target", ["torch", "mxnet", "onnx"])
def test_an_export_loads_without_hvdtrain_and_computes_the_trained_logits(trained, target, tmp_path):
    framework, out = trained
    args = ["--format", "onnx"] if target == "onnx" else ["--framework", target]
    hvdtrain("export", out, *args, "--output", str(tmp_path / "x"))
    with open(tmp_path / "x" / "model.json") as f:
        meta = json.load(f)
    assert meta["num_classes"] == 10 and meta["input_shape"] == [3, 32, 32]
    assert meta["preprocessing"]["mean"] == [0.485, 0.456, 0.406] and meta["preprocessing"]["center_crop"] == 32
    assert meta["sample"]["logits_from"] == framework  # the reference is the framework that trained it
    assert meta["max_abs_diff"] <= CLOSE * max(1.0, meta["logit_scale"]), meta
    assert load_fresh(str(tmp_path / "x"), target) <= CLOSE


def test_eval_on_the_other_framework_gives_the_same_figures(trained, tmp_path):
    framework, out = trained
    other = {"torch": "mxnet", "mxnet": "torch"}[framework]
    (last,) = read_metrics(out)
    hvdtrain("eval", out, "--framework", other, "--output-dir", str(tmp_path / "eval"))
    with open(tmp_path / "eval" / "eval.json") as f:
        got = json.load(f)
    assert got["framework"] == other and got["count"] == 49
    assert got["val_accuracy"] == last["val_accuracy"] and got["val_top5"] == last["val_top5"]
    assert got["val_loss"] == pytest.approx(last["val_loss"], rel=CLOSE)


@pytest.mark.parametrize("trained", ["mxnet"], indirect=True)
def test_mxnet_to_torch_and_back_is_bitwise(trained, tmp_path):
    framework, out = trained
    hvdtrain("export", out, "--framework", "torch", "--output", str(tmp_path / "pt"))
    hvdtrain("export", str(tmp_path / "pt" / "model.pt"), "--recipe", "imagenet", "--model", "resnet18_v1b",
             "--framework", "mxnet", "--output", str(tmp_path / "back"))
    import mxnet as mx
    from hvdtrain import checkpoint
    (path,) = [p for p in checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))]
    original = checkpoint.load(path)["backend"]["model"]
    back = {k: v.asnumpy() for k, v in mx.nd.load(str(tmp_path / "back" / "model.params")).items()}
    assert set(back) == set(original)
    for name, value in original.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name


def test_init_from_another_class_count_loads_all_but_the_classifier(trained, photos, tmp_path):
    framework, out = trained
    five = tmp_path / "five"
    for split in ("train", "val"):
        for cls in sorted(os.listdir(os.path.join(photos, split)))[:5]:
            shutil.copytree(os.path.join(photos, split, cls), five / split / cls)
    run_dir = str(tmp_path / "run")
    # A learning rate of 1e-30 (below float32's resolution of these weights): one step changes no weight, so the
    # run's checkpoint shows what --init-from loaded.
    result = hvdtrain("recipe", "imagenet", "--framework", framework, "--data-dir", str(five), *SMALL,
                      "--base-lr", "1e-30", "--max-steps", "1", "--init-from", out,
                      "--output-dir", run_dir, np_=2)
    assert "the classifier (fc.bias, fc.weight) has another class count there and starts fresh" in result.output
    from hvdtrain import weights
    source, _ = weights.read(out)
    loaded, _ = weights.read(run_dir)
    assert loaded["fc.weight"].shape == (5, 512) and source["fc.weight"].shape == (10, 512)
    for name, value in source.items():
        if not name.startswith("fc.") and "running" not in name and "num_batches" not in name:
            assert np.array_equal(loaded[name], value), name  # trained weights, not a fresh draw


def test_init_from_another_architecture_is_refused_naming_the_parameter(trained, photos, tmp_path):
    framework, out = trained
    cmd = [PY, "-m", "hvdtrain", "recipe", "imagenet", "--framework", framework, "--data-dir", photos, *SMALL,
           "--model", "resnet50_v1b", "--init-from", out, "--output-dir", str(tmp_path / "run")]
    result = run(horovodrun(2, *cmd), timeout=300)
    assert result.returncode != 0, describe(result)
    # Every rank raises the same one-line error; the launcher kills the rest as soon as the first one exits, so the
    # job guarantees the line from at least one rank, and no traceback from any.
    errors = [line for line in result.output.splitlines() if "hvdtrain: error:" in line]
    assert errors, result.output
    for line in errors:
        assert re.search(r"\[rank [01]\] hvdtrain: error: --init-from: the model's parameter "
                         r"layer1\.0\.conv3\.weight is not in", line), result.output
    assert "] Traceback" not in result.output
