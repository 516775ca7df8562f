"""--compile under horovodrun at np=2 (issue 46): block by block, the gradients still reach Horovod as the backward
pass makes them (the whole model as one region loses that); the compiled model trains as the eager one does; a
checkpoint crosses the switch both ways; what cannot work is refused in one line before anything is written.

torch.compile's aot_eager backend (dynamo and AOTAutograd, no generated code) keeps these runs short; the regions
and their backward nodes, which decide when the hooks fire, are the same with inductor."""
import json
import math
import os
import statistics

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, horovodrun, run

pytest.importorskip("torch")
RECIPE = [PY, "-m", "hvdtrain", "recipe", "tests.compile_recipe:BlocksTrainer"]
AOT = ["--compile-backend", "aot_eager"]
CLOSE = 1e-4  # relative: the same operations, traced; a wrong gradient or a lost step is off by far more


def train(out, *extra, expect=0):
    result = run(horovodrun(2, *RECIPE, "--output-dir", str(out), *extra), timeout=300)
    assert result.returncode == expect, describe(result)
    return result


def first_hook(out) -> float:
    """The median over steps and ranks of the fraction of the backward pass elapsed at the first gradient."""
    fractions = []
    for rank in (0, 1):
        with open(os.path.join(out, f"hooks-rank{rank}.json")) as f:
            fractions += json.load(f)[2:]  # after the first steps (compilation)
    return statistics.median(fractions)


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "eager"
    train(out)
    return out


def test_blocks_compiled_one_by_one_keep_the_overlap_and_the_whole_model_loses_it(eager, tmp_path):
    blocks, whole = tmp_path / "blocks", tmp_path / "whole"
    result = train(blocks, "--compile", *AOT)
    assert "--compile: 12 region(s) (blocks.0, blocks.1" in result.output, describe(result)
    assert "took the first step" in result.output
    train(whole, "--compile", "--compile-blocks", "model", *AOT)
    e, b, w = first_hook(eager), first_hook(blocks), first_hook(whole)
    assert abs(b - e) <= 0.15, (e, b, w)
    assert w > e + 0.3 and w > 0.6, (e, b, w)  # every gradient after the whole backward pass (then the hooks run)
    # the compiled model trains as the eager one, step for step (every record)
    for got in (read_metrics(str(blocks)), read_metrics(str(whole))):
        want = read_metrics(str(eager))
        assert [r["global_step"] for r in got] == [r["global_step"] for r in want]
        for g, w_ in zip(got, want):
            assert g["train_loss"] == pytest.approx(w_["train_loss"], rel=CLOSE), (g, w_)
            assert g["val_loss"] == pytest.approx(w_["val_loss"], rel=CLOSE), (g, w_)


def test_a_checkpoint_crosses_the_switch_both_ways(eager, tmp_path):
    """Compiled for epoch 1, eager for epoch 2, compiled again for epoch 3, each resuming the last one's checkpoint:
    every record is the uninterrupted eager run's (the checkpoints hold the model's own names, never _orig_mod.)."""
    from hvdtrain import checkpoint
    out = tmp_path / "switching"
    for steps, extra in (("8", ["--compile", *AOT]), ("16", []), ("24", ["--compile", *AOT])):
        result = train(out, "--max-steps", steps, *extra)  # 8 steps of 2 ranks x 64: an epoch of 1,024 samples
        state = checkpoint.load(checkpoint.latest_valid(str(out / "checkpoints")))
        assert all("_orig_mod" not in k for k in state["backend"]["model"]), list(state["backend"]["model"])[:3]
        assert steps == "8" or "resuming from" in result.output, describe(result)
    got, want = read_metrics(str(out)), read_metrics(str(eager))
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["train_loss"] == pytest.approx(w["train_loss"], rel=CLOSE), (g, w)
        assert g["val_loss"] == pytest.approx(w["val_loss"], rel=CLOSE), (g, w)


def test_what_cannot_compile_is_refused_in_one_line_before_anything_is_written(tmp_path):
    out = tmp_path / "never"
    for extra, message in ((["--framework", "mxnet", "--compile"], "--compile is for --framework torch: MXNet's "
                                                                    "models are hybridized already"),
                           (["--compile", "--compile-blocks", "blocks.0,nosuch"],
                            "--compile-blocks 'nosuch': the model has no such submodule"),
                           (["--compile-mode", "fast"], "--compile-mode 'fast': choose default")):
        result = run([*RECIPE, "--output-dir", str(out), *extra], timeout=120)
        assert result.returncode == 2, describe(result)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, describe(result)
        assert not out.exists(), "nothing is written"


def test_a_small_resnet_compiled_trains_as_eager_with_accumulation_and_a_sharded_optimizer(tmp_path):
    """The ImageNet recipe's ResNet-18 (8 residual blocks, BatchNorm) at 32 px on synthetic data, 20 steps at np=2,
    with --accumulate 2 and --shard-optimizer, eager and compiled block by block: the same losses."""
    flags = ["-m", "hvdtrain", "recipe", "imagenet", "--synthetic", "--model", "resnet18_v1b", "--image-size", "32",
             "--num-classes", "10", "--batch-size", "4", "--accumulate", "2", "--shard-optimizer", "--epochs", "1",
             "--warmup-epochs", "0", "--max-steps", "20", "--log-every", "5", "--precision", "fp32", "--resume",
             "never"]
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", *AOT])):
        out = tmp_path / name
        result = run(horovodrun(2, PY, *flags, "--output-dir", str(out), *extra), timeout=400)
        assert result.returncode == 0, describe(result)
        losses[name] = [r["train_loss"] for r in read_metrics(str(out))]
        if extra:
            assert "--compile: 8 region(s) (layer1.0, layer1.1" in result.output, describe(result)
    assert len(losses["eager"]) == 1
    # 20 steps of a BatchNorm network: the compiled kernels add in another order and the differences grow (0.05%
    # seen); a lost allreduce or a wrong gradient moves it by far more. (A CI run once saw 6.7%: Gloo's reduce-scatter
    # had returned a corrupted shard, scripts/patch_horovod.py fix 8; eager runs differed from each other as much.)
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=0.01)


def test_compiled_regions_train_under_autocast_with_loss_scaling(tmp_path):
    """bf16 autocast and fp16 autocast with dynamic loss scaling (a GradScaler) around the compiled regions: they
    train to finite losses (on this CPU bf16 may be emulated and fp16 is slow: 4 steps, one rank)."""
    for precision in ("bf16", "fp16"):
        out = tmp_path / precision
        result = run([*RECIPE, "--output-dir", str(out), "--compile", *AOT, "--precision", precision, "--epochs", "1",
                      "--max-steps", "4"], timeout=300)
        assert result.returncode == 0, describe(result)
        record = read_metrics(str(out))[-1]
        assert math.isfinite(record["train_loss"]) and record["global_step"] == 4, record
