"""``hvdtrain train --framework keras``: Keras 3 ``model.fit`` on top of
:mod:`hvdtrain.keras.adapter`, on the TensorFlow or the PyTorch backend (``--keras-backend`` or
``KERAS_BACKEND``).

Launch::

    horovodrun -np 2 hvdtrain train --framework keras --dataset digits
    horovodrun -np 2 hvdtrain train --framework keras --keras-backend torch --dataset digits
    mpirun -np 2 -bind-to none -map-by slot -x PATH hvdtrain train --framework keras
"""
from __future__ import annotations

import logging

import keras
import numpy as np
from keras import ops

from hvdtrain import datasets, progress
from hvdtrain.config import TrainConfig
from hvdtrain.keras import adapter, checkpoint, sharding
from hvdtrain.keras.callbacks import SyncBuffersCallback, callbacks as fit_callbacks
from hvdtrain.keras.hooks import Hooks
from hvdtrain.keras.models import build_model
from hvdtrain.keras.optimizer import PreemptFlags
from hvdtrain.keras.trainer_callbacks import EpochEnd, SlowSteps, StepPoints, StopOnSignal
from hvdtrain.run.training import Run, start

__all__ = ["fit", "TrainLoss", "load_nhwc"]

# --precision -> Keras mixed-precision policy (fp16 adds a LossScaleOptimizer).
PRECISION_POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
log = logging.getLogger("hvdtrain")


class TrainLoss:
    """The training loss (sparse categorical cross-entropy on logits; ``y_true`` ``(B,)``,
    ``y_pred`` ``(B, C)``, returns the batch mean), which also

    - adds each finite micro-batch's loss x batch size and correct predictions to ``loss_sum``,
      ``correct`` and ``samples`` (float64 variables), so the epoch's train loss and accuracy
      leave out skipped non-finite batches, like the PyTorch trainer's, and can be carried over
      a mid-epoch checkpoint; and
    - carries out ``--fault-nan-at RANK:STEP``: that rank's loss is NaN in optimizer step STEP,
      counted by this loss's own micro-batch counter ``calls`` // k (with fp16 a skipped step does
      not advance ``optimizer.iterations``, so the fault would otherwise repeat). The rank is the
      variable ``rank``: an elastic run assigns the current rank at each (re)start, since a
      worker's rank can change at a reset while the traced step stays.
    """

    def __init__(self, optimizer, k: int, rank: int, fault: tuple[int, int] | None):
        self.base = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.optimizer, self.k, self.fault = optimizer, k, fault
        self.rank = keras.Variable(rank, dtype="int64", trainable=False, name="loss_rank")
        self.calls = keras.Variable(0, dtype="int64", trainable=False, name="loss_calls")
        self.loss_sum = keras.Variable(0.0, dtype="float64", trainable=False, name="loss_sum")
        self.samples = keras.Variable(0.0, dtype="float64", trainable=False, name="samples")
        self.correct = keras.Variable(0.0, dtype="float64", trainable=False, name="correct")
        self.__name__ = "sparse_categorical_crossentropy"

    def __call__(self, y_true, y_pred):
        loss = self.base(y_true, y_pred)
        if self.fault is not None:
            hit = ops.logical_and(ops.equal(self.rank, self.fault[0]),
                                  ops.equal(ops.floor_divide(self.calls, self.k), self.fault[1]))
            # A factor, not where(hit, loss * nan, loss): that one's gradient is NaN always.
            loss = loss * ops.where(hit, float("nan"), 1.0)
        # Below, no tensor made from a Python number (the batch size, 0.0, 1): on Keras's
        # PyTorch backend each would be a copy to the device every micro-batch, on a GPU a host
        # synchronisation. Zeros and counts come from tensors; "+ 1" is native arithmetic.
        # (The fault above, on only with --fault-nan-at, still makes its numbers into tensors.)
        value = ops.cast(ops.stop_gradient(loss), "float64")
        finite = ops.isfinite(value)
        labels = ops.cast(ops.reshape(y_true, (-1,)), "int64")
        n = ops.sum(ops.ones_like(y_pred[:, 0], dtype="float64"))  # the batch size
        zero = ops.zeros_like(value)
        self.loss_sum.assign(self.loss_sum + ops.where(finite, value * n, zero))
        self.samples.assign(self.samples + ops.where(finite, n, zero))
        hits = ops.sum(ops.cast(ops.equal(ops.cast(ops.argmax(y_pred, axis=-1), "int64"),
                                          labels), "float64"))
        self.correct.assign(self.correct + ops.where(finite, hits, zero))
        self.calls.assign(ops.convert_to_tensor(self.calls) + 1)
        return loss

    def reset(self, loss_sum: float = 0.0, correct: float = 0.0, samples: float = 0.0) -> None:
        """Start the epoch's sums (at 0, or where a mid-epoch checkpoint left them)."""
        self.loss_sum.assign(loss_sum)
        self.correct.assign(correct)
        self.samples.assign(samples)

    def totals(self) -> dict:
        """``{"loss_sum", "correct", "samples"}`` of this rank since :meth:`reset`."""
        return {name: float(ops.convert_to_numpy(getattr(self, name)))
                for name in ("loss_sum", "correct", "samples")}


def load_nhwc(cfg: TrainConfig) -> tuple[datasets.Split, np.ndarray, np.ndarray]:
    """``cfg.dataset``'s split and its train/test images channels-last for Keras:
    ``(split, x_train (N, S, S, 1), x_test (M, S, S, 1))``."""
    split = datasets.load(cfg.dataset, test_fraction=cfg.test_fraction,
                      synthetic_samples=cfg.synthetic_samples, data_dir=cfg.data_dir or None)
    return split, split.x_train.transpose(0, 2, 3, 1), split.x_test.transpose(0, 2, 3, 1)


def fit(cfg: TrainConfig) -> dict:
    """Train :func:`build_model` on ``cfg.dataset`` with ``cfg``'s options on every rank.

    An epoch is :func:`~hvdtrain.keras.sharding.micro_batches_per_epoch` micro-batches of a repeated, per-epoch
    reshuffled shard (a whole number of optimizer steps). Rank 0 logs, shows Keras's progress bar,
    and writes ``checkpoint.npz`` (keeping the previous one as ``checkpoint.prev.npz``),
    ``checkpoint.weights.h5`` and ``metrics.json`` (the same schema as the PyTorch trainer) after
    every epoch, atomically. With ``cfg.resume`` it continues from ``checkpoint.npz``: weights,
    optimizer slots, step, and the position in the data stream (exact at the same world size). A
    NaN/Inf loss on any rank skips that optimizer step on every rank, or stops the job
    (``cfg.on_nonfinite``; :class:`~hvdtrain.keras.optimizer.NonFiniteGuard`).

    Each rank sees only its own GPU (``cfg.device``, :func:`hvdtrain.keras.init`), or none.
    ``--precision bf16`` trains under Keras's ``mixed_bfloat16`` policy (layers compute in
    bfloat16, variables and the logits stay float32). BatchNormalization statistics are averaged
    over ranks at each epoch's end, before evaluation and the checkpoint
    (:meth:`hvdtrain.run.training.Run.end_epoch`).

    Raises:
        runtime.NonFiniteLossError: a non-finite loss with ``on_nonfinite="stop"`` (every rank).
        guard.DivergenceError: the run diverged after warmup (:func:`hvdtrain.guard.divergence`;
            every rank, before that epoch's checkpoint), unless ``cfg.divergence_check`` is off.
        SystemExit: ``--resume`` without a usable checkpoint, or a ``--device`` this host cannot
            give every rank.

    Returns:
        The run report (the content of ``metrics.json``), on every rank.
    """
    info, signals = start(cfg, adapter.init)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(PRECISION_POLICIES[cfg.precision])
    try:
        return _fit(cfg, info, signals)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def _fit(cfg: TrainConfig, info, signals) -> dict:
    """:func:`fit` after ``init`` and the precision policy."""
    split, x_train, x_test = load_nhwc(cfg)
    k = cfg.backward_passes_per_step
    micro_per_epoch = sharding.micro_batches_per_epoch(len(x_train), cfg.batch_size, info.size, k)
    steps_per_epoch = micro_per_epoch // k

    model = build_model(split.num_classes, x_train.shape[1], cfg.dropout, cfg.batchnorm)
    optimizer = keras.optimizers.SGD(learning_rate=cfg.lr, momentum=cfg.momentum)
    if cfg.precision == "fp16":  # a dynamic loss scale, kept equal on all ranks by distribute
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer,
                                                        initial_scale=cfg.init_loss_scale)
    model, optimizer = adapter.distribute(model, optimizer, backward_passes_per_step=k,
                                          lr_scaling=cfg.lr_scaling, compression=cfg.compression,
                                          op=cfg.op, on_nonfinite=cfg.on_nonfinite)
    hooks = Hooks(model, optimizer, x_test, split.y_test)
    run = Run(cfg, info, signals, hooks, split.num_classes)
    resumed = run.resume()  # rank 0 loads into the distributed model; broadcast below
    if resumed:
        if resumed.get("restart_loss_scale"):  # another --init-loss-scale (fp16)
            checkpoint.restart_loss_scale(optimizer, cfg.init_loss_scale)
        adapter.broadcast_state(model, optimizer)
    at = run.position(resumed)  # a moved mid-epoch position got its RNG back there
    if at.batch:  # Keras's data order is a function of the position: no iterator to wait for
        run.restore_rng(resumed)
    # The data stream starts at this run's position, nothing is replayed. With the checkpoint's
    # world size and data options the restored optimizer counter is exact (fp16 skips and an
    # open accumulation group included); otherwise (another size, -k or --batch-size, or a
    # restarted epoch) the position is recomputed, as the PyTorch trainer does, and the group
    # starts empty.
    if at.moved:
        adapter.set_micro_batch_count(optimizer, at.epoch * micro_per_epoch, reset_groups=True)
    train_loss = TrainLoss(optimizer, k, info.rank, cfg.fault())
    train_loss.calls.assign(at.epoch * micro_per_epoch + at.batch)
    # No XLA: measured on 2-core CPU hosts, XLA made this CNN 0.39x as fast in plain Keras
    # (README, "jit_compile"); hvdtrain.keras.xla would keep the all-reduce outside it.
    model.compile(optimizer=optimizer, loss=train_loss, metrics=["accuracy"], jit_compile=False)
    run.open(len(x_train), len(x_test), steps_per_epoch, resumed, at)
    # The run averages the buffers at each epoch's end itself (hvdtrain.run.training).
    callbacks = [c for c in fit_callbacks(optimizer, warmup_epochs=cfg.warmup_epochs,
                                          steps_per_epoch=steps_per_epoch,
                                          decay=cfg.decay(steps_per_epoch))
                 if not isinstance(c, SyncBuffersCallback)]
    warmup = callbacks[-1]
    flags = optimizer.hvdtrain_allreduce.preempt = PreemptFlags()  # in the gradient all-reduce
    preemption = StopOnSignal(flags, k, signals)
    epoch_end = EpochEnd(run, train_loss, warmup, preemption, micro_per_epoch,
                         at.partial if at.batch else None)
    # (first epoch, end epoch, micro-batches per epoch, micro-batches of the first epoch done)
    phases = []
    if at.batch:  # the rest of the interrupted epoch, then the others
        phases.append((at.epoch, at.epoch + 1, micro_per_epoch - at.batch, at.batch))
    first = at.epoch + (1 if at.batch else 0)
    if first < cfg.epochs:
        phases.append((first, cfg.epochs, micro_per_epoch, 0))
    with run.training():
        for initial, end, steps, done in phases:
            dataset = sharding.shard_dataset(
                x_train, split.y_train, batch_size=cfg.batch_size, seed=cfg.seed, info=info,
                backward_passes_per_step=k, start_batch=initial * micro_per_epoch + done)
            preemption.offset = done
            points = StepPoints(run.meter, train_loss, warmup, k, micro_per_epoch, offset=done)
            slow = ([SlowSteps(cfg.slow_fault(), k, micro_per_epoch, done)]
                    if cfg.fault_slow_from else [])
            model.fit(dataset, initial_epoch=initial, epochs=end, steps_per_epoch=steps,
                      callbacks=[*callbacks, epoch_end, *slow, preemption, points,
                                 *progress.keras_callbacks(info.is_root and cfg.progress, steps,
                                                           cfg.epochs, done)],
                      verbose=progress.keras_verbose(info.is_root and cfg.progress))
            stopped = preemption.stopped
            if stopped:
                run.preempted_stop(stopped["signal"], stopped["epoch"], stopped["batch"],
                                   int(ops.convert_to_numpy(optimizer.iterations)),
                                   epoch_end.partial())
    return run.finish()
