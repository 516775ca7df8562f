"""Tasks other than image classes, through the Trainer's task contract on both frameworks under horovodrun: a
regression, a language model, and a user's own task with two inputs, its own step and its own metric.

Figures are checked against an independent computation: the run's checkpoint evaluated by numpy in float64. The
model computes in float32 (about 1e-7 relative per operation, a few hundred operations deep), so the bound is 1e-4
relative (the runs are pinned to fp32: --precision auto picks bf16 on a CPU with native bf16, about 1e-3 per
operation); a metric computed on the wrong quantity (cross-entropy of a regression, argmax of a float target, a
per-batch mean of uneven batches) is off by orders of magnitude more.
"""
import json
import os

import numpy as np
import pytest

from hvdtrain import weights
from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, horovodrun, run

pytest.importorskip("torch")
pytest.importorskip("mxnet")
CLOSE = 1e-4
FRAMEWORKS = ["torch", "mxnet"]


def hvdtrain(*args, np_=2, timeout=300):
    cmd = [PY, "-m", "hvdtrain", *args]
    result = run(horovodrun(np_, *cmd) if np_ > 1 else cmd, timeout=timeout)
    assert result.returncode == 0, describe(result)
    return result


def expected_stop(values, patience, goal):
    """(epochs an early-stopping run trains, its best epoch) for these per-epoch values, as --early-stop says."""
    best, best_epoch = None, 0
    for epoch, v in enumerate(values, 1):
        if best is None or (v > best if goal == "max" else v < best):
            best, best_epoch = v, epoch
        elif epoch - best_epoch >= patience:
            return epoch, best_epoch
    return len(values), best_epoch


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_regression_reports_its_own_error_and_keeps_the_best_epoch(framework, tmp_path):
    from recipes.regression import load_diabetes, split
    out = str(tmp_path / "run")
    # ':max' on an error that falls while the model learns: an epoch soon fails to beat the best, and training stops.
    result = hvdtrain("recipe", "regression", "--framework", framework, "--epochs", "8", "--output-dir", out,
                      "--precision", "fp32",
                      "--monitor", "val_mse:max", "--early-stop", "1")
    records = read_metrics(out)
    mses = [r["val_mse"] for r in records]
    trained, best = expected_stop(mses, 1, "max")
    assert len(records) == trained < 8, records
    assert "hvdtrain: early stop after epoch" in result.output
    assert all("samples_per_sec" in r and "images_per_sec" not in r and "val_accuracy" not in r for r in records)
    # The best epoch's checkpoint, evaluated by numpy in float64, gives the record's figures.
    arrays, meta = weights.read(os.path.join(out, "best"))
    assert meta["epoch"] == best
    _, (x, y), _, y_std = split(*load_diabetes())
    h = np.tanh(x @ arrays["0.weight"].T.astype(np.float64) + arrays["0.bias"])
    h = np.tanh(h @ arrays["2.weight"].T + arrays["2.bias"])
    err = ((h @ arrays["4.weight"].T + arrays["4.bias"])[:, 0] - y) * y_std
    record = records[best - 1]
    assert record["val_mse"] == pytest.approx(np.mean(err ** 2), rel=CLOSE)
    assert record["val_mae"] == pytest.approx(np.mean(np.abs(err)), rel=CLOSE)
    assert record["val_loss"] == pytest.approx(np.mean(err ** 2) / y_std ** 2, rel=CLOSE)  # the recipe's own loss
    assert records[-1]["val_rmse"] < 0.9 * y_std  # learnt something: the target's own spread is y_std
    # The exported model carries the figures of the epoch it holds.
    exported = str(tmp_path / "export")
    hvdtrain("export", os.path.join(out, "best"), "--output", exported, np_=1)
    meta = json.load(open(os.path.join(exported, "model.json")))
    assert meta["epoch"] == best and meta["metrics"]["val_mse"] == record["val_mse"], meta


LANGUAGE_MODELS = {}
"""framework -> (output directory, last record) of the 60-step charlm run, trained once per session."""


def train_language_model(framework, tmp_path_factory):
    if framework not in LANGUAGE_MODELS:
        out = str(tmp_path_factory.mktemp(f"charlm_{framework}") / "run")
        hvdtrain("recipe", "charlm", "--framework", framework, "--seq-len", "32", "--hidden", "64",
                 "--epochs", "1", "--max-steps", "60", "--output-dir", out)
        LANGUAGE_MODELS[framework] = out, read_metrics(out)[-1]
    return LANGUAGE_MODELS[framework]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def language_model(request, tmp_path_factory):
    return (request.param, *train_language_model(request.param, tmp_path_factory))


def test_language_model_metrics_are_the_same_over_one_rank_and_two(language_model, tmp_path):
    framework, out, record = language_model
    assert record["tokens_per_sec"] == pytest.approx(32 * record["sequences_per_sec"])
    assert 1 < record["val_perplexity"] < 30, record  # uniform over bytes: 256
    for np_ in (1, 2):
        where = str(tmp_path / f"eval{np_}")
        hvdtrain("eval", out, "--output-dir", where, np_=np_)  # the recipe and its options from the run
        got = json.load(open(os.path.join(where, "eval.json")))
        for key in ("val_loss", "val_perplexity", "val_accuracy"):
            assert got[key] == pytest.approx(record[key], rel=1e-5), (np_, key, got, record)
        assert got["val_perplexity"] == pytest.approx(np.exp(got["val_loss"]), rel=1e-5)


def test_language_model_learns_alike_on_both_frameworks(tmp_path_factory):
    # Each framework's own initialisation and kernels: the same recipe, the same data order, within 15%.
    got = {fw: train_language_model(fw, tmp_path_factory)[1]["val_perplexity"] for fw in FRAMEWORKS}
    assert abs(got["torch"] / got["mxnet"] - 1) < 0.15, got


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_own_task_with_two_inputs_its_own_step_and_metric(framework, tmp_path):
    from tests.task_recipe import AUX, make_data, numpy_forward
    out = str(tmp_path / "run")
    hvdtrain("recipe", "tests.task_recipe:TwoInputTrainer", "--framework", framework, "--output-dir", out,
             "--precision", "fp32")
    record = read_metrics(out)[-1]
    arrays, _ = weights.read(out)
    a, b, y = make_data(101, 2)
    pred = numpy_forward({k: v.astype(np.float64) for k, v in arrays.items()}, a, b)
    assert record["val_mse"] == pytest.approx(np.mean((pred - y) ** 2), rel=CLOSE)
    assert record["val_loss"] == pytest.approx(np.mean((pred - y) ** 2 + AUX * pred ** 2), rel=CLOSE)
    within = np.mean(np.abs(pred - y) <= 0.1)
    assert abs(record["val_within_tenth"] - within) <= 1 / 101, (record, within)  # a prediction at the border
    assert record["val_mse"] < 0.5 * np.var(y), record


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_regression_without_metrics_reports_errors_not_accuracy(framework, tmp_path):
    """Issue 47, item 10: a regression that declared no metrics ended with "done: val_accuracy 0.00%" (the default
    accuracy applied to float targets). The defaults now fit the target: the mean squared and absolute errors."""
    out = tmp_path / "run"
    result = hvdtrain("recipe", "tests.task_recipe:NoMetricsRegression", "--framework", framework, "--epochs", "1",
                      "--precision", "fp32", "--output-dir", str(out), np_=1)
    record = read_metrics(str(out))[-1]
    assert "val_accuracy" not in record and record["val_mse"] > 0 and record["val_mae"] > 0, record
    assert "done: val_mse" in result.output and "val_accuracy" not in result.output, describe(result)


def test_a_sequence_model_in_pytorchs_n_c_t_convention_trains_and_is_scored(tmp_path):
    """Issue 47, item 10: outputs (N, C, T) with (N, T) targets crashed in the first evaluation ("'bool' object has
    no attribute 'sum'" in Accuracy.sums). Scored per token now, the pads left out of the accuracy and the loss."""
    out = tmp_path / "run"
    hvdtrain("recipe", "tests.task_recipe:SequenceTrainer", "--output-dir", str(out), np_=1)
    record = read_metrics(str(out))[-1]
    assert 0 <= record["val_accuracy"] <= 1 and np.isfinite(record["val_loss"]), record


def test_an_output_no_metric_can_read_is_one_line_before_training(tmp_path):
    out = tmp_path / "run"
    cmd = [PY, "-m", "hvdtrain", "recipe", "tests.task_recipe:SequenceTrainer", "--bad-output",
           "--output-dir", str(out)]
    result = run(cmd, timeout=120)
    assert result.returncode == 2, describe(result)
    assert "metric accuracy: the model's output (16, 5, 7) does not fit targets (16, 6)" in result.stderr, \
        describe(result)
    assert "before training" in result.stderr and "Traceback" not in result.output, describe(result)
    assert not (out / "metrics.jsonl").exists() or not read_metrics(str(out)), "nothing trained"
