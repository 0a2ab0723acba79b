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


# --lr-schedule: the decay after warmup, in optimizer steps (4 epochs of 10 steps, 1 of warmup).
def _lr(step, kind, **kw):
    decay = schedule.decay(kind, epochs=4, steps_per_epoch=10, warmup_epochs=1, **kw)
    return schedule.lr_at(step, base_lr=0.01, rule="linear", size=2, warmup_epochs=1,
                          steps_per_epoch=10, decay=decay)


def test_cosine_peaks_at_warmup_end_halves_midway_and_ends_at_the_floor():
    assert _lr(0, "cosine") == pytest.approx(0.01)  # warmup starts at the base rate
    assert _lr(10, "cosine") == pytest.approx(0.02)  # warmup's end: the scaled peak
    # Midway through the 29 steps after warmup (step 24.5): (1 + 0.1) / 2 of the peak.
    mid = schedule.decay("cosine", epochs=4, steps_per_epoch=10, warmup_epochs=1)
    assert 0.02 * mid.multiplier(24.5) == pytest.approx(0.02 * 0.55)
    assert _lr(39, "cosine") == pytest.approx(0.002)  # the last step: peak / 10
    assert _lr(39, "cosine", min_ratio=0.0) == pytest.approx(0.0, abs=1e-12)
    rates = [_lr(s, "cosine") for s in range(10, 40)]
    assert all(a > b for a, b in zip(rates, rates[1:]))  # decreasing after warmup


def test_step_drops_tenfold_at_each_boundary():
    rates = {s: _lr(s, "step", step_epochs=(2, 3)) for s in (10, 19, 20, 29, 30, 39)}
    assert rates == pytest.approx({10: 0.02, 19: 0.02, 20: 0.002, 29: 0.002, 30: 0.0002,
                                   39: 0.0002})


def test_constant_keeps_the_scaled_rate():
    assert [_lr(s, "constant") for s in (10, 25, 39)] == pytest.approx([0.02] * 3)


def test_a_run_resumed_at_another_size_continues_on_the_same_curve():
    """Resumed after epoch 2 of 4 at twice the world size (half the steps per epoch): its first
    step's multiplier is the one the first run would have had at the start of epoch 3."""
    first = schedule.decay("cosine", epochs=4, steps_per_epoch=10, warmup_epochs=1)
    second = schedule.decay("cosine", epochs=4, steps_per_epoch=5, warmup_epochs=1)
    assert second.multiplier(2 * 5) == pytest.approx(first.multiplier(2 * 10), rel=0.03)
    assert second.multiplier(19) == pytest.approx(first.multiplier(39)) == pytest.approx(0.1)


@pytest.mark.parametrize("kw,match", [
    (dict(kind="linear"), "lr_schedule must be one of constant, cosine, step"),
    (dict(kind="step", step_epochs=(0.5,)), r"--lr-steps epochs must lie in \[1, 4\)"),
    (dict(kind="step", step_epochs=(4,)), r"must lie in \[1, 4\)"),
    (dict(kind="cosine", min_ratio=1.5), "min_ratio must be in"),
])
def test_decay_errors(kw, match):
    kind = kw.pop("kind")
    with pytest.raises(ValueError, match=match):
        schedule.decay(kind, epochs=4, steps_per_epoch=10, warmup_epochs=1, **kw)


def test_torch_warmup_applies_the_decay_and_resumes_on_it():
    torch = pytest.importorskip("torch")
    from hvdtrain.torch.scheduler import Warmup
    decay = schedule.decay("cosine", epochs=4, steps_per_epoch=10, warmup_epochs=1)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.02)
    opt.param_groups[0]["hvdtrain_lr_scale"] = 2.0
    warm = Warmup(opt, warmup_epochs=1, steps_per_epoch=10, decay=decay)
    seen = []
    for _ in range(40):
        seen.append(opt.param_groups[0]["lr"])
        warm.step()
    assert seen == pytest.approx([_lr(s, "cosine") for s in range(40)])
    resumed = torch.optim.SGD([param], lr=0.02)  # a resumed run's optimizer at the scaled rate
    resumed.param_groups[0]["hvdtrain_lr_scale"] = 2.0
    again = Warmup(resumed, warmup_epochs=1, steps_per_epoch=10, decay=decay)
    again.load_state_dict({"last_step": 25})
    assert resumed.param_groups[0]["lr"] == pytest.approx(_lr(25, "cosine"))
    with pytest.raises(ValueError, match="a decay or a scheduler"):
        Warmup(opt, warmup_epochs=1, steps_per_epoch=10, decay=decay,
               scheduler=torch.optim.lr_scheduler.StepLR(opt, 5))


def test_keras_schedule_follows_the_same_decay_inside_the_step():
    pytest.importorskip("keras")
    import numpy as np
    from keras import ops

    from hvdtrain.keras.scheduler import WarmupSchedule
    for kind, kw in (("cosine", {}), ("step", {"step_epochs": (2, 3)})):
        decay = schedule.decay(kind, epochs=4, steps_per_epoch=10, warmup_epochs=1, **kw)
        lr = WarmupSchedule(0.01, 2.0, backward_passes_per_step=2, warmup_steps=10, decay=decay)
        traced = [float(ops.convert_to_numpy(lr(np.int64(2 * s)))) for s in range(40)]
        assert traced == pytest.approx([_lr(s, kind, **kw) for s in range(40)], rel=1e-5)
        assert [lr.lr_at(s) for s in range(40)] == pytest.approx(traced, rel=1e-5)
        assert WarmupSchedule(**lr.get_config()).lr_at(25) == pytest.approx(lr.lr_at(25))


def test_a_fractional_step_epoch_drops_at_the_same_whole_step_in_python_and_keras():
    """--lr-steps 2.2 at 25 steps per epoch: 2.2 x 25 is 55.00000000000001 in floats; the drop
    takes effect at step 55 (the first whole step at or after it) in both, not 55 in the
    float32 Keras step and 56 in Python."""
    decay = schedule.decay("step", epochs=10, steps_per_epoch=25, step_epochs=(2.2,))
    assert decay.boundaries == (55.0,)
    assert [decay.multiplier(s) for s in (54, 55)] == [1.0, pytest.approx(0.1)]
    pytest.importorskip("keras")
    import numpy as np
    from keras import ops

    from hvdtrain.keras.scheduler import WarmupSchedule
    lr = WarmupSchedule(1.0, 1.0, decay=decay)
    assert [float(ops.convert_to_numpy(lr(np.int64(s)))) for s in (54, 55)] == pytest.approx(
        [1.0, 0.1])


def test_keras_schedule_on_the_torch_backend_with_and_without_a_decay():
    """The torch backend runs the schedule eagerly: the step and the variables are read once and
    the rule runs in Python, returning a float. A decay set afterwards (hk.warmup(decay=)) and
    the variables that elastic.py (scale) and the warmup callback (warmup_steps) assign
    directly take effect at the next call, as in the traced TensorFlow step. A fresh
    interpreter: the backend is chosen when Keras is imported."""
    pytest.importorskip("keras")
    import json
    import os
    import subprocess
    import sys
    code = ("import json, numpy as np\n"
            "from keras import ops\n"
            "from hvdtrain import schedule\n"
            "from hvdtrain.keras.scheduler import WarmupSchedule\n"
            "lr = WarmupSchedule(0.01, 2.0, backward_passes_per_step=2, warmup_steps=10)\n"
            "f = lambda: [float(ops.convert_to_numpy(lr(np.int64(2 * s)))) for s in range(40)]\n"
            "constant = f()\n"
            "lr.set_decay(schedule.decay('cosine', epochs=4, steps_per_epoch=10, "
            "warmup_epochs=1))\n"
            "cosine = f()\n"
            "lr.scale.assign(4.0); lr.warmup_steps.assign(0.0)\n"
            "it = __import__('keras').Variable(np.int64(6), dtype='int64', trainable=False)\n"
            "print(json.dumps([constant, cosine, lr(it), type(lr(it)).__name__]))\n")
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.splitlines()[-1]
    constant, cosine, rescaled, kind = json.loads(out)
    assert constant == pytest.approx([_lr(s, "constant") for s in range(40)], rel=1e-5)
    assert cosine == pytest.approx([_lr(s, "cosine") for s in range(40)], rel=1e-5)
    # micro-batch 6 = optimizer step 3 (k=2), past a warmup now 0 steps long, factor 4
    decay = schedule.decay("cosine", epochs=4, steps_per_epoch=10, warmup_epochs=1)
    assert rescaled == pytest.approx(0.01 * 4.0 * decay.multiplier(3), rel=1e-6)
    assert kind == "float"
