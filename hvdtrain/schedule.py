"""Learning-rate scaling with world size, and gradual warmup, as pure functions.

No framework is imported here: :mod:`hvdtrain.torch` and :mod:`hvdtrain.keras` both call these, so
the two adapters follow the same schedule to the last digit.

Rules (``lr_scaling``):

* ``"linear"``: ``lr x size x backward_passes_per_step``. The linear scaling rule of Goyal et al.
  2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour": when the global batch grows
  by a factor n, multiply the learning rate by n. ``base_lr`` is the rate tuned for one process
  running one micro-batch per step (the local batch).
* ``"sqrt"``: ``lr x sqrt(size x backward_passes_per_step)``. The square-root rule (Krizhevsky
  2014, "One weird trick..."; Hoffer et al. 2017), often better for adaptive optimizers.
* ``"none"``: ``lr`` unchanged.

Warmup (Goyal et al. 2017, section 2.2, "gradual warmup"): over the first ``warmup_epochs`` epochs
the rate rises linearly, step by step, from ``base_lr`` to the scaled rate, then stays there.
"""
from __future__ import annotations

import math

LR_SCALING_RULES = ("linear", "sqrt", "none")


def resolve_lr_scaling(rule: str | None, op: str = "average") -> str:
    """The scaling rule ``distribute`` applies: ``rule``, or the default for the reduction ``op``
    when ``rule`` is None: ``"linear"`` for ``"average"``, ``"none"`` for ``"adasum"`` (Horovod's
    Adasum guide: Adasum adapts the combined step itself, so on CPUs the single-process rate is
    used unscaled; Maleki et al. 2020).

    Raises:
        ValueError: an unknown rule, or ``"linear"`` with ``"adasum"`` (which would multiply a step
            Adasum already combines; use ``"none"``).
    """
    if rule is None:
        return "none" if op == "adasum" else "linear"
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALING_RULES)}; got {rule!r}")
    if op == "adasum" and rule == "linear":
        raise ValueError("op='adasum' adapts the step size itself; use lr_scaling='none' (the "
                         "default with adasum) or 'sqrt', not 'linear'")
    return rule


def scale_factor(rule: str, size: int, backward_passes_per_step: int = 1) -> float:
    """The factor by which ``rule`` multiplies the base learning rate.

    Args:
        rule: one of ``LR_SCALING_RULES``.
        size: number of processes (world size), >= 1.
        backward_passes_per_step: micro-batches accumulated per optimizer step, >= 1.

    Returns:
        The factor (dimensionless): ``size*k`` (linear), ``sqrt(size*k)`` (sqrt) or ``1.0`` (none).

    Raises:
        ValueError: unknown rule, or ``size``/``backward_passes_per_step`` below 1.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    n = size * backward_passes_per_step
    if rule == "linear":
        return float(n)
    if rule == "sqrt":
        return math.sqrt(n)
    if rule == "none":
        return 1.0
    raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALING_RULES)}; got {rule!r}")


def scaled_lr(base_lr: float, rule: str, size: int, backward_passes_per_step: int = 1) -> float:
    """``base_lr x scale_factor(rule, size, backward_passes_per_step)``; see :func:`scale_factor`."""
    return base_lr * scale_factor(rule, size, backward_passes_per_step)


def lr_at(step: int, *, base_lr: float, rule: str, size: int, backward_passes_per_step: int = 1,
          warmup_epochs: float = 0.0, steps_per_epoch: int = 1) -> float:
    """The learning rate to use for optimizer step ``step`` (0-based, counted across epochs).

    During warmup (``step < warmup_epochs x steps_per_epoch``) the rate moves linearly from
    ``base_lr`` at step 0 to the scaled rate at the end of warmup (Goyal et al. 2017, 2.2); after
    it, the rate is the scaled rate.

    Args:
        step: optimizer steps taken so far (0 for the first step).
        base_lr: the single-process learning rate.
        rule: ``"linear"``, ``"sqrt"`` or ``"none"``.
        size: world size.
        backward_passes_per_step: micro-batches per optimizer step.
        warmup_epochs: length of the warmup in epochs (may be fractional), >= 0.
        steps_per_epoch: optimizer steps in one epoch, >= 1.

    Returns:
        The learning rate for that step.

    Raises:
        ValueError: negative ``step`` or ``warmup_epochs``, ``steps_per_epoch`` < 1, or the
            errors of :func:`scale_factor`.
    """
    factor = scale_factor(rule, size, backward_passes_per_step)
    return base_lr * factor * warmup_multiplier(step, factor, warmup_epochs, steps_per_epoch)


def warmup_multiplier(step: int, factor: float, warmup_epochs: float, steps_per_epoch: int) -> float:
    """The fraction of the scaled learning rate to use at optimizer step ``step``.

    ``(1 + (factor - 1) * step / warmup_steps) / factor`` during warmup, so the rate climbs
    linearly from ``base_lr`` (multiplier ``1/factor``) to the scaled rate (multiplier 1) over
    ``warmup_steps = warmup_epochs x steps_per_epoch`` steps; 1 afterwards (Goyal et al. 2017,
    2.2). This is the multiplier a framework's lambda scheduler applies to the scaled rate.

    Args:
        step: optimizer steps taken so far (0-based), >= 0.
        factor: the scaling factor from :func:`scale_factor`, > 0.
        warmup_epochs: warmup length in epochs, >= 0.
        steps_per_epoch: optimizer steps per epoch, >= 1.

    Raises:
        ValueError: a negative ``step``/``warmup_epochs``, ``factor`` <= 0 or
            ``steps_per_epoch`` < 1.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    warmup_steps = warmup_epochs * steps_per_epoch
    if step >= warmup_steps:
        return 1.0
    return (1.0 + (factor - 1.0) * step / warmup_steps) / factor


def steps_per_epoch(micro_batches_per_epoch: int, backward_passes_per_step: int) -> int:
    """Optimizer steps per epoch when the last, partial group of micro-batches also steps.

    Args:
        micro_batches_per_epoch: local batches one rank sees per epoch, >= 1.
        backward_passes_per_step: micro-batches per optimizer step, >= 1.

    Returns:
        ``ceil(micro_batches_per_epoch / backward_passes_per_step)``.
    """
    if micro_batches_per_epoch < 1 or backward_passes_per_step < 1:
        raise ValueError("micro_batches_per_epoch and backward_passes_per_step must be >= 1, got "
                         f"{micro_batches_per_epoch} and {backward_passes_per_step}")
    return -(-micro_batches_per_epoch // backward_passes_per_step)
