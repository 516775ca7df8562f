"""A rate belongs to its optimizer (issue 58, item 1): --optimizer X without --base-lr trains at X's base rate for the
recipe, never at another optimizer's, the start-up line says which, and a loss that climbs well above where the run
began is warned about once, naming the optimizer and the rate."""
import pytest

from hvdtrain.config import BASE_LRS, TrainConfig, help_text, optimizer_rates, parse_overrides
from hvdtrain.health import Health
from recipes.imagenet import ImageNetConfig
from recipes.mnist import MNISTConfig
from recipes.regression import RegressionConfig


def test_each_optimizer_gets_its_own_rate_unless_one_is_given():
    assert parse_overrides(MNISTConfig, []).base_lr == 0.03  # the recipe's SGD rate
    adamw = parse_overrides(MNISTConfig, ["--optimizer", "adamw"])
    assert adamw.base_lr == BASE_LRS["adamw"] == 0.001
    assert adamw.base_lr_reason() == "adamw's base rate in this recipe"
    given = parse_overrides(MNISTConfig, ["--optimizer", "adamw", "--base-lr", "0.03"])
    assert given.base_lr == 0.03 and given.base_lr_reason() == "--base-lr"
    assert parse_overrides(RegressionConfig, []).base_lr == 0.003  # its default optimizer is adam
    assert parse_overrides(RegressionConfig, ["--optimizer", "lars"]).base_lr == BASE_LRS["lars"]
    assert TrainConfig(optimizer="lamb").base_lr == 0.01


def test_imagenet_scales_each_optimizers_rate_per_256_images():
    assert ImageNetConfig().base_lr == pytest.approx(0.1 * 32 / 256)  # Goyal et al.
    lars = ImageNetConfig(optimizer="lars", batch_size=64)
    assert lars.base_lr == pytest.approx(0.8 * 64 / 256) and lars.base_lr_reason() == "lars's rate per 256 images x 64 / 256"
    assert ImageNetConfig(optimizer="adamw", lr_per_256=0.001).base_lr_reason() == "--lr-per-256 x 32 / 256"


def test_help_lists_the_rate_of_each_optimizer():
    assert optimizer_rates(MNISTConfig) == {"sgd": 0.03, "adam": 0.001, "adamw": 0.001, "lars": 4.0, "lamb": 0.01}
    assert help_text(MNISTConfig, "mnist").endswith(
        "base rate of each --optimizer when --base-lr is not given: sgd 0.03, adam 0.001, adamw 0.001, lars 4, lamb 0.01")


class _Backend:
    rank = 0

    @staticmethod
    def scalar(x):
        return float(x)

    @staticmethod
    def last_step_applied():
        return True


def _losses(health, losses, lr=0.06):
    for step, loss in enumerate(losses, 1):
        health.observe(loss, step, lr)


def test_a_rising_loss_is_warned_about_once_naming_the_optimizer_and_the_rate(capsys):
    cfg = parse_overrides(MNISTConfig, ["--optimizer", "adamw", "--base-lr", "0.03"])
    health = Health(_Backend(), 0, "ckpt", cfg)
    _losses(health, [2.3] * 10 + [2.5] * 10 + [4.6] * 30)  # warned at step 30, once
    err = capsys.readouterr().err
    assert err.count("warning") == 1, err
    assert ("the training loss rose from 2.3 (the first step's) to 4.6 (the mean of steps 21-30) with --optimizer adamw "
            "at lr 0.06 (base 0.03, --base-lr): the rate may be too high for this optimizer; lower --base-lr, or "
            "leave it out for this recipe's adamw rate, 0.001") in err, err


def test_a_falling_noisy_resumed_or_fine_tuned_loss_and_other_ranks_say_nothing(capsys):
    cfg = parse_overrides(MNISTConfig, [])
    _losses(Health(_Backend(), 0, "ckpt", cfg), [2.3] * 10 + [3.2] * 10 + [0.5] * 100)  # 1.39x: under the threshold
    other = _Backend()
    other.rank = 1
    _losses(Health(other, 0, "ckpt", cfg), [2.3] * 10 + [9.0] * 10)
    _losses(Health(_Backend(), 0, "ckpt", cfg), [-1.0] + [5.0] * 20)  # a loss that may be negative: no reference
    resumed = Health(_Backend(), 0, "ckpt", cfg)
    for step in range(101, 131):  # a resumed run's first step is no reference
        resumed.observe(0.1 if step == 101 else 0.5, step, 0.06)
    _losses(Health(_Backend(), 0, "ckpt", MNISTConfig(init_from="weights.pt")), [0.1] + [0.5] * 20)  # fine-tuning
    _losses(Health(_Backend(), 0, "ckpt", cfg), [2.3] * 10 + [float("nan")] * 20 + [2.4] * 10)
    assert capsys.readouterr().err == ""
