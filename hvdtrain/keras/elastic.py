"""``hvdtrain train --framework keras --elastic``: Keras training that survives workers leaving and
joining, with Horovod Elastic's run loop (``hvd.elastic.run`` of ``horovod.tensorflow`` or ``horovod.torch``,
the Keras backend's) and :class:`KerasState` (Horovod's own ``KerasState`` is written for Keras 2
optimizers).
The same behaviour and launch as :mod:`hvdtrain.torch.elastic`::

    hvdtrain launch --elastic --min-np 1 --max-np 3 --host-discovery-script ./discover.sh \\
        -np 3 -- hvdtrain train --framework keras --elastic

Progress is committed every ``--commit-every`` optimizer steps and at each epoch's end: when a
worker fails, every survivor rolls back to the last commit (weights, optimizer slots, position in
the epoch, counters) and carries on. Each epoch visits a permutation of the training set fixed by
``(seed, epoch)``; the committed position says how many of its samples are done, and the rest is
split among the current workers (strided, padded to equal length like Horovod's
``ElasticSampler``), so committed work is neither repeated nor lost. The learning rate is
rescaled for the new world size at every reset (``schedule.scale_factor``).

A step whose all-reduced gradients are not finite is skipped on every worker
(:class:`~hvdtrain.keras.optimizer.NonFiniteGuard`), or stops the run (``--on-nonfinite``), and
the divergence check runs at each epoch's end, as in :func:`hvdtrain.keras.trainer.fit`; either
stop is recorded in ``metrics.json`` and ends the job (every worker exits 1, so Horovod Elastic
does not reset).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from pathlib import Path

import keras
import numpy as np
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError
from keras import ops

from hvdtrain import runtime, schedule
from hvdtrain.config import TrainConfig
from hvdtrain.keras import adapter, collectives
from hvdtrain.keras.optimizer import schedule_of
from hvdtrain.keras.models import build_model
from hvdtrain.keras.hooks import Hooks
from hvdtrain.keras.trainer import TrainLoss, load_nhwc
from hvdtrain.run.elastic import ElasticReport
from hvdtrain.run.report import run_header, setup_logging

log = logging.getLogger("hvdtrain")
hvd = collectives.hvd


# TensorFlow's error classes for a Horovod collective that failed because a worker left: in flight
# it fails with UnknownError carrying Gloo's text ("[.../gloo/transport/tcp/pair.cc:589] Read
# error ... [[{{node sgd/hvdtrain.gradients}}]]"), or with Horovod's "Horovod has been shut down"
# when it was enqueued after the background loop died (UnknownError, or AbortedError through
# Horovod 0.28's ConvertStatus). Which one a survivor sees depends on timing.
COLLECTIVE_FAILURES = ("UnknownError", "AbortedError")
# Words (lower case) in such a message: Horovod's own, Gloo's, or hvdtrain's op names.
COLLECTIVE_WORDS = ("horovod", "gloo", "hvdtrain.")


def _collective_failures(func):
    """Raise Horovod's ``HorovodInternalError`` for a collective that failed in TensorFlow (a
    worker left), so ``hvd.elastic.run`` rolls back and resets, whichever of
    :data:`COLLECTIVE_FAILURES` TensorFlow reports it as and whatever words it carries
    (:data:`COLLECTIVE_WORDS`). Any other ``UnknownError`` is raised as a ``RuntimeError``.

    Why: Horovod 0.28.1's TensorFlow ``elastic.run`` catches ``UnknownError`` and re-raises it
    only when the message names one of its default ops (``HorovodAllreduce`` ...); otherwise it
    returns None without raising, so the worker's training function "succeeds", the process
    exits 0 and the driver, seeing a success, ends the whole job. That is how a lost worker whose
    survivors saw Gloo's message (no "Horovod" in it, the op named ``hvdtrain.gradients``) ended
    the elastic job instead of shrinking it. (horovod.torch raises HorovodInternalError itself.)
    """
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            kind = type(exc).__name__
            if kind in COLLECTIVE_FAILURES and any(w in str(exc).lower() for w in COLLECTIVE_WORDS):
                raise HorovodInternalError(exc) from exc
            if kind == "UnknownError":  # never into Horovod's wrapper, which would swallow it
                raise RuntimeError(f"{kind}: {exc}") from exc
            raise
    return wrapper


class KerasState(ObjectState):
    """Horovod Elastic state for a Keras 3 model and optimizer plus plain Python values
    (``**kwargs``, exposed as attributes).

    ``commit()`` (``save``) copies the model's weights and the optimizer's variables to host
    memory; ``restore()`` puts the last copy back (after a worker failed); ``sync()`` (after
    every reset) broadcasts model, optimizer and the Python values from rank 0
    (:func:`hvdtrain.keras.broadcast_state`).
    """

    def __init__(self, model: keras.Model, optimizer, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._saved_weights = self._saved_optimizer = None
        super().__init__(bcast_object=collectives.broadcast_object, get_rank=hvd.rank, **kwargs)
        self._save_variables()

    def _save_variables(self) -> None:
        self._saved_weights = [np.array(w) for w in self.model.get_weights()]
        self._saved_optimizer = [np.array(ops.convert_to_numpy(v))
                                 for v in self.optimizer.variables]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        self.model.set_weights(self._saved_weights)
        for var, value in zip(self.optimizer.variables, self._saved_optimizer):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        adapter.broadcast_state(self.model, self.optimizer)
        self._save_variables()
        super().sync()


def epoch_shard(samples: int, done: int, seed: int, epoch: int, rank: int,
                size: int) -> np.ndarray:
    """This rank's sample indices for the rest of an epoch.

    The epoch's order is ``numpy.random.default_rng((seed, epoch)).permutation(samples)``; its
    first ``done`` entries are already trained on. The remainder is padded (by wrapping around)
    to a multiple of ``size`` and split strided: rank r takes entries ``r, r + size, ...``. So
    after s steps of local batch B the workers together have consumed exactly the first
    ``s x B x size`` entries of the remainder, whatever ``size`` is.

    Returns:
        int64 indices, ``ceil((samples - done) / size)`` of them (0 when the epoch is done).
    """
    remaining = np.random.default_rng((seed, epoch)).permutation(samples)[done:]
    if len(remaining) == 0:
        return remaining.astype(np.int64)
    padded = np.resize(remaining, math.ceil(len(remaining) / size) * size)
    return padded[rank::size].astype(np.int64)


def fit_elastic(cfg: TrainConfig) -> dict:
    """Train like :func:`hvdtrain.keras.trainer.fit`, elastically (k = 1, linear/sqrt/none LR
    scaling at the current size, no warmup; ``model.train_on_batch`` per step).

    ``metrics.json`` gains per epoch ``samples`` (training samples committed in that epoch, over
    all workers: the split's size, plus at most ``size - 1`` padding samples per reset) and
    ``sizes`` (the world sizes the epoch ran at); its epoch loss and accuracy leave out the
    batches whose loss was not finite, and ``skipped_steps`` counts the optimizer steps skipped.

    Returns:
        The run report, on every rank.

    Raises:
        runtime.NonFiniteLossError: a non-finite loss with ``cfg.on_nonfinite == "stop"`` (every
            rank, ``reported`` True: rank 0 printed it and recorded ``nonfinite_stop``).
        guard.DivergenceError: the run diverged (every rank, ``reported`` True; ``diverged``).
    """
    cfg = dataclasses.replace(cfg, warmup_epochs=0.0)  # recorded as run: no warmup
    info = adapter.init(cfg.seed, device="cpu")  # elastic runs on the CPU
    setup_logging(info.rank)
    split, x_train, x_test = load_nhwc(cfg)

    model = build_model(split.num_classes, x_train.shape[1], cfg.dropout, cfg.batchnorm)
    optimizer = keras.optimizers.SGD(learning_rate=cfg.lr, momentum=cfg.momentum)
    # No broadcast here: KerasState.sync broadcasts on every rank at the start and each reset.
    model, optimizer = adapter.distribute(model, optimizer, lr_scaling=cfg.lr_scaling,
                                          compression=cfg.compression, op=cfg.op,
                                          on_nonfinite=cfg.on_nonfinite, broadcast=False)
    nonfinite_guard = optimizer.hvdtrain_nonfinite
    lr_schedule = schedule_of(optimizer)
    train_loss = TrainLoss(optimizer, 1, info.rank, cfg.fault())
    slow = cfg.slow_fault()  # --fault-slow-from, parsed once (as the torch trainers do)
    model.compile(optimizer=optimizer, loss=train_loss, metrics=["accuracy"], jit_compile=False)
    out = Path(cfg.output_dir)

    # --lr-schedule over the run's committed samples (the steps per epoch change with the size).
    decay = cfg.decay(steps_per_epoch=len(x_train))

    def set_lr() -> None:
        done = state.epoch * len(x_train) + state.done
        lr_schedule.scale.assign(schedule.scale_factor(cfg.lr_scaling, hvd.size())
                                 * decay.multiplier(done))

    def current_lr() -> float:
        # The schedule's scale holds the world-size factor x the decay (set_lr): no warmup here.
        return cfg.lr * lr_schedule.factor

    # seen: samples whose loss was finite (the epoch's loss and accuracy are over these);
    # skipped, epoch_skipped: optimizer steps skipped for non-finite gradients (run, epoch);
    # started: the epoch's start, time.time() seconds (committed: seconds span resets).
    state = KerasState(model, optimizer, epoch=0, batch=0, done=0, samples=0, seen=0,
                       loss_sum=0.0, correct=0.0, skipped=0, epoch_skipped=0, sizes=[],
                       history=[], started=0.0)

    def on_reset() -> None:
        set_lr()
        log.warning("workers changed: now %d (lr %g)", hvd.size(), current_lr())

    state.register_reset_callbacks([on_reset])
    steps_per_epoch = math.ceil(len(x_train) / (cfg.batch_size * info.size))
    hooks = Hooks(model, optimizer, x_test, split.y_test)
    header = run_header("keras", cfg, info, len(x_train), len(x_test), steps_per_epoch,
                        hooks.versions())
    report = ElasticReport(out, header, state, cfg, hvd.size, lambda: hvd.rank() == 0,
                           collectives.broadcast_object)

    guard_skips = [0]  # the guard's count when last read (it is not rolled back by a reset)

    def check_nonfinite(loss_finite: bool) -> None:
        """After each step: the guard skipped it on every rank alike when the all-reduced
        gradients were not finite."""
        skips = int(ops.convert_to_numpy(nonfinite_guard.skipped))
        if skips == guard_skips[0]:
            return
        guard_skips[0] = skips
        # Every rank saw the same skip (the decision is on the all-reduced gradients): name the
        # bad ranks now, by their current numbers.
        report.skipped_step(adapter.ranks_where(not loss_finite, name="hvdtrain.nonfinite"),
                            int(ops.convert_to_numpy(nonfinite_guard.bad_step)))

    @hvd.elastic.run
    @_collective_failures
    def train(state) -> None:
        set_lr()
        # --fault-nan-at counts optimizer steps over the run, as in the other trainers: the
        # loss's own counter starts where the (synced or restored) optimizer is.
        train_loss.calls.assign(int(ops.convert_to_numpy(optimizer.iterations)))
        train_loss.rank.assign(hvd.rank())  # --fault-nan-at names a rank: the one it is now
        while state.epoch < cfg.epochs:
            if state.batch == 0:  # a fresh epoch; a reset into a committed mid-epoch state
                state.started = time.time()  # keeps its start (wall clock: any host)
            if hvd.size() not in state.sizes:
                state.sizes = state.sizes + [hvd.size()]
            mine = epoch_shard(len(x_train), state.done, cfg.seed, state.epoch, hvd.rank(),
                               hvd.size())
            for first in range(0, len(mine), cfg.batch_size):
                idx = mine[first:first + cfg.batch_size]
                if decay.kind != "constant":
                    set_lr()
                if slow:  # the run's optimizer steps so far (k is 1 here)
                    runtime.slow_step(slow, int(ops.convert_to_numpy(train_loss.calls)))
                loss, accuracy = model.train_on_batch(x_train[idx], split.y_train[idx])
                loss, accuracy = float(loss), float(accuracy)
                finite = math.isfinite(loss)
                check_nonfinite(finite)
                totals = adapter.allreduce_sums(
                    {"n": len(idx), "seen": len(idx) if finite else 0,
                     "loss": loss * len(idx) if finite else 0.0,
                     "correct": accuracy * len(idx) if finite else 0.0}, name="hvdtrain.elastic")
                state.samples += int(totals["n"])
                state.seen += int(totals["seen"])
                state.done = min(state.done + int(totals["n"]), len(x_train))
                state.loss_sum += totals["loss"]
                state.correct += totals["correct"]
                state.batch += 1
                if state.batch % cfg.commit_every == 0:
                    state.commit()
            report.end_epoch(hooks, current_lr(), split.num_classes)
            state.epoch += 1
            state.batch, state.done, state.samples, state.seen = 0, 0, 0, 0
            state.epoch_skipped = 0
            state.loss_sum, state.correct = 0.0, 0.0
            state.sizes = []
            state.commit()

    try:
        train(state)
    finally:
        report.close()
    return report.write()
