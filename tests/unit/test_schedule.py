import math

import pytest

from hvdtrain import schedule


@pytest.mark.parametrize("rule,size,k,expected", [
    ("linear", 1, 1, 1.0), ("linear", 2, 1, 2.0), ("linear", 2, 4, 8.0), ("linear", 8, 3, 24.0),
    ("sqrt", 4, 1, 2.0), ("sqrt", 2, 2, 2.0), ("sqrt", 2, 1, math.sqrt(2)),
    ("none", 8, 4, 1.0),
])
def test_scale_factor(rule, size, k, expected):
    assert schedule.scale_factor(rule, size, k) == pytest.approx(expected, rel=1e-12)
    assert schedule.scaled_lr(0.1, rule, size, k) == pytest.approx(0.1 * expected, rel=1e-12)


@pytest.mark.parametrize("args,match", [
    (("cosine", 2, 1), "lr_scaling must be one of linear, sqrt, none"),
    (("linear", 0, 1), "size must be >= 1"),
    (("linear", 2, 0), "backward_passes_per_step must be >= 1"),
])
def test_scale_factor_errors(args, match):
    with pytest.raises(ValueError, match=match):
        schedule.scale_factor(*args)


def test_warmup_values_at_chosen_steps():
    # base 0.1, linear rule at size 4, k 2 -> target 0.8; 2 warmup epochs of 10 steps = 20 steps.
    kw = dict(base_lr=0.1, rule="linear", size=4, backward_passes_per_step=2, warmup_epochs=2,
              steps_per_epoch=10)
    assert schedule.lr_at(0, **kw) == pytest.approx(0.1)
    assert schedule.lr_at(5, **kw) == pytest.approx(0.1 + 0.7 * 5 / 20)
    assert schedule.lr_at(10, **kw) == pytest.approx(0.45)
    assert schedule.lr_at(19, **kw) == pytest.approx(0.1 + 0.7 * 19 / 20)
    assert schedule.lr_at(20, **kw) == pytest.approx(0.8)
    assert schedule.lr_at(1000, **kw) == pytest.approx(0.8)


def test_warmup_is_monotonic_and_fractional_epochs():
    kw = dict(base_lr=0.01, rule="sqrt", size=4, warmup_epochs=0.5, steps_per_epoch=7)
    values = [schedule.lr_at(s, **kw) for s in range(10)]
    assert values == sorted(values)
    assert values[0] == pytest.approx(0.01)
    assert values[4] == pytest.approx(0.02)  # ceil(3.5) = 4 steps of warmup, then sqrt(4) x 0.01
    assert values[3] == pytest.approx(0.01 + 0.01 * 3 / 3.5)


def test_no_warmup_means_scaled_lr_from_step_zero():
    assert schedule.lr_at(0, base_lr=0.1, rule="linear", size=2, warmup_epochs=0,
                          steps_per_epoch=5) == pytest.approx(0.2)


def test_warmup_multiplier_matches_lr_at():
    for step in range(0, 30, 3):
        lr = schedule.lr_at(step, base_lr=0.05, rule="linear", size=2, backward_passes_per_step=3,
                            warmup_epochs=1.5, steps_per_epoch=12)
        assert lr == pytest.approx(0.3 * schedule.warmup_multiplier(step, 6.0, 1.5, 12))


@pytest.mark.parametrize("kw,match", [
    (dict(step=-1), "step must be >= 0"),
    (dict(warmup_epochs=-1), "warmup_epochs must be >= 0"),
    (dict(steps_per_epoch=0), "steps_per_epoch must be >= 1"),
])
def test_lr_at_errors(kw, match):
    args = dict(step=0, base_lr=0.1, rule="linear", size=2, warmup_epochs=1, steps_per_epoch=10)
    args.update(kw)
    step = args.pop("step")
    with pytest.raises(ValueError, match=match):
        schedule.lr_at(step, **args)


@pytest.mark.parametrize("n,k,expected", [(12, 4, 3), (13, 4, 4), (1, 8, 1), (7, 1, 7)])
def test_steps_per_epoch_counts_partial_groups(n, k, expected):
    assert schedule.steps_per_epoch(n, k) == expected
