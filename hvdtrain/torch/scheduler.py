"""The PyTorch learning-rate warmup: :class:`Warmup`, the scheduler :func:`warmup` returns
(Goyal et al. 2017, gradual warmup on top of the rate :func:`hvdtrain.torch.distribute`
scaled) and the decay after it (:class:`hvdtrain.schedule.Decay`: cosine or step), or composed
with a scheduler of the user's instead. (Keras: :class:`hvdtrain.keras.WarmupSchedule` and
:func:`hvdtrain.keras.warmup`.)
"""
from __future__ import annotations

import torch

from hvdtrain import schedule


class Warmup:
    """Gradual warmup (Goyal et al. 2017, section 2.2) on top of the scaled learning rate,
    composed with an optional scheduler of the user's (cosine, step, OneCycle, ...).

    Each group's rate is ``scheduled x schedule.warmup_multiplier(step, factor, warmup_epochs,
    steps_per_epoch) x decay.multiplier(step)`` (the decay's factor is 1 without one), where ``scheduled`` is the rate the user's scheduler sets (or the scaled
    rate when there is none) and ``factor`` is the group's ``hvdtrain_lr_scale``: the rate climbs
    from the base rate to the scaled one over the warmup, then the user's schedule alone rules.
    Before each step of the user's scheduler the warmup factor is taken out again, so recursive
    schedulers (``StepLR``, ``CosineAnnealingLR``) see their own last rate. Without a user
    scheduler the rate equals :func:`hvdtrain.schedule.lr_at` at every step.

    The same interface as a ``torch.optim.lr_scheduler`` scheduler: call :meth:`step` after each
    ``optimizer.step()``; :meth:`get_last_lr`, :meth:`state_dict`, :meth:`load_state_dict`.

    Attributes:
        last_step: optimizer steps taken so far (0 before the first).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_epochs: float,
                 steps_per_epoch: int, decay: schedule.Decay | None = None, scheduler=None):
        if decay is not None and scheduler is not None:
            raise ValueError("give warmup() a decay or a scheduler of your own, not both")
        self.optimizer, self.scheduler, self.decay = optimizer, scheduler, decay
        self.warmup_epochs, self.steps_per_epoch = warmup_epochs, steps_per_epoch
        self.factors = []
        for group in optimizer.param_groups:
            if "hvdtrain_lr_scale" not in group:
                raise ValueError("warmup() needs the optimizer returned by "
                                 "hvdtrain.torch.distribute()")
            self.factors.append(group["hvdtrain_lr_scale"])
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not None:
            theirs = {id(g) for g in scheduler.optimizer.param_groups}
            if theirs != {id(g) for g in optimizer.param_groups}:
                raise ValueError("the scheduler drives other param groups than this optimizer's: "
                                 "build it on the optimizer that distribute() returned")
        schedule.warmup_multiplier(0, 1.0, warmup_epochs, steps_per_epoch)  # validates
        self.last_step = 0
        self._scheduled = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    def _apply(self) -> None:
        for group, rate, factor in zip(self.optimizer.param_groups, self._scheduled, self.factors):
            group["lr"] = rate * schedule.warmup_multiplier(
                self.last_step, factor, self.warmup_epochs, self.steps_per_epoch) * (
                self.decay.multiplier(self.last_step) if self.decay is not None else 1.0)

    def step(self) -> None:
        """Advance one optimizer step: the user's scheduler first (on the un-warmed rates), then
        the warmup factor for the new step."""
        for group, rate in zip(self.optimizer.param_groups, self._scheduled):
            group["lr"] = rate
        if self.scheduler is not None:
            self.scheduler.step()
        self._scheduled = [g["lr"] for g in self.optimizer.param_groups]
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The rates in use now, one per param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        """``last_step``, the un-warmed rates and the user's scheduler's own state."""
        return {"last_step": self.last_step, "scheduled": list(self._scheduled),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (or from ``{"last_step": n}`` alone, which keeps
        the current un-warmed rates: enough when there is no user scheduler)."""
        self.last_step = int(state["last_step"])
        if state.get("scheduled") is not None:
            self._scheduled = list(state["scheduled"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._apply()


def warmup(optimizer: torch.optim.Optimizer, *, warmup_epochs: float,
           steps_per_epoch: int, decay: schedule.Decay | None = None, scheduler=None) -> Warmup:
    """A :class:`Warmup`: from the base lr to the scaled lr over ``warmup_epochs`` (Goyal et al.
    2017, gradual warmup), then ``decay`` (:func:`hvdtrain.schedule.decay`: cosine or step) if
    given, or ``scheduler`` if given, else constant.

    Call ``.step()`` after each ``optimizer.step()`` (and not ``scheduler.step()`` as well: the
    warmup steps it). Works on an optimizer returned by :func:`distribute` (whose param groups
    hold the scaled lr and ``hvdtrain_lr_scale``).

    Args:
        optimizer: the optimizer returned by :func:`distribute`.
        warmup_epochs: epochs of warmup, >= 0 (0: no warmup).
        steps_per_epoch: optimizer steps per epoch (see ``schedule.steps_per_epoch``).
        decay: the decay after warmup, in optimizer steps; the rate at every step is then
            :func:`hvdtrain.schedule.lr_at` with it, also after ``load_state_dict``.
        scheduler: a ``torch.optim.lr_scheduler`` scheduler built on that optimizer after
            :func:`distribute` (so its rates start from the scaled lr), or None.

    Raises:
        ValueError: the optimizer did not come from :func:`distribute`, the scheduler drives
            another optimizer's groups, both ``decay`` and ``scheduler`` are given, or a bad
            ``warmup_epochs``/``steps_per_epoch``.
    """
    return Warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch,
                  decay=decay, scheduler=scheduler)
