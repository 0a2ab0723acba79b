"""Guards for large global batches, shared by both trainers (no framework import).

Two checks, because with accumulation and many ranks one flag takes a user to a global batch where
the learning-rate scaling rule no longer holds, and such a run used to end "successfully" with a
model that predicts one class:

* :func:`large_batch_warning`, before training: the global batch per optimizer step, as a
  fraction of the training set, against the largest fraction at which the chosen rule was shown
  to hold (:data:`EVIDENCE`).
* :func:`divergence`, after every epoch: after warmup, a training loss above the first epoch's or
  a training accuracy near chance means the run diverged; the trainers then stop with
  :class:`DivergenceError` before writing that epoch's checkpoint, so the last good one is kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Evidence:
    """Where a scaling rule was shown to hold.

    Attributes:
        fraction: the largest global batch shown to work, as a fraction of the training set
            (samples per optimizer step / training samples).
        source: who showed it, on what, in words for the warning.
    """
    fraction: float
    source: str


EVIDENCE = {
    # Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", table 2 and
    # figure 1: ResNet-50 matched the small-batch error up to a global batch of 8,192 of
    # ImageNet-1k's 1,281,167 training images, and lost accuracy beyond it.
    "linear": Evidence(8192 / 1281167, "Goyal et al. 2017: ResNet-50 on ImageNet kept its "
                                       "accuracy up to a global batch of 8,192 of 1.28M images"),
    # This project's measurement (benchmarks/README.md, "Scaling rules by global batch"): MNIST,
    # a small CNN, SGD with momentum, lr 0.01 at batch 32, one warmup epoch, 3 epochs: sqrt
    # scaling stayed within 1 point of the batch-32 accuracy up to a global batch of 256 of
    # 60,000 images (0.43 %), was 1.4 points below it at 1,024 and diverged at 4,096.
    "sqrt": Evidence(256 / 60000, "hvdtrain's MNIST measurement (benchmarks/README.md): sqrt "
                                  "scaling stayed within 1 point of the small-batch accuracy up "
                                  "to a global batch of 256 of 60,000 images"),
}


def large_batch_warning(global_batch: int, train_samples: int, rule: str,
                        scale_factor: float, warmup: bool = True) -> str | None:
    """The warning for a global batch past the range where ``rule`` was shown to hold, or None.

    Args:
        global_batch: samples per optimizer step over all ranks (local batch x k x size).
        train_samples: samples in the training set.
        rule: ``"linear"``, ``"sqrt"`` or ``"none"`` (``"none"`` keeps the single-process rate:
            no warning, the run is only slower to converge).
        scale_factor: the factor the rule multiplies the base rate by
            (:func:`hvdtrain.schedule.scale_factor`). At 2 or less (two ranks, k = 1) the rule
            changes the rate too little to break it: no warning, which keeps small datasets
            such as digits at np=2 quiet.
        warmup: whether the run can warm up and accumulate (as in :func:`divergence`: a
            longer ``--warmup-epochs`` and a smaller ``-k`` are suggested only then).

    Returns:
        One line naming the fraction of the training set per step, the evidence and what to try.
    """
    evidence = EVIDENCE.get(rule)
    if evidence is None or scale_factor <= 2 or train_samples <= 0:
        return None
    fraction = global_batch / train_samples
    if fraction <= evidence.fraction:
        return None
    return (f"global batch {global_batch:,} is {fraction:.2%} of the {train_samples:,} training "
            f"samples per optimizer step, past the {evidence.fraction:.2%} where {rule} scaling "
            f"was shown to hold ({evidence.source}); expect lower accuracy or divergence. Try "
            + ("--lr-scaling sqrt, " if rule == "linear" else "")
            + ("a longer --warmup-epochs, fewer ranks or a smaller -k" if warmup
               else "fewer ranks"))


class DivergenceError(RuntimeError):
    """Training diverged (:func:`divergence`); raised on every rank after the same epoch, before
    that epoch's checkpoint is written, so the last good checkpoint stays.

    Attributes:
        reported: rank 0 printed the error already (before the ranks stopped together).
    """

    def __init__(self, message: str, reported: bool = False):
        super().__init__(message)
        self.reported = reported


# Training accuracy below chance + this margin counts as "near chance": a model that predicts one
# class scores that class's share (MNIST's largest class, "1", is 11.2 % of the training set).
CHANCE_MARGIN = 0.05


def divergence(epochs: list, warmup_epochs: float, num_classes: int,
               lr_scaling: str = "linear", warmup: bool = True) -> str | None:
    """Why the run diverged at its last epoch, or None.

    Checked only after warmup and from the second epoch on (the first is the reference, and a
    hard task may start near chance): the last epoch diverged when its training loss is not
    finite or above the first epoch's, or when its training accuracy is below chance
    (``1 / num_classes``) + :data:`CHANCE_MARGIN`. Every rank holds the same all-reduced epoch
    metrics, so every rank reaches the same verdict.

    Args:
        epochs: the run's epochs so far (objects with ``epoch``, ``train_loss`` in nats per
            sample, ``train_accuracy`` in [0, 1]), oldest first; ``epochs[0]`` is the reference.
        warmup_epochs: length of the learning-rate warmup in epochs.
        num_classes: number of classes (chance accuracy is ``1 / num_classes``).
        lr_scaling: the run's scaling rule (``--lr-scaling sqrt`` is suggested only to a
            linear run).
        warmup: whether the run can warm up and accumulate (a longer ``--warmup-epochs`` and a
            smaller ``-k`` are suggested only then; elastic runs have neither).

    Returns:
        A message naming the epoch, the numbers compared and what to try.
    """
    if len(epochs) < 2:
        return None
    first, last = epochs[0], epochs[-1]
    if last.epoch <= math.ceil(warmup_epochs):
        return None
    chance = 1.0 / num_classes
    if not math.isfinite(last.train_loss) or last.train_loss > first.train_loss:
        why = (f"training loss {last.train_loss:.4f} is above the first epoch's "
               f"{first.train_loss:.4f}")
    elif last.train_accuracy < chance + CHANCE_MARGIN:
        why = (f"training accuracy {last.train_accuracy:.4f} is near chance "
               f"({chance:.4f} for {num_classes} classes)")
    else:
        return None
    sqrt = "use --lr-scaling sqrt, " if lr_scaling == "linear" else ""
    longer = "use a longer --warmup-epochs, " if warmup else ""
    after = " (after warmup)" if warmup else ""
    smaller_k = " or a smaller -k" if warmup else ""
    return (f"training diverged in epoch {last.epoch}{after}: {why}. Lower --lr, {sqrt}"
            f"{longer}or a smaller global batch (fewer ranks{smaller_k}); "
            "--no-divergence-check trains on regardless")
