import pytest

from hvdtrain.schedule import decay_factor, learning_rate, scaled_lr


def lr(epoch, **kw):
    args = dict(base_lr=0.1, world_size=8, accumulate=1, warmup_epochs=5, total_epochs=90, mode="step",
                milestones=(30, 60, 80))
    args.update(kw)
    return learning_rate(epoch, **args)


def test_scaled_lr_is_base_times_workers_times_accumulation():
    assert scaled_lr(0.1, 16, 1) == pytest.approx(1.6)
    assert scaled_lr(0.1, 4, 2) == pytest.approx(0.8)


def test_warmup_starts_at_base_and_reaches_scaled_rate_linearly():
    assert lr(0.0) == pytest.approx(0.1)
    assert lr(2.5) == pytest.approx(0.1 + (0.8 - 0.1) / 2)
    assert lr(5.0) == pytest.approx(0.8)
    steps = [lr(e / 10) for e in range(50)]
    assert all(b > a for a, b in zip(steps, steps[1:])), "warmup must rise every step"


def test_warmup_includes_accumulation():
    assert lr(5.0, accumulate=4) == pytest.approx(0.1 * 8 * 4)


def test_step_decay_at_milestones():
    assert lr(29.99) == pytest.approx(0.8)
    assert lr(30) == pytest.approx(0.08)
    assert lr(60) == pytest.approx(0.008)
    assert lr(85) == pytest.approx(0.0008)


def test_cosine_runs_from_end_of_warmup_to_zero():
    assert lr(5, mode="cosine") == pytest.approx(0.8)
    assert lr(47.5, mode="cosine") == pytest.approx(0.4)
    assert lr(90, mode="cosine") == pytest.approx(0.0, abs=1e-12)


def test_poly_and_constant():
    assert decay_factor(5 + 42.5, 90, "poly", power=2, warmup_epochs=5) == pytest.approx(0.25)
    assert lr(70, mode="constant") == pytest.approx(0.8)


def test_no_warmup_means_scaled_rate_from_the_first_step():
    assert lr(0, warmup_epochs=0) == pytest.approx(0.8)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError):
        decay_factor(1, 10, "exponential")


def test_poly_with_an_end_rate_is_mlperfs_polynomial_decay():
    """MLPerf's ResNet-50 references (LARS): after warmup, lr = end + (peak - end) (1 - (step - warmup) / (total -
    warmup))^2 with end 1e-4; 8 workers of base 1.0 peak at 8."""
    total, warmup, peak, end = 40.0, 5.0, 8.0, 1e-4
    for epoch in (5.0, 10.0, 22.5, 39.0, 40.0):
        want = end + (peak - end) * (1 - (epoch - warmup) / (total - warmup)) ** 2
        got = learning_rate(epoch, base_lr=1.0, world_size=8, warmup_epochs=warmup, total_epochs=total, mode="poly",
                            power=2.0, end=end)
        assert got == pytest.approx(want, rel=1e-12), epoch
    assert learning_rate(40.0, base_lr=1.0, world_size=8, total_epochs=40.0, mode="cosine", end=end) == \
        pytest.approx(end)
