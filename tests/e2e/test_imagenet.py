"""The ImageNet recipe on real photographs (tiles of scikit-learn's two sample JPEGs, two classes), 2 ranks.

Small resolution (32 px) and ResNet-18 keep it CPU-sized; ResNet-50 itself runs in the synthetic test."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import PY, ROOT, describe, horovodrun, run

SMALL = ["--model", "resnet18_v1b", "--image-size", "32", "--val-resize", "36", "--batch-size", "8",
         "--warmup-epochs", "1", "--last-gamma", "--num-workers", "1", "--resume", "never"]
# GluonCV's ResNet-18 is less stable than torchvision's at this tiny scale (16 images a step, 8 steps an epoch).
LR = {"torch": "0.01", "mxnet": "0.003"}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    rec = tmp_path_factory.mktemp("photos_rec")
    for script, args in (("make_photo_folder.py", [str(folder), "--tile", "64", "--train-per-class", "64",
                                                   "--val-per-class", "32"]),
                         ("make_recordio.py", [str(folder), str(rec)])):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], check=True,
                       capture_output=True, timeout=120)
    return str(folder), str(rec)


def train(tmp_path, *args):
    out = str(tmp_path / "out")
    result = run(horovodrun(2, PY, "-m", "hvdtrain", "recipe", "imagenet", *args, "--output-dir", out), timeout=300)
    assert result.returncode == 0, describe(result)
    return read_metrics(out)


@pytest.mark.parametrize("framework, fmt, precision, extra, above_chance", [
    ("torch", "imagefolder", "fp32", [], True),
    ("torch", "imagefolder", "fp16", ["--no-wd", "--label-smoothing", "0.1"], False),
    ("mxnet", "imagefolder", "fp32", [], True),
    ("mxnet", "recordio", "bf16", ["--mixup", "0.2", "--mixup-off-epoch", "1"], False),
])
def test_photos_train_on_2_ranks(framework, fmt, precision, extra, above_chance, photos, tmp_path):
    folder, rec = photos
    data = ["--data-dir", folder] if fmt == "imagefolder" else ["--data-dir", rec, "--num-classes", "2"]
    epochs = "3" if precision == "fp16" else "6"  # PyTorch's fp16 on the CPU is slow
    records = train(tmp_path, "--framework", framework, "--precision", precision, "--epochs", epochs,
                    "--base-lr", LR[framework], *SMALL, *data, *extra)
    assert min(r["train_loss"] for r in records[1:]) < records[0]["train_loss"], records  # the loss falls
    assert records[-1]["val_top5"] == 1.0  # two classes: top-5 is trivially right, and reported
    if above_chance:
        assert max(r["val_accuracy"] for r in records[-3:]) >= 0.75, records


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_synthetic_resnet50_reports_throughput(framework, tmp_path):
    records = train(tmp_path, "--framework", framework, "--synthetic", "--model", "resnet50_v1b", "--image-size",
                    "64", "--batch-size", "4", "--epochs", "1", "--warmup-epochs", "0", "--max-steps", "3", "--num-classes", "10",
                    "--resume", "never")
    (record,) = records
    assert record["global_step"] == 3 and record["images_per_sec"] > 0 and record["val_loss"] is None


def test_a_corrupt_image_fails_the_job_and_names_the_file(photos, tmp_path):
    folder, _ = photos
    broken = tmp_path / "data"
    shutil.copytree(folder, broken)
    victim = sorted((broken / "train" / "china").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:200])  # truncated JPEG
    result = run(horovodrun(2, PY, "-m", "hvdtrain", "recipe", "imagenet", "--framework", "torch", "--data-dir",
                            str(broken), "--epochs", "1", *SMALL, "--num-workers", "0", "--output-dir",
                            str(tmp_path / "out")), timeout=300)
    assert result.returncode != 0
    assert victim.name in result.output, describe(result)


def test_missing_imagenet_layout_is_a_one_line_error(tmp_path):
    result = run([PY, "-m", "hvdtrain", "recipe", "imagenet", "--data-dir", str(tmp_path)], timeout=120)
    assert result.returncode == 2
    assert "lacks train.rec, train.idx, val.rec, val.idx" in result.stderr and "make_recordio.py" in result.stderr
