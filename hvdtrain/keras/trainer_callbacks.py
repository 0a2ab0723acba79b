"""The Keras trainer's callbacks inside ``model.fit`` other than its epoch end (``_EpochEnd`` in
:mod:`hvdtrain.keras.trainer`, beside the ``evaluate`` it calls): the stop on a preemption signal
with the mid-epoch checkpoint it leaves, the per-step TensorBoard points, and the checkpoint write
that both the epoch end and a preemption make. The PyTorch trainer does the same inline in its
loop.
"""
from __future__ import annotations

import time

import keras
import numpy as np
from keras import ops

from hvdtrain import preempt, runtime
from hvdtrain.keras import collectives, adapter, checkpoint
from hvdtrain.report import stop_together
from hvdtrain.tensorboard import StepMeter


def save_checkpoint(s: dict, epoch_done: int, batch: int, partial_per_rank: list | None, epochs: list,
          model) -> None:
    """Rank 0 writes the checkpoint (``checkpoint.npz`` and ``checkpoint.weights.h5``)."""
    info, optimizer = s["info"], s["optimizer"]
    if not info.is_root:
        return
    checkpoint.save(s["out"], model.get_weights(),
                    [ops.convert_to_numpy(v) for v in optimizer.variables],
                    {"epoch": epoch_done, "batch": batch, "partial_per_rank": partial_per_rank,
                     "step": int(ops.convert_to_numpy(optimizer.iterations)),
                     "size": info.size, "global_batch": s["cfg"].global_batch(info.size),
                     "config": s["cfg"].to_dict(), "rng": runtime.python_numpy_rng_state(),
                     "counters": checkpoint.counters(optimizer),
                     "metrics": [vars(e) for e in epochs]})
    checkpoint.save_weights(s["out"] / checkpoint.WEIGHTS_FILE, model)


def record_counters(report, optimizer) -> int:
    """Put the run's optimizer steps skipped for a non-finite loss (``skipped_steps``) and, with
    fp16, for overflowing gradients (``overflow_steps``) into ``report.header`` (kept current,
    so a run stopped mid-epoch records them too). Returns ``skipped_steps``."""
    guard = getattr(optimizer, "hvdtrain_nonfinite", None)
    skipped = int(ops.convert_to_numpy(guard.skipped)) if guard is not None else 0
    report.header["skipped_steps"] = skipped
    scaler = getattr(optimizer, "hvdtrain_loss_scale", None)
    if scaler is not None:
        report.header["overflow_steps"] = int(ops.convert_to_numpy(scaler.overflows))
    return skipped


class StopOnSignal(keras.callbacks.Callback):
    """Stops ``fit`` on every rank after the same optimizer step once any rank got SIGTERM or
    SIGUSR1 (:mod:`hvdtrain.preempt`): a rank that saw a signal sets its
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
        trainer_state: the trainer's state dict (``loss``, ``optimizer``, ``warmup``, ``k``).
        offset: micro-batches of the first epoch trained before this ``fit`` (a resumed run).
    """

    def __init__(self, meter: StepMeter, trainer_state: dict, offset: int = 0):
        super().__init__()
        self.meter, self.s, self.offset = meter, trainer_state, offset
        self.step = self.micro = 0

    def on_epoch_begin(self, epoch, logs=None):
        if not self.meter.board.enabled:
            return
        sums = self.s["loss"].totals()  # after _EpochEnd's reset: 0, or a resumed epoch's
        self.micro, self.offset = self.offset, 0
        k = self.s["k"]
        # Steps counted as all-reduce rounds, taken or skipped (fp16 overflows do not advance
        # optimizer.iterations), as the PyTorch trainer counts them.
        self.step = epoch * self.s["micro_per_epoch"] // k + self.micro // k
        self.meter.start(time.perf_counter(), sums["loss_sum"], sums["correct"],
                         sums["samples"], self.micro, self.micro // k)

    def on_train_batch_end(self, batch, logs=None):
        if not self.meter.board.enabled:
            return
        self.micro += 1
        k = self.s["k"]
        if self.micro % k:
            return
        self.step += 1
        if self.meter.due(self.step):
            sums = self.s["loss"].totals()
            self.meter.point(self.step, time.perf_counter(), self.s["warmup"].lr_at(self.step - 1),
                             sums["loss_sum"], sums["correct"], sums["samples"], self.micro,
                             self.micro // k)


def preempted_stop(s: dict, model, epoch_end, signals: preempt.Preemption) -> None:
    """After ``fit`` stopped on a signal, on every rank: gather each rank's share of the
    unfinished epoch, let rank 0 write the mid-epoch checkpoint (the others wait for it), record
    the stop in ``metrics.json``, requeue under Slurm, and raise
    :class:`~hvdtrain.preempt.Preempted`."""
    info, cfg, stopped = s["info"], s["cfg"], s["preemption"].stopped
    record_counters(s["report"], s["optimizer"])
    adapter.sync_buffers(model)  # the saved model's BatchNorm statistics: averaged over ranks
    per_rank = collectives.allgather_object(epoch_end.partial(), name="hvdtrain.preempt")
    save_checkpoint(s, stopped["epoch"], stopped["batch"], per_rank if stopped["batch"] else None,
          s["report"].epochs, model)
    waited = collectives.allgather_object(signals.seconds_since_signal(),
                                       name="hvdtrain.preempt.saved")
    seconds = max((w for w in waited if w is not None), default=None)
    step = int(ops.convert_to_numpy(s["optimizer"].iterations))
    preempt.record_stop(s["report"], stopped["signal"], stopped["epoch"] + 1, stopped["batch"],
                        step, seconds, cfg.requeue, info.is_root)
    # The other ranks wait for rank 0's report and requeue: launchers end the whole job when the
    # first rank exits.
    stop_together(collectives.broadcast_object, "preempt.done")
    raise preempt.Preempted(stopped["signal"], seconds)


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
