"""The large-batch warning and the divergence verdict (hvdtrain.guard), with the numbers of the
runs that motivated them: MNIST (60,000 training images), base batch 32."""
import math

import pytest

from hvdtrain import guard, schedule
from hvdtrain.run.report import EpochMetrics


def warning(global_batch, rule, train_samples=60000, base_batch=32):
    factor = schedule.scale_factor(rule, global_batch // base_batch)
    return guard.large_batch_warning(global_batch, train_samples, rule, factor)


def test_linear_rule_warns_past_goyal_et_al_fraction_and_names_it():
    assert warning(256, "linear") is None  # 0.43 % of the set: inside Goyal et al.'s 0.64 %
    text = warning(4096, "linear")  # the run that collapsed to one class
    assert "global batch 4,096 is 6.83% of the 60,000 training samples" in text
    assert "0.64%" in text and "Goyal et al. 2017" in text
    assert "--lr-scaling sqrt" in text and "-k" in text and "--warmup-epochs" in text


def test_an_elastic_run_is_told_only_what_it_can_change():
    """Elastic runs refuse --warmup-epochs and -k: the warning and the verdict leave them out."""
    factor = schedule.scale_factor("linear", 4096 // 32)
    text = guard.large_batch_warning(4096, 60000, "linear", factor, warmup=False)
    assert text.endswith("Try --lr-scaling sqrt, fewer ranks")
    why = guard.divergence(epochs((0.9, 0.70), (2.31, 0.1135)), 0, 10, warmup=False)
    assert "(fewer ranks)" in why and "-k" not in why and "--warmup-epochs" not in why


def test_sqrt_rule_has_its_own_range_and_none_never_warns():
    assert warning(256, "sqrt") is None  # 0.43 %: where sqrt was measured to hold
    text = warning(1024, "sqrt")  # 1.4 points below batch 32 in benchmarks/scaling_rule.py
    assert "sqrt scaling" in text and "0.43%" in text and "--lr-scaling sqrt" not in text
    assert guard.large_batch_warning(4096, 60000, "none", 1.0) is None


def test_no_warning_where_the_rule_barely_changes_the_rate():
    # digits at np=2: 32 of 1,437 samples (2.2 %) but the rate only doubles
    assert guard.large_batch_warning(32, 1437, "linear", 2.0) is None
    assert guard.large_batch_warning(64, 1437, "linear", 4.0) is not None


def epochs(*rows):
    return [EpochMetrics(i + 1, loss, acc, 0.0, 0.0, 0.1, 10, 1.0, 1.0)
            for i, (loss, acc) in enumerate(rows)]


def test_a_healthy_run_is_never_called_diverged():
    history = epochs((0.9, 0.70), (0.3, 0.91), (0.2, 0.94), (0.15, 0.95))
    for n in range(1, len(history) + 1):
        assert guard.divergence(history[:n], warmup_epochs=1, num_classes=10) is None


def test_loss_above_the_first_epoch_after_warmup_is_divergence():
    history = epochs((0.9, 0.70), (2.31, 0.1135))  # the global batch 4,096 collapse
    why = guard.divergence(history, warmup_epochs=1, num_classes=10)
    assert why.startswith("training diverged in epoch 2 (after warmup): training loss 2.3100 "
                          "is above the first epoch's 0.9000")
    assert "--no-divergence-check" in why and "--lr-scaling sqrt" in why


def test_accuracy_near_chance_is_divergence_even_when_the_loss_fell():
    history = epochs((40.0, 0.10), (3.0, 0.12))  # diverged from the start, loss less absurd
    why = guard.divergence(history, warmup_epochs=0, num_classes=10)
    assert "training accuracy 0.1200 is near chance (0.1000 for 10 classes)" in why


def test_non_finite_loss_is_divergence():
    assert "training loss nan" in guard.divergence(epochs((1.0, 0.5), (math.nan, 0.5)), 0, 10)


@pytest.mark.parametrize("warmup, first_checked", [(0, 2), (1, 2), (2, 3), (2.5, 4)])
def test_nothing_is_judged_during_warmup_or_on_the_first_epoch(warmup, first_checked):
    bad = epochs(*[(1.0, 0.1)] * 5)
    for n in range(1, 6):
        verdict = guard.divergence(bad[:n], warmup_epochs=warmup, num_classes=10)
        assert (verdict is not None) == (n >= first_checked), (n, verdict)


def test_a_sqrt_run_is_not_told_to_use_sqrt():
    history = epochs((0.9, 0.70), (2.31, 0.1135))
    assert "--lr-scaling sqrt" not in guard.divergence(history, 1, 10, lr_scaling="sqrt")
    assert "--lr-scaling sqrt" in guard.divergence(history, 1, 10, lr_scaling="linear")


def test_a_run_without_warmup_is_not_told_about_warmup():
    history = epochs((1.0, 0.5), (2.0, 0.5))
    elastic = guard.divergence(history, 0, 10, warmup=False)
    assert elastic.startswith("training diverged in epoch 2: training loss 2.0000")
    assert "warmup" not in elastic
    assert "longer --warmup-epochs" in guard.divergence(history, 0, 10)
