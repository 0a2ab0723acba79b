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
import time
from pathlib import Path

import horovod
import keras
import numpy as np
from keras import ops

from hvdtrain import datasets, preempt, runtime
from hvdtrain.config import TrainConfig
from hvdtrain.files import CheckpointError
from hvdtrain.keras import collectives, adapter, checkpoint, sharding
from hvdtrain.keras.callbacks import callbacks as fit_callbacks
from hvdtrain.keras.trainer_callbacks import (SlowSteps, StepPoints, StopOnSignal, preempted_stop,
                                              record_counters, save_checkpoint)
from hvdtrain.keras.models import build_model
from hvdtrain.keras.optimizer import PreemptFlags
from hvdtrain.report import EpochMetrics, RunReport, run_header, setup_logging
from hvdtrain.tensorboard import StepMeter

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
        value = ops.cast(ops.stop_gradient(loss), "float64")
        finite = ops.isfinite(value)
        n = ops.cast(ops.shape(y_true)[0], "float64")
        self.loss_sum.assign(self.loss_sum + ops.where(finite, value * n, 0.0))
        self.samples.assign(self.samples + ops.where(finite, n, 0.0))
        hits = ops.sum(ops.cast(ops.equal(ops.cast(ops.argmax(y_pred, axis=-1), "int64"),
                                          ops.cast(ops.reshape(y_true, (-1,)), "int64")),
                                "float64"))
        self.correct.assign(self.correct + ops.where(finite, hits, 0.0))
        self.calls.assign(self.calls + 1)
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


def _resume(cfg: TrainConfig, info, model, optimizer) -> dict:
    """Load the checkpoint into the distributed ``model``/``optimizer`` on rank 0, broadcast them
    to every rank, and share the checkpoint's record.

    The learning rate is not in the checkpoint's optimizer variables (it is the distributed
    optimizer's schedule, made from this run's ``--lr`` and world size, which may differ from the
    checkpoint's).

    Raises:
        SystemExit: no usable checkpoint, or one made for another model (on every rank, so none
            waits for the others).
    """
    meta = None
    if info.is_root:
        out = Path(cfg.output_dir)
        try:
            if cfg.resume == "auto" and not any(
                    (out / f).exists() for f in (checkpoint.CHECKPOINT_FILE,
                                                 checkpoint.PREVIOUS_FILE)):
                raise FileNotFoundError
            payload = checkpoint.load(cfg.output_dir)
            weights = model.get_weights()
            if [w.shape for w in weights] != [np.shape(w) for w in payload["model"]]:
                raise ValueError("the checkpoint's weights do not fit this model (another "
                                 "--dataset or --batchnorm?)")
            model.set_weights(payload["model"])
            variables = optimizer.variables
            if len(payload["optimizer"]) != len(variables):
                raise ValueError(f"the checkpoint holds {len(payload['optimizer'])} optimizer "
                                 f"variables, this optimizer has {len(variables)} (another "
                                 "--backward-passes-per-step?)")
            for var, value in zip(variables, payload["optimizer"]):
                var.assign(value)
            record = payload["record"]
            runtime.set_python_numpy_rng_state(record["rng"])
            meta = {k: record[k] for k in ("epoch", "step", "size", "global_batch", "metrics")}
            meta["counters"] = record.get("counters", {})
            meta["config"] = record.get("config")
            meta["batch"] = record.get("batch") or 0
            meta["partial_per_rank"] = record.get("partial_per_rank")
        except FileNotFoundError:
            meta = {"fresh": True}
        except Exception as exc:  # any failure on rank 0 must reach the other ranks, not hang
            meta = {"error": f"{type(exc).__name__}: {exc}" if not isinstance(
                exc, (CheckpointError, ValueError)) else str(exc)}
    meta = collectives.broadcast_object(meta, root_rank=0, name="hvdtrain.resume")
    if "error" in meta:
        raise SystemExit(f"hvdtrain: error: --resume: {meta['error']}")
    if "fresh" in meta:
        log.info("--resume auto: no checkpoint in %s yet, starting fresh", cfg.output_dir)
        return None
    adapter.broadcast_state(model, optimizer)
    return meta


def load_nhwc(cfg: TrainConfig) -> tuple[datasets.Split, np.ndarray, np.ndarray]:
    """``cfg.dataset``'s split and its train/test images channels-last for Keras:
    ``(split, x_train (N, S, S, 1), x_test (M, S, S, 1))``."""
    split = datasets.load(cfg.dataset, test_fraction=cfg.test_fraction,
                      synthetic_samples=cfg.synthetic_samples, data_dir=cfg.data_dir or None)
    return split, split.x_train.transpose(0, 2, 3, 1), split.x_test.transpose(0, 2, 3, 1)


def evaluate(model: keras.Model, x: np.ndarray, y: np.ndarray, rank: int, size: int,
             batch_size: int = 256) -> tuple[float, float]:
    """Mean loss and accuracy over ``(x, y)`` (``(N, S, S, 1)``, ``(N,)``) on all ranks together:
    each rank scores an unpadded shard (cross-entropy of the logits in float64) and the sums are
    all-reduced. Same on every rank."""
    idx = datasets.shard_indices(len(x), rank, size)
    loss_sum, correct = 0.0, 0
    for start in range(0, len(idx), batch_size):
        chunk = idx[start:start + batch_size]
        logits = np.asarray(ops.convert_to_numpy(model(x[chunk], training=False)), np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss_sum += float(-log_probs[np.arange(len(chunk)), y[chunk]].sum())
        correct += int((np.argmax(logits, axis=1) == y[chunk]).sum())
    totals = adapter.allreduce_sums({"loss": loss_sum, "correct": correct, "n": len(idx)},
                                    name="hvdtrain.eval")
    return totals["loss"] / totals["n"], totals["correct"] / totals["n"]


class _EpochEnd(keras.callbacks.Callback):
    """After each epoch (logs already averaged over ranks): evaluate, checkpoint, report. An
    epoch resumed from a mid-epoch checkpoint starts from that checkpoint's sums, step count
    and time (``trainer_state["partial"]``); an epoch stopped by a signal is left to
    :func:`preempted_stop`."""

    def __init__(self, trainer_state: dict):
        super().__init__()
        self.s = trainer_state

    def _skipped(self) -> int:
        guard = self.s["guard"]
        return int(ops.convert_to_numpy(guard.skipped)) if guard is not None else 0

    def on_epoch_begin(self, epoch, logs=None):
        part = self.s.pop("partial", None)
        if part is not None:  # the rest of an epoch stopped by a signal
            self.s["loss"].reset(part["loss_sum"], part["correct"], part["samples"])
            self.start = time.perf_counter() - part["seconds"]
            self.steps, self.skipped, self.lr = part["iterations"], part["skipped"], part["lr"]
            return
        self.s["loss"].reset()
        self.start = time.perf_counter()
        self.steps = int(ops.convert_to_numpy(self.s["optimizer"].iterations))
        self.skipped = self._skipped()
        self.lr = self.s["warmup"].lr_at(self.steps)

    def partial(self) -> dict:
        """This rank's state of the unfinished epoch, for a mid-epoch checkpoint."""
        return {**self.s["loss"].totals(), "seconds": time.perf_counter() - self.start,
                "iterations": self.steps, "skipped": self.skipped, "lr": self.lr}

    def on_epoch_end(self, epoch, logs=None):
        s = self.s
        stopped = s["preemption"].stopped
        if stopped and stopped["batch"] < s["micro_per_epoch"]:
            return  # a mid-epoch stop: preempted_stop checkpoints it
        info, optimizer = s["info"], s["optimizer"]
        sums = s["loss"].totals()
        totals = adapter.allreduce_sums({"seconds": time.perf_counter() - self.start,
                                         "loss": sums["loss_sum"], "correct": sums["correct"],
                                         "n": sums["samples"]}, name="hvdtrain.train")
        seconds = totals["seconds"] / info.size  # mean wall time over ranks
        test_loss, test_acc = evaluate(self.model, s["x_test"], s["y_test"], info.rank, info.size)
        steps_now = int(ops.convert_to_numpy(optimizer.iterations))
        samples = s["micro_per_epoch"] * s["batch_size"] * info.size
        skipped = record_counters(s["report"], optimizer)
        steps = steps_now - self.steps
        if getattr(optimizer, "hvdtrain_loss_scale", None) is None:
            steps -= skipped - self.skipped  # a skipped step still advanced iterations (not fp16)
        n = max(totals["n"], 1.0)
        metrics = EpochMetrics(epoch + 1, totals["loss"] / n, totals["correct"] / n, test_loss,
                               test_acc, self.lr, steps, seconds, samples / seconds)
        # Before its checkpoint; rank 0 reports, then all stop together.
        s["report"].check_divergence(metrics, s["cfg"], s["num_classes"])
        save_checkpoint(s, epoch + 1, 0, None, s["report"].epochs + [metrics], self.model)
        s["report"].add(metrics)
        if stopped:  # stopped on the epoch's last step: the epoch is complete
            stopped.update(epoch=epoch + 1, batch=0)


def backend_version() -> str:
    """The version of the framework under the Keras backend in use."""
    if adapter.backend() == "torch":
        import torch
        return torch.__version__
    import tensorflow as tf
    return tf.__version__


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
    (:class:`~hvdtrain.keras.callbacks.SyncBuffersCallback`).

    Raises:
        runtime.NonFiniteLossError: a non-finite loss with ``on_nonfinite="stop"`` (every rank).
        guard.DivergenceError: the run diverged after warmup (:func:`hvdtrain.guard.divergence`;
            every rank, before that epoch's checkpoint), unless ``cfg.divergence_check`` is off.
        SystemExit: ``--resume`` without a usable checkpoint, or a ``--device`` this host cannot
            give every rank.

    Returns:
        The run report (the content of ``metrics.json``), on every rank.
    """
    try:
        info = adapter.init(cfg.seed, device=cfg.device)
    except ValueError as exc:
        raise SystemExit(f"hvdtrain: error: --device {cfg.device}: {exc}") from None
    setup_logging(info.rank)
    warning = runtime.slurm_hosts_warning(info.hosts)
    if warning and info.is_root:
        log.warning(warning)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(PRECISION_POLICIES[cfg.precision])
    try:
        return _fit(cfg, info)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def _fit(cfg: TrainConfig, info) -> dict:
    """:func:`fit` after ``init`` and the precision policy."""
    signals = preempt.Preemption().__enter__()  # a signal from here on stops after a step
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
    resumed = _resume(cfg, info, model, optimizer) if cfg.resume else None
    start_epoch = resumed["epoch"] if resumed else 0
    # A mid-epoch checkpoint (preemption) continues at its micro-batch at the same world size;
    # at another size the shards differ and the interrupted epoch restarts.
    start_micro = resumed["batch"] if resumed else 0
    # Another world size, or options that fix the data stream (-k, --batch-size, ...), change
    # what a micro-batch position means: the position is recomputed below.
    moved = resumed and preempt.mid_epoch_mismatch(resumed["config"], resumed["size"], cfg,
                                                   info.size)
    why = start_micro and moved
    if why:
        log.warning("the checkpoint was made %d micro-batches into epoch %d, but %s: that epoch "
                    "restarts", start_micro, start_epoch + 1, why)
        start_micro = 0
    # The data stream starts at this run's position, nothing is replayed. With the checkpoint's
    # world size and data options the restored optimizer counter is exact (fp16 skips and an
    # open accumulation group included); otherwise (another size, -k or --batch-size, or a
    # restarted epoch) the position is recomputed, as the PyTorch trainer does, and the group
    # starts empty.
    if moved:
        adapter.set_micro_batch_count(optimizer, start_epoch * micro_per_epoch, reset_groups=True)
    checkpoint.restore_counters(optimizer, resumed["counters"] if resumed else {})
    train_loss = TrainLoss(optimizer, k, info.rank, cfg.fault())
    train_loss.calls.assign(start_epoch * micro_per_epoch + start_micro)
    # No XLA: measured on 2-core CPU hosts, XLA made this CNN 0.39x as fast in plain Keras
    # (README, "jit_compile"); hvdtrain.keras.xla would keep the all-reduce outside it.
    model.compile(optimizer=optimizer, loss=train_loss, metrics=["accuracy"], jit_compile=False)
    out = Path(cfg.output_dir)
    header = run_header("keras", cfg, info, len(x_train), len(x_test), steps_per_epoch,
                        {"keras": keras.__version__, "keras_backend": adapter.backend(),
                         adapter.backend(): backend_version(),
                         "horovod": horovod.__version__})
    header["resumed_from"] = ({k2: resumed[k2] for k2 in ("epoch", "size", "global_batch")}
                              if resumed else None)
    if resumed:
        header["resumed_from"]["batch"] = start_micro
    report = RunReport(out, header, is_root=info.is_root, tensorboard=cfg.tensorboard,
                       broadcast_object=collectives.broadcast_object)
    record_counters(report, optimizer)  # a resumed run's counts so far
    if resumed:
        report.epochs = [EpochMetrics(**e) for e in resumed["metrics"]]
        log.info("resumed after epoch %d%s (made with %d ranks, global batch %d)",
                 resumed["epoch"], f" and {start_micro} micro-batches" if start_micro else "",
                 resumed["size"], resumed["global_batch"])
    callbacks = fit_callbacks(optimizer, warmup_epochs=cfg.warmup_epochs,
                              steps_per_epoch=steps_per_epoch)
    flags = optimizer.hvdtrain_allreduce.preempt = PreemptFlags()  # in the gradient all-reduce
    preemption = StopOnSignal(flags, k, signals)
    state = {"info": info, "x_test": x_test, "y_test": split.y_test, "out": out, "k": k,
             "batch_size": cfg.batch_size, "micro_per_epoch": micro_per_epoch,
             "report": report, "warmup": callbacks[-1], "preemption": preemption,
             "loss": train_loss, "cfg": cfg, "optimizer": optimizer,
             "guard": getattr(optimizer, "hvdtrain_nonfinite", None),
             "num_classes": split.num_classes}
    if start_micro:  # this rank's sums of the interrupted epoch
        state["partial"] = resumed["partial_per_rank"][info.rank]
    epoch_end = _EpochEnd(state)
    meter = StepMeter(report.board, cfg.log_every, cfg.global_batch(info.size),
                      cfg.batch_size * info.size)
    # (first epoch, end epoch, micro-batches per epoch, micro-batches of the first epoch done)
    phases = []
    if start_micro:  # the rest of the interrupted epoch, then the others
        phases.append((start_epoch, start_epoch + 1, micro_per_epoch - start_micro, start_micro))
    first = start_epoch + (1 if start_micro else 0)
    if first < cfg.epochs:
        phases.append((first, cfg.epochs, micro_per_epoch, 0))
    with signals, report.board, report.stops_on_nonfinite():
        for initial, end, steps, done in phases:
            dataset = sharding.shard_dataset(
                x_train, split.y_train, batch_size=cfg.batch_size, seed=cfg.seed, info=info,
                backward_passes_per_step=k, start_batch=initial * micro_per_epoch + done)
            preemption.offset = done
            points = StepPoints(meter, state, offset=done)
            slow = ([SlowSteps(cfg.slow_fault(), k, micro_per_epoch, done)]
                    if cfg.fault_slow_from else [])
            model.fit(dataset, initial_epoch=initial, epochs=end, steps_per_epoch=steps,
                      callbacks=[*callbacks, epoch_end, *slow, preemption, points],
                      verbose=1 if (info.is_root and cfg.progress) else 0)
            if preemption.stopped:
                preempted_stop(state, model, epoch_end, signals)
    # Every rank must hold the same weights; a divergence would be a bug worth knowing about.
    checksum = float(sum(np.asarray(w, dtype=np.float64).sum() for w in model.get_weights()))
    report.header["ranks_agree"] = len(set(collectives.allgather_object(checksum))) == 1
    if info.is_root:
        report.write()
    return report.to_dict()
