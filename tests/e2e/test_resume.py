"""Resume: a run stopped after any step and resumed ends bitwise equal to an uninterrupted run (CPU).

Bitwise is achievable because everything a step depends on is restored or replayed: weights and optimizer state come
from the checkpoint (broadcast from rank 0), the sampler's order depends only on (seed, epoch) and the position in it
is stored as samples consumed, and every rank reseeds its random generators (the framework's too: dropout) from
(seed, epoch, position, rank) before each step, so dropout and augmentation draw the same numbers after a resume as
without one, wherever the run stopped.

The MXNet case runs with HVDTRAIN_GPU_STAND_IN=1: each rank on mx.cpu(local_rank + 1), a context other than MXNet's
default standing in for mx.gpu(local_rank), through setup, training, evaluation, checkpoint and resume.
"""
import os
import shutil

import numpy as np
import pytest

from hvdtrain import checkpoint
from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, horovodrun, run


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flat(v, f"{prefix}/{i}")
    else:
        yield prefix, tree


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_stopped_at_any_step_and_resumed_equals_uninterrupted(framework, auto_precision, digits, tmp_path):
    """Under --precision auto as a processor with native bf16 and one without would decide (auto_precision)."""
    if framework == "mxnet" and auto_precision == "bf16":
        pytest.skip("MXNet's auto computes in fp32 on a CPU under either outcome (its bf16 is slower): the fp32 "
                    "variant runs it")
    stand_in = {"HVDTRAIN_GPU_STAND_IN": "1"} if framework == "mxnet" else {}

    def train(out, *extra):
        cmd = [PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", framework, "--data-dir", digits,
               "--epochs", "3", "--checkpoint-every-steps", "5", "--output-dir", out, *extra]
        result = run(horovodrun(2, *cmd), timeout=240, **stand_in)
        assert result.returncode == 0, describe(result)
        if stand_in:
            assert " on cpu(1);" in result.output, "rank 0 runs on the stand-in context"
        return result

    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train(full, "--resume", "never")
    # 22 steps per epoch at np=2: step 37 is inside epoch 2, between two of the checkpoints every 5 steps (35, 40):
    # the stop writes one of its own, and the resume starts from it, mid-epoch
    train(split, "--resume", "never", "--max-steps", "37")
    assert [r["epoch"] for r in read_metrics(split)] == [1, 2]
    resumed = train(split)  # --resume auto is the default
    assert "resuming from" in resumed.output and "(epoch 1, step 37)" in resumed.output, describe(resumed)
    assert [r["epoch"] for r in read_metrics(split)] == [1, 2, 3]

    assert_same_end(full, split, epochs=3, steps=66)


def _final(out: str, epochs: int, steps: int) -> dict:
    state = checkpoint.load(checkpoint.latest_valid(os.path.join(out, "checkpoints")))
    assert state["trainer"]["epoch"] == epochs and state["trainer"]["global_step"] == steps
    return dict(flat(state["backend"]))


def assert_same_end(full: str, split: str, epochs: int, steps: int) -> None:
    """The last checkpoints of both runs hold the same bits, and every epoch's record has the same figures: the
    validation metrics exactly, train_loss to float32 rounding (a resumed epoch adds the sums of its steps before the
    checkpoint, which the checkpoint keeps in float64, to those after it)."""
    fa, fb = _final(full, epochs, steps), _final(split, epochs, steps)
    assert fa.keys() == fb.keys()
    for key in fa:
        if isinstance(fa[key], np.ndarray):
            np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)
        else:
            assert fa[key] == fb[key], key
    ra, rb = read_metrics(full), read_metrics(split)
    assert [r["global_step"] for r in ra] == [r["global_step"] for r in rb]
    for la, lb in zip(ra, rb):
        assert la["val_accuracy"] == lb["val_accuracy"] and la["val_loss"] == lb["val_loss"], (la, lb)
        assert la["train_loss"] == pytest.approx(lb["train_loss"], rel=1e-6), (la, lb)


def test_reseed_at_checkpoints_resumes_exactly_from_a_checkpoint_boundary_only(digits, tmp_path):
    """--reseed checkpoint (MXNet, where the per-step reseed costs about 1 ms): a run stopped at a
    --checkpoint-every-steps boundary resumes bitwise equal to the uninterrupted run; one stopped between
    boundaries does not (dropout draws other masks): the framework's generator really is left alone there."""
    def train(out, *extra):
        cmd = [PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", "mxnet", "--data-dir", digits, "--epochs",
               "2", "--reseed", "checkpoint", "--checkpoint-every-steps", "5", "--output-dir", out, *extra]
        result = run(horovodrun(2, *cmd), timeout=240)
        assert result.returncode == 0, describe(result)

    # 22 steps per epoch: both stops are inside epoch 1, and epoch 2, which neither resumes into, is compared
    full, at_boundary, between = (str(tmp_path / name) for name in ("full", "at-15", "at-17"))
    train(full, "--resume", "never")
    for out, stop in ((at_boundary, "15"), (between, "17")):
        train(out, "--resume", "never", "--max-steps", stop)
        train(out)
    assert_same_end(full, at_boundary, epochs=2, steps=44)
    with pytest.raises(AssertionError):
        assert_same_end(full, between, epochs=2, steps=44)


FINISHED = [PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", "torch", "--epochs", "3", "--keep-checkpoints", "2"]


@pytest.fixture(scope="module")
def finished_run(digits, tmp_path_factory):
    """A finished 3-epoch run of the MNIST recipe on PyTorch (its last 2 checkpoints kept), trained once for the tests
    below; each works on a copy of it."""
    out = str(tmp_path_factory.mktemp("finished") / "run")
    result = run(horovodrun(2, *FINISHED, "--data-dir", digits, "--output-dir", out), timeout=240)
    assert result.returncode == 0, describe(result)
    return out


def copy_of(finished_run: str, tmp_path) -> str:
    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    return out


def test_resume_of_a_finished_run_trains_nothing(digits, finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    again = run(horovodrun(2, *FINISHED, "--data-dir", digits, "--output-dir", out), timeout=240)
    assert again.returncode == 0, describe(again)
    assert "nothing to train" in again.output
    assert len(read_metrics(out)) == 3


def test_checkpoint_of_another_framework_is_refused_on_every_rank(digits, finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    other = run(horovodrun(2, PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", "mxnet", "--epochs", "4",
                           "--data-dir", digits, "--output-dir", out), timeout=240)
    assert other.returncode != 0
    assert "written by recipe mnist on torch, not mnist on mxnet" in other.output


def test_resume_never_sets_the_earlier_run_aside(digits, finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    again = run(horovodrun(2, PY, "-m", "hvdtrain", "recipe", "mnist", "--data-dir", digits, "--output-dir", out,
                           "--epochs", "1", "--resume", "never"), timeout=240)
    assert again.returncode == 0, describe(again)
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))]
    assert names == [checkpoint.checkpoint_name(1, 22)], "the new run's checkpoint is kept, not pruned"
    (previous,) = [d for d in os.listdir(out) if d.startswith("previous-")]
    kept = checkpoint.list_checkpoints(os.path.join(out, previous, "checkpoints"))
    assert [os.path.basename(p) for p in kept] == [checkpoint.checkpoint_name(2, 44), checkpoint.checkpoint_name(3, 66)]
    assert len(read_metrics(os.path.join(out, previous))) == 3 and len(read_metrics(out)) == 1


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_checkpoint_of_the_previous_version_resumes(framework, tmp_path):
    # tests/data/checkpoints-v0.1: epoch 1 of the tiny recipe written by hvdtrain before its Trainer was split into
    # collaborators (checkpointer, health, model_io). It resumes, and ends where an uninterrupted run of today's
    # code ends: the format is read as before, and training after it is the same.
    from tests.helpers import ROOT
    flags = ["-m", "hvdtrain", "recipe", "tests.tiny_recipe:TinyTrainer", "--framework", framework, "--epochs", "2",
             "--precision", "fp32", "--momentum", "0.9"]
    out = tmp_path / "resumed"
    shutil.copytree(os.path.join(ROOT, "tests", "data", "checkpoints-v0.1", framework), out / "checkpoints")
    result = run([PY, *flags, "--output-dir", str(out)], timeout=180)
    assert result.returncode == 0, describe(result)
    assert "(epoch 1, step 8)" in result.stderr and "resuming from" in result.stderr, describe(result)
    assert [r["epoch"] for r in read_metrics(str(out))] == [2]
    whole = tmp_path / "whole"
    assert run([PY, *flags, "--output-dir", str(whole)], timeout=180).returncode == 0
    got = checkpoint.load(checkpoint.latest_valid(str(out / "checkpoints")))
    want = checkpoint.load(checkpoint.latest_valid(str(whole / "checkpoints")))
    assert got["trainer"]["global_step"] == want["trainer"]["global_step"] == 16
    for (name, a), (_, b) in zip(flat(got["backend"]), flat(want["backend"])):
        if isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
