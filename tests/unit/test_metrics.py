"""Metrics as objects: sums that add over shards, values that equal a direct computation on the whole set."""
import math

import numpy as np
import pytest

from hvdtrain.backends.base import Task
from hvdtrain.data import split_batch
from hvdtrain.metrics import (Accuracy, MeanAbsoluteError, MeanSquaredError, Perplexity, RootMeanSquaredError, Tally,
                              TopK)


def shards(n, parts):
    cuts = sorted(np.random.default_rng(0).choice(np.arange(1, n), parts - 1, replace=False))
    return np.split(np.arange(n), cuts)


def tally_over(metrics, outputs, target, parts):
    """As the Trainer does it: a Tally per rank over uneven shards, summed (the allreduce), then the values."""
    total = None
    for idx in shards(len(target), parts):
        t = Tally(metrics)
        for batch in np.array_split(idx, 3):
            if len(batch):
                t.add(outputs[batch], target[batch])
        total = t.total if total is None else total + t.total
    return Tally(metrics).values(total)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_classification_metrics_equal_the_whole_set_over_uneven_shards(parts):
    rng = np.random.default_rng(1)
    logits, y = rng.standard_normal((97, 7)), rng.integers(0, 7, 97)
    got = tally_over([Accuracy(), TopK(3), Perplexity()], logits, y, parts)
    assert got["val_accuracy"] == pytest.approx(np.mean(logits.argmax(1) == y), abs=1e-12)
    top3 = np.argsort(-logits, axis=1)[:, :3]
    assert got["val_top3"] == pytest.approx(np.mean((top3 == y[:, None]).any(1)), abs=1e-12)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert got["val_perplexity"] == pytest.approx(math.exp(-logp[np.arange(97), y].mean()), rel=1e-12)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_regression_metrics_count_every_target_element_once(parts):
    rng = np.random.default_rng(2)
    pred, y = rng.standard_normal((50, 2)), rng.standard_normal((50, 2))
    got = tally_over([MeanSquaredError(scale=3.0), MeanAbsoluteError(scale=3.0), RootMeanSquaredError()], pred, y,
                     parts)
    assert got["val_mse"] == pytest.approx(9 * np.mean((pred - y) ** 2), rel=1e-12)
    assert got["val_mae"] == pytest.approx(3 * np.mean(np.abs(pred - y)), rel=1e-12)
    assert got["val_rmse"] == pytest.approx(math.sqrt(np.mean((pred - y) ** 2)), rel=1e-12)


def test_sequence_targets_count_each_position_and_padding_is_left_out():
    rng = np.random.default_rng(3)
    logits, y = rng.standard_normal((4, 5, 11)), rng.integers(0, 11, (4, 5))
    y[0, 3:] = -100
    got = tally_over([Perplexity(), Accuracy()], logits, y, 2)
    keep = y != -100
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.where(keep, y, 0)[..., None], -1)[..., 0][keep]
    assert got["val_perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    # issue 47, item 5: the pads count nowhere (they were counted as misses by accuracy)
    assert got["val_accuracy"] == pytest.approx(np.mean((logits.argmax(-1) == y)[keep]), abs=1e-12)


def test_a_mismatched_output_and_duplicate_names_are_refused_with_the_metric_named():
    with pytest.raises(ValueError, match="metric mse: the model's output has"):
        Tally([MeanSquaredError()]).add(np.zeros((4, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="distinct non-empty names"):
        Tally([Accuracy(), Accuracy()])


def test_batches_split_into_inputs_and_target_whatever_their_structure():
    assert split_batch((1, 2, 3)) == ((1, 2), 3)
    assert split_batch({"tokens": 1, "mask": 2, "target": 3}) == ((1, 2), 3)
    with pytest.raises(ValueError, match="'target' entry"):
        split_batch({"x": 1})
    with pytest.raises(ValueError, match="override Trainer.split_batch"):
        split_batch((1,))


def test_a_loss_is_summed_per_sample_whatever_its_reduction():
    assert Task.loss_total(np.array(2.0), None, 8) == (16.0, 8.0)          # a batch mean
    assert Task.loss_total(np.full(8, 1.5), np.zeros(8, int), 8) == (12.0, 8.0)   # one per sample
    assert Task.loss_total(np.full((8, 10), 0.5), np.zeros((8, 10), int), 8) == (40.0, 80.0)  # per token
    assert Task.loss_total(np.full((8, 10), 0.5), None, 8) == (4.0, 8.0)  # ten values per sample: each sample's mean
    padded = np.zeros((2, 4), int)
    padded[1, 2:] = -100  # issue 47, item 5: the pads' positions count nowhere (they were averaged in)
    assert Task.loss_total(np.full((2, 4), 3.0), padded, 2) == (18.0, 6.0)
    with pytest.raises(ValueError, match="81 values for a batch of 8"):
        Task.loss_total(np.zeros(81), None, 8)


def test_monitor_picks_the_best_epoch_stops_after_patience_and_resumes_its_count():
    from hvdtrain.config import ConfigError
    from hvdtrain.monitor import Monitor
    goals = {"val_loss": "min", "val_accuracy": "max"}
    with pytest.raises(ConfigError, match="--monitor val_mse: this task's records have val_accuracy, val_loss"):
        Monitor("val_mse", 0, goals)
    m = Monitor("val_accuracy", 2, goals)
    seen = [m.observe({"epoch": e, "val_accuracy": v}) for e, v in enumerate([0.5, 0.7, float("nan"), 0.6], 1)]
    assert seen == [True, True, False, False] and m.best_epoch == 2 and m.stop
    resumed = Monitor("val_accuracy", 2, goals)
    resumed.load(m.state())
    assert resumed.stop and resumed.best == 0.7
    other = Monitor("val_loss:max", 2, goals)  # another key or direction starts its own count
    other.load(m.state())
    assert other.best is None and other.goal == "max"


def test_one_padding_rule_six_right_tokens_and_two_pads_score_one():
    """Issue 47, item 5: 6 real tokens all predicted right plus 2 pads scored 0.75 in accuracy and top-k."""
    y = np.array([[1, 2, 3, 4], [0, 1, -100, -100]])
    logits = np.full((2, 4, 5), -5.0)
    for (i, j), c in np.ndenumerate(y):
        logits[i, j, c if c >= 0 else 0] = 5.0
    got = tally_over([Accuracy(), TopK(2), Perplexity()], logits, y, 1)
    assert got["val_accuracy"] == 1.0 and got["val_top2"] == 1.0
    assert got["val_perplexity"] < 1.01


def test_pytorchs_sequence_convention_n_c_t_is_read_on_axis_1():
    """Issue 47, item 10: outputs (N, C, T) with targets (N, T), CrossEntropyLoss's own convention, crashed in
    Accuracy.sums ("'bool' object has no attribute 'sum'")."""
    rng = np.random.default_rng(5)
    last = rng.standard_normal((3, 7, 11))  # (N, T, C)
    y = rng.integers(0, 11, (3, 7))
    first = np.moveaxis(last, -1, 1)  # (N, C, T)
    for metric in (Accuracy, lambda: TopK(3), Perplexity):
        a, b = tally_over([metric()], last, y, 1), tally_over([metric()], first, y, 1)
        assert a == pytest.approx(b, rel=1e-12)


def test_outputs_that_cannot_fit_the_targets_are_one_line_naming_both_shapes():
    with pytest.raises(ValueError) as e:
        Tally([Accuracy()]).add(np.zeros((4, 3, 5)), np.zeros((4, 7), dtype=np.int64))
    assert "metric accuracy: the model's output (4, 3, 5) does not fit targets (4, 7)" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="metric accuracy: the target is float64"):
        Tally([Accuracy()]).add(np.zeros((4, 1)), np.zeros(4))


def test_a_single_logit_is_a_binary_classifier():
    """Issue 47, item 5: a single-logit binary output always predicted class 0 (perfect predictions scored 0.5)."""
    y = np.array([0, 1, 1, 0])
    for logits in (np.array([-3.0, 2.0, 4.0, -1.0]), np.array([[-3.0], [2.0], [4.0], [-1.0]])):
        assert tally_over([Accuracy()], logits, y, 1)["val_accuracy"] == 1.0


def test_a_diverged_models_perplexity_is_inf_not_an_error():
    """Issue 47, item 6: the mean NLL past ~709 raised OverflowError in evaluation."""
    logits = np.zeros((2, 3))
    logits[:, 0] = 1000.0
    assert tally_over([Perplexity()], logits, np.array([1, 2]), 1)["val_perplexity"] == math.inf


def test_a_metric_named_loss_is_refused():
    """Issue 47, item 7: a user metric named "loss" silently replaced the recipe's val_loss."""
    class Loss(MeanSquaredError):
        name = "loss"
    with pytest.raises(ValueError, match="metric name 'loss' is the Trainer's own"):
        Tally([Loss()])
