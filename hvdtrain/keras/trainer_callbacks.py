"""The Keras trainer's callbacks inside ``model.fit``: each epoch's bookkeeping handed to the run
written once (:class:`EpochEnd` -> :meth:`hvdtrain.run.training.Run.end_epoch`), the stop on a
preemption signal after an optimizer step (:class:`StopOnSignal`), the per-step TensorBoard
points (:class:`StepPoints`) and the ``--fault-slow-from`` drill (:class:`SlowSteps`). The
PyTorch trainer does the same in its own loop.
"""
from __future__ import annotations

import time

import keras
import numpy as np
from keras import ops

from hvdtrain import runtime
from hvdtrain.run import preempt
from hvdtrain.tensorboard import StepMeter


class StopOnSignal(keras.callbacks.Callback):
    """Stops ``fit`` on every rank after the same optimizer step once any rank got SIGTERM or
    SIGUSR1 (:mod:`hvdtrain.run.preempt`): a rank that saw a signal sets its
    :class:`~hvdtrain.keras.optimizer.PreemptFlags` before the next batch, the step's gradient
    all-reduce carries them, and after each optimizer step (every k-th batch) every rank reads
    the all-reduced flags, the same on every rank.

    Attributes:
        stopped: None, or ``{"signal", "epoch" (0-based), "batch"}`` (micro-batches of that
            epoch trained) once the ranks agreed to stop.
        offset: micro-batches of the current epoch trained before this ``fit`` call (a resumed
            mid-epoch run).
    """

    def __init__(self, flags, k: int, signals: preempt.Preemption):
        super().__init__()
        self.flags, self.k, self.signals = flags, k, signals
        self.pushed, self.stopped, self.offset, self.epoch = None, None, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.offset = 0

    def on_train_batch_begin(self, batch, logs=None):
        flags = self.signals.flags()  # pushed again when another signal came (TERM, then USR1)
        if self.signals.seen and flags != self.pushed:
            self.flags.requested.assign(np.asarray(flags, np.float32))
            self.pushed = flags

    def on_train_batch_end(self, batch, logs=None):
        if (self.offset + batch + 1) % self.k:
            return
        agreed = preempt.agreed_signal(ops.convert_to_numpy(self.flags.agreed).tolist())
        if agreed:
            self.stopped = {"signal": agreed, "epoch": self.epoch,
                            "batch": self.offset + batch + 1}
            self.model.stop_training = True


class StepPoints(keras.callbacks.Callback):
    """Rank 0's per-step TensorBoard points (:class:`~hvdtrain.tensorboard.StepMeter`) every
    ``--log-every`` optimizer steps (every k-th batch is an all-reduce and an optimizer step),
    from the training loss's running sums; nothing is read from the device between points.

    Args:
        meter: the step meter (idle on other ranks and without TensorBoard).
        loss: the trainer's :class:`~hvdtrain.keras.trainer.TrainLoss` (its running sums).
        warmup: the warmup callback (its ``lr_at(step)``).
        k: micro-batches per optimizer step; micro_per_epoch: micro-batches per epoch.
        offset: micro-batches of the first epoch trained before this ``fit`` (a resumed run).
    """

    def __init__(self, meter: StepMeter, loss, warmup, k: int, micro_per_epoch: int,
                 offset: int = 0):
        super().__init__()
        self.meter, self.loss, self.warmup, self.k = meter, loss, warmup, k
        self.micro_per_epoch, self.offset = micro_per_epoch, offset
        self.step = self.micro = 0

    def on_epoch_begin(self, epoch, logs=None):
        if not self.meter.board.enabled:
            return
        sums = self.loss.totals()  # after EpochEnd's reset: 0, or a resumed epoch's
        self.micro, self.offset = self.offset, 0
        k = self.k
        # Steps counted as all-reduce rounds, taken or skipped (fp16 overflows do not advance
        # optimizer.iterations), as the PyTorch trainer counts them.
        self.step = epoch * self.micro_per_epoch // k + self.micro // k
        self.meter.start(time.perf_counter(), sums["loss_sum"], sums["correct"],
                         sums["samples"], self.micro, self.micro // k)

    def on_train_batch_end(self, batch, logs=None):
        if not self.meter.board.enabled:
            return
        self.micro += 1
        k = self.k
        if self.micro % k:
            return
        self.step += 1
        if self.meter.due(self.step):
            sums = self.loss.totals()
            self.meter.point(self.step, time.perf_counter(), self.warmup.lr_at(self.step - 1),
                             sums["loss_sum"], sums["correct"], sums["samples"], self.micro,
                             self.micro // k)


class EpochEnd(keras.callbacks.Callback):
    """Each epoch's bookkeeping inside ``fit``: at its start, the training loss's sums (from 0,
    or from a mid-epoch checkpoint's ``partial``), the clock, the step counters and the
    learning rate; at its end (logs already averaged over ranks),
    :meth:`hvdtrain.run.training.Run.end_epoch` (evaluate, check, checkpoint, record). An epoch
    stopped by a signal before its end is left to
    :meth:`~hvdtrain.run.training.Run.preempted_stop`, with :meth:`partial`.

    Args:
        run: the :class:`~hvdtrain.run.training.Run`.
        loss: the trainer's :class:`~hvdtrain.keras.trainer.TrainLoss`.
        warmup: the warmup callback (its ``lr_at(step)``).
        preemption: the :class:`StopOnSignal` callback.
        micro_per_epoch: micro-batches per epoch (each ``--batch-size`` samples).
        partial: this rank's sums of a resumed epoch so far, or None.
    """

    def __init__(self, run, loss, warmup, preemption: StopOnSignal, micro_per_epoch: int,
                 partial: dict | None = None):
        super().__init__()
        self.run, self.loss, self.warmup, self.preemption = run, loss, warmup, preemption
        self.micro_per_epoch, self.resumed = micro_per_epoch, partial
        optimizer = run.hooks.optimizer
        self.optimizer = optimizer
        self.loss_scaled = getattr(optimizer, "hvdtrain_loss_scale", None) is not None

    def on_epoch_begin(self, epoch, logs=None):
        part, self.resumed = self.resumed, None
        if part is not None:  # the rest of an epoch stopped by a signal
            self.loss.reset(part["loss_sum"], part["correct"], part["samples"])
            self.start = time.perf_counter() - part["seconds"]
            self.steps, self.skipped, self.lr = part["iterations"], part["skipped"], part["lr"]
            return
        self.loss.reset()
        self.start = time.perf_counter()
        self.steps = int(ops.convert_to_numpy(self.optimizer.iterations))
        self.skipped = self.run.hooks.counters()["skipped"]
        self.lr = self.warmup.lr_at(self.steps)

    def partial(self) -> dict:
        """This rank's state of the unfinished epoch, for a mid-epoch checkpoint."""
        return {**self.loss.totals(), "seconds": time.perf_counter() - self.start,
                "iterations": self.steps, "skipped": self.skipped, "lr": self.lr}

    def on_epoch_end(self, epoch, logs=None):
        stopped = self.preemption.stopped
        if stopped and stopped["batch"] < self.micro_per_epoch:
            return  # a mid-epoch stop: Run.preempted_stop checkpoints it
        sums = self.loss.totals()
        iterations = int(ops.convert_to_numpy(self.optimizer.iterations))
        steps = iterations - self.steps
        if not self.loss_scaled:  # a skipped step still advanced iterations (not fp16)
            steps -= self.run.hooks.counters()["skipped"] - self.skipped
        self.run.end_epoch(epoch, {
            "loss": sums["loss_sum"], "correct": sums["correct"], "n": sums["samples"],
            "processed": self.micro_per_epoch * self.run.cfg.batch_size,
            "seconds": time.perf_counter() - self.start}, self.lr, steps, iterations)
        if stopped:  # stopped on the epoch's last step: the epoch is complete
            stopped.update(epoch=epoch + 1, batch=0)


class SlowSteps(keras.callbacks.Callback):
    """The ``--fault-slow-from STEP:SECONDS`` drill inside ``fit``: before the micro-batch that
    ends each optimizer step (the one whose gradients are all-reduced), from step STEP on, every
    rank sleeps SECONDS (:func:`hvdtrain.runtime.slow_step`).

    Args:
        slow: ``(step, seconds)`` from :meth:`hvdtrain.config.TrainConfig.slow_fault`.
        k: micro-batches per optimizer step.
        micro_per_epoch: micro-batches per epoch.
        offset: micro-batches of the first epoch trained before this ``fit`` call.
    """

    def __init__(self, slow: tuple[int, float], k: int, micro_per_epoch: int, offset: int):
        super().__init__()
        self.slow, self.k, self.micro_per_epoch, self.offset = slow, k, micro_per_epoch, offset
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.offset = 0

    def on_train_batch_begin(self, batch, logs=None):
        micro = self.epoch * self.micro_per_epoch + self.offset + batch
        if (micro + 1) % self.k == 0:
            runtime.slow_step(self.slow, micro // self.k)
