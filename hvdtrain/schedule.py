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
the rate rises linearly, step by step, from ``base_lr`` to the scaled rate.

Decay after warmup (:class:`Decay`, ``lr_schedule``), as a multiplier of the scaled rate:

* ``"constant"``: 1.
* ``"cosine"``: from 1 at the end of warmup down to ``min_ratio`` at the last step along half a
  cosine (Loshchilov & Hutter 2017, SGDR, without restarts; nanoGPT decays to lr/10, the default
  ``min_ratio`` 0.1).
* ``"step"``: ``gamma`` (0.1) more at each boundary (Goyal et al. 2017: /10 at epochs 30, 60 and
  80 of 90).

Everything is counted in optimizer steps, so a run resumed at another world size (another number
of steps per epoch) continues on the same curve over its epochs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

LR_SCALING_RULES = ("linear", "sqrt", "none")
LR_SCHEDULES = ("constant", "cosine", "step")
MAX_LR_STEPS = 8  # step boundaries a schedule takes (Keras holds them in a fixed-size variable)


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


@dataclass(frozen=True)
class Decay:
    """The learning rate's decay after warmup: :meth:`multiplier` of the scaled rate at each
    optimizer step (see the module docstring for the rules and their sources).

    Attributes:
        kind: one of :data:`LR_SCHEDULES`.
        total_steps: optimizer steps of the whole run (epochs x steps per epoch), >= 1.
        warmup_steps: optimizer steps of warmup; the decay starts where it ends, >= 0.
        min_ratio: cosine: the last step's rate as a fraction of the peak, in [0, 1].
        boundaries: step: the optimizer steps at which the rate drops, increasing.
        gamma: step: the factor at each boundary, in (0, 1].
    """
    kind: str = "constant"
    total_steps: int = 1
    warmup_steps: float = 0.0
    min_ratio: float = 0.1
    boundaries: tuple[float, ...] = ()
    gamma: float = 0.1

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got "
                             f"{self.kind!r}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"total_steps must be >= 1 and warmup_steps >= 0; got "
                             f"{self.total_steps} and {self.warmup_steps}")
        if not 0 <= self.min_ratio <= 1:
            raise ValueError(f"min_ratio must be in [0, 1]; got {self.min_ratio}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1]; got {self.gamma}")
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError(f"the step boundaries must increase; got {list(self.boundaries)}")

    def multiplier(self, step: float) -> float:
        """The fraction of the scaled rate at optimizer step ``step`` (0-based): 1 during
        warmup and for ``"constant"``; for ``"cosine"``, ``min_ratio + (1 - min_ratio) x (1 +
        cos(pi x p)) / 2`` with ``p`` the share of the steps after warmup done (``p = 1`` at the
        run's last step, ``total_steps - 1``); for ``"step"``, ``gamma`` to the number of
        boundaries passed (``step >= boundary``)."""
        if self.kind == "step":
            return self.gamma ** sum(step >= b for b in self.boundaries)
        if self.kind == "constant" or step < self.warmup_steps:
            return 1.0
        span = max(self.total_steps - 1 - self.warmup_steps, 1.0)
        p = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def decay(kind: str, *, epochs: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
          min_ratio: float = 0.1, step_epochs: tuple[float, ...] = (),
          gamma: float = 0.1) -> Decay:
    """A :class:`Decay` from epochs (what ``hvdtrain train`` takes) at this run's
    ``steps_per_epoch``.

    Args:
        kind: one of :data:`LR_SCHEDULES`.
        epochs: epochs of the run, >= 1; steps_per_epoch: optimizer steps per epoch, >= 1.
        warmup_epochs: epochs of warmup, >= 0 (the decay starts after it).
        min_ratio: cosine: the floor as a fraction of the peak.
        step_epochs: step: the epochs (may be fractional) at which the rate drops by ``gamma``
            (from the first whole optimizer step at or after each), at most
            :data:`MAX_LR_STEPS`.
        gamma: step: the factor at each drop.

    Raises:
        ValueError: bad values (named), or a step epoch outside ``(warmup_epochs, epochs)``.
    """
    if epochs < 1 or steps_per_epoch < 1:
        raise ValueError(f"epochs and steps_per_epoch must be >= 1; got {epochs} and "
                         f"{steps_per_epoch}")
    bad = [e for e in step_epochs if not warmup_epochs <= e < epochs]
    if bad:
        raise ValueError(f"--lr-steps epochs must lie in [{warmup_epochs:g}, {epochs}) (after "
                         f"warmup, before the end); got {', '.join(f'{e:g}' for e in bad)}")
    if len(step_epochs) > MAX_LR_STEPS:
        raise ValueError(f"at most {MAX_LR_STEPS} --lr-steps; got {len(step_epochs)}")
    # A drop takes effect at the first whole step at or after its epoch: whole numbers, so the
    # compiled Keras step (float32) and Python agree to the step.
    boundaries = tuple(float(math.ceil(round(e * steps_per_epoch, 6))) for e in step_epochs)
    return Decay(kind, epochs * steps_per_epoch, warmup_epochs * steps_per_epoch, min_ratio,
                 boundaries, gamma)


def lr_at(step: int, *, base_lr: float, rule: str, size: int, backward_passes_per_step: int = 1,
          warmup_epochs: float = 0.0, steps_per_epoch: int = 1,
          decay: Decay | None = None) -> float:
    """The learning rate to use for optimizer step ``step`` (0-based, counted across epochs).

    During warmup (``step < warmup_epochs x steps_per_epoch``) the rate moves linearly from
    ``base_lr`` at step 0 to the scaled rate at the end of warmup (Goyal et al. 2017, 2.2); after
    it, the rate is the scaled rate times ``decay``'s multiplier (constant when None).

    Args:
        step: optimizer steps taken so far (0 for the first step).
        base_lr: the single-process learning rate.
        rule: ``"linear"``, ``"sqrt"`` or ``"none"``.
        size: world size.
        backward_passes_per_step: micro-batches per optimizer step.
        warmup_epochs: length of the warmup in epochs (may be fractional), >= 0.
        steps_per_epoch: optimizer steps in one epoch, >= 1.
        decay: the decay after warmup (:class:`Decay`), or None.

    Returns:
        The learning rate for that step.

    Raises:
        ValueError: negative ``step`` or ``warmup_epochs``, ``steps_per_epoch`` < 1, or the
            errors of :func:`scale_factor`.
    """
    return scheduled_lr(step, base_lr, scale_factor(rule, size, backward_passes_per_step),
                        warmup_epochs, steps_per_epoch, decay)


def scheduled_lr(step: int, base_lr: float, factor: float, warmup_epochs: float = 0.0,
                 steps_per_epoch: int = 1, decay: Decay | None = None) -> float:
    """``base_lr x factor x warmup multiplier x decay multiplier`` at optimizer step ``step``:
    :func:`lr_at` for a scaling ``factor`` already known (:func:`scale_factor`; a Keras
    :class:`~hvdtrain.keras.scheduler.WarmupSchedule` keeps it in a variable).

    Raises:
        ValueError: the errors of :func:`warmup_multiplier`.
    """
    return (base_lr * factor * warmup_multiplier(step, factor, warmup_epochs, steps_per_epoch)
            * (decay.multiplier(step) if decay is not None else 1.0))


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
