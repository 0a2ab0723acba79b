"""The Keras callbacks a data-parallel ``fit`` needs (:func:`callbacks` returns them in order):
metric averaging over ranks, BatchNorm statistics kept equal, the report of skipped non-finite
steps, and the warmup."""
from __future__ import annotations

import logging

import keras
import numpy as np
from keras import ops

from hvdtrain import runtime, schedule
from hvdtrain.keras import collectives as B
from hvdtrain.keras.adapter import allreduce_sums, sync_buffers
from hvdtrain.keras.optimizer import NonFiniteGuard, schedule_of

log = logging.getLogger("hvdtrain")


class SyncBuffersCallback(keras.callbacks.Callback):
    """:func:`sync_buffers` on the model at the end of every epoch (before evaluation and
    checkpoints made by later callbacks), so all ranks hold the same BatchNormalization
    statistics."""

    def __init__(self, op: str = "average"):
        super().__init__()
        runtime.check_buffer_sync_op(op)
        self.op = op

    def on_epoch_end(self, epoch, logs=None):
        sync_buffers(self.model, self.op)


class WarmupCallback(keras.callbacks.Callback):
    """Sets the gradual warmup (Goyal et al. 2017) of a distributed optimizer's
    :class:`WarmupSchedule` when training begins: the rate rises linearly from the base lr to the
    scaled lr over ``warmup_epochs x steps_per_epoch`` optimizer steps, then stays there or
    follows ``decay`` (:class:`hvdtrain.schedule.Decay`: cosine or step). The schedule runs inside the training step; this callback reads nothing per batch. A resumed run
    continues the schedule (the step is the optimizer's). Calling :func:`warmup` again (a second
    ``fit`` phase) keeps the base and the scaling: both live in the schedule, not in the current
    rate."""

    def __init__(self, optimizer, warmup_epochs: float, steps_per_epoch: int,
                 decay: schedule.Decay | None = None):
        super().__init__()
        self.decay = decay
        self.schedule = schedule_of(optimizer)
        schedule.warmup_multiplier(0, self.schedule.factor, warmup_epochs, steps_per_epoch)
        self._optimizer = optimizer
        self.warmup_epochs, self.steps_per_epoch = float(warmup_epochs), int(steps_per_epoch)
        self._apply()

    def _apply(self) -> None:
        self.schedule.warmup_steps.assign(self.warmup_epochs * self.steps_per_epoch)
        self.schedule.set_decay(self.decay)

    def lr_at(self, step: int) -> float:
        """The learning rate for optimizer step ``step``."""
        return self.schedule.lr_at(step)

    def on_train_begin(self, logs=None):
        self._apply()


def warmup(optimizer, *, warmup_epochs: float, steps_per_epoch: int,
           decay: schedule.Decay | None = None) -> WarmupCallback:
    """A Keras callback that gives the distributed optimizer the schedule of
    :func:`hvdtrain.schedule.lr_at`: from the base lr to the scaled lr over ``warmup_epochs``,
    then ``decay`` (:func:`hvdtrain.schedule.decay`) or constant (see :class:`WarmupCallback`
    and :class:`~hvdtrain.keras.scheduler.WarmupSchedule`).

    Args:
        optimizer: the optimizer returned by :func:`distribute`.
        warmup_epochs: epochs of warmup, >= 0 (0: no warmup).
        steps_per_epoch: optimizer steps per epoch (micro-batches per epoch // k), >= 1.
        decay: the decay after warmup, in optimizer steps, or None (constant).

    Raises:
        ValueError: the optimizer did not come from :func:`distribute`, a negative
            ``warmup_epochs`` or ``steps_per_epoch`` < 1.
    """
    return WarmupCallback(optimizer, warmup_epochs, steps_per_epoch, decay)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every numeric value in the epoch's logs (``loss``, metrics, ``val_*``) by its mean
    over ranks, in one all-reduce, so ``History`` and later callbacks see global values (Horovod's
    ``MetricAverageCallback`` for Keras 3). Every rank must produce the same log keys."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or B.hvd.size() == 1:
            return
        numeric = {k: float(ops.convert_to_numpy(v)) for k, v in logs.items()
                   if np.size(ops.convert_to_numpy(v)) == 1}
        sums = allreduce_sums(numeric, name="hvdtrain.logs")
        logs.update({k: v / B.hvd.size() for k, v in sums.items()})


class _NonFiniteCallback(keras.callbacks.Callback):
    """Reports the steps a :class:`NonFiniteGuard` skipped: with ``mode="stop"`` after each batch
    (raising :class:`~hvdtrain.runtime.NonFiniteLossError` on every rank at the same batch), with
    ``"skip"`` once per epoch (no host synchronisation per batch)."""

    def __init__(self, guard: NonFiniteGuard):
        super().__init__()
        self.guard, self.seen, self.epoch = guard, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _check(self):
        skipped = int(ops.convert_to_numpy(self.guard.skipped))
        if skipped == self.seen:
            return
        self.seen = skipped
        bad = [r for r, v in enumerate(ops.convert_to_numpy(self.guard.bad_ranks)) if v > 0.5]
        message = runtime.nonfinite_message(bad, int(ops.convert_to_numpy(self.guard.bad_step)),
                                            self.epoch + 1)
        if self.guard.mode == "stop":
            raise runtime.nonfinite_stop(message)
        log.warning("%s: step skipped on all ranks", message)

    def on_train_batch_end(self, batch, logs=None):
        if self.guard.mode == "stop":
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()


def callbacks(optimizer, *, warmup_epochs: float = 0.0, steps_per_epoch: int = 1,
              decay: schedule.Decay | None = None) -> list:
    """The callbacks a data-parallel ``fit`` needs, in order: :class:`MetricAverageCallback`
    (epoch logs and History hold averages over all ranks), :class:`SyncBuffersCallback` (equal
    BatchNormalization statistics on every rank at each epoch's end), the report of skipped
    non-finite steps when :func:`distribute` installed a :class:`NonFiniteGuard`, and the warmup
    (:func:`warmup`, last). Put callbacks that evaluate or save after these. Calling it again
    (another ``fit`` phase) is safe: the scaled rate lives in the optimizer's schedule."""
    guard = getattr(optimizer, "hvdtrain_nonfinite", None)
    return [MetricAverageCallback(), SyncBuffersCallback(),
            *([_NonFiniteCallback(guard)] if guard is not None else []),
            warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch,
                   decay=decay)]
