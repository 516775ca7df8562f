from hvdtrain.loss_scale import DynamicLossScale


def test_overflow_halves_the_scale_and_skips_the_step():
    s = DynamicLossScale(init_scale=1024.0, growth_interval=3)
    assert s.update(finite=False) is False and s.scale == 512.0 and s.skipped == 1
    assert s.update(finite=True) is True and s.scale == 512.0


def test_scale_doubles_after_growth_interval_finite_steps_in_a_row():
    s = DynamicLossScale(init_scale=8.0, growth_interval=3)
    for _ in range(2):
        s.update(True)
    s.update(False)  # the run of finite steps starts again
    assert s.scale == 4.0
    for _ in range(3):
        s.update(True)
    assert s.scale == 8.0


def test_scale_never_drops_below_one_and_state_round_trips():
    s = DynamicLossScale(init_scale=2.0)
    for _ in range(5):
        s.update(False)
    assert s.scale == 1.0
    t = DynamicLossScale()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
