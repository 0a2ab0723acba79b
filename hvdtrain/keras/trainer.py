"""``hvdtrain train --framework keras``: ``model.fit`` on top of :mod:`hvdtrain.keras.adapter`.

Launch::

    horovodrun -np 2 hvdtrain train --framework keras --dataset digits
    mpirun -np 2 -bind-to none -map-by slot -x PATH hvdtrain train --framework keras
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import horovod
import horovod.tensorflow as hvd_tf
import numpy as np
import tensorflow as tf

from hvdtrain import data
from hvdtrain.config import TrainConfig
from hvdtrain.files import atomic_path
from hvdtrain.keras import adapter
from hvdtrain.keras.models import build_model
from hvdtrain.report import EpochMetrics, RunReport, run_header, setup_logging

CHECKPOINT_FILE = "checkpoint.weights.h5"
log = logging.getLogger("hvdtrain")


def save_checkpoint(path: str | Path, model: tf.keras.Model) -> None:
    """Write the model's weights (HDF5) atomically: temp file, fsync, rename. Rank 0 only."""
    # The temporary name keeps the ".weights.h5" ending: Keras picks the file format from it.
    with atomic_path(path, suffix=".weights.h5") as tmp:
        model.save_weights(str(tmp))


def evaluate(model: tf.keras.Model, x: np.ndarray, y: np.ndarray, rank: int, size: int,
             batch_size: int = 256) -> tuple[float, float]:
    """Mean loss and accuracy over ``(x, y)`` (``(N, S, S, 1)``, ``(N,)``) on all ranks together:
    each rank scores an unpadded shard and the sums are all-reduced. Same on every rank."""
    idx = data.shard_indices(len(x), rank, size)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    loss_sum, correct = 0.0, 0
    for start in range(0, len(idx), batch_size):
        chunk = idx[start:start + batch_size]
        logits = model(x[chunk], training=False)
        loss_sum += float(loss_fn(y[chunk], logits))
        correct += int((np.argmax(logits, axis=1) == y[chunk]).sum())
    totals = adapter.allreduce_sums({"loss": loss_sum, "correct": correct, "n": len(idx)},
                                    name="hvdtrain.eval")
    return totals["loss"] / totals["n"], totals["correct"] / totals["n"]


class _EpochEnd(tf.keras.callbacks.Callback):
    """After each epoch (logs already averaged over ranks): evaluate, checkpoint, report."""

    def __init__(self, trainer_state: dict):
        super().__init__()
        self.s = trainer_state

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()
        self.iterations = int(self.model.optimizer.iterations.numpy())
        self.lr = self.s["warmup"].lr_at(self.iterations // self.s["k"])

    def on_epoch_end(self, epoch, logs=None):
        s = self.s
        seconds = time.perf_counter() - self.start
        seconds = adapter.allreduce_sums({"seconds": seconds}, name="hvdtrain.time")["seconds"]
        seconds /= s["info"].size
        test_loss, test_acc = evaluate(self.model, s["x_test"], s["y_test"], s["info"].rank,
                                       s["info"].size)
        micro = int(self.model.optimizer.iterations.numpy()) - self.iterations
        samples = micro * s["batch_size"] * s["info"].size
        if s["info"].is_root:
            save_checkpoint(s["out"] / CHECKPOINT_FILE, self.model)
        s["report"].add(EpochMetrics(epoch + 1, float(logs["loss"]), float(logs["accuracy"]),
                                     test_loss, test_acc, self.lr, micro // s["k"], seconds,
                                     samples / seconds))


def fit(cfg: TrainConfig) -> dict:
    """Train :func:`build_model` on ``cfg.dataset`` with ``cfg``'s options on every rank.

    An epoch is :func:`adapter.micro_batches_per_epoch` micro-batches of a repeated, per-epoch
    reshuffled shard (a whole number of optimizer steps). Rank 0 logs, shows Keras's progress bar,
    and writes ``checkpoint.weights.h5`` and ``metrics.json`` (the same schema as the PyTorch
    trainer) after every epoch, atomically.

    Returns:
        The run report (the content of ``metrics.json``), on every rank.
    """
    info = adapter.init(cfg.seed)
    setup_logging(info.rank)
    split = data.load(cfg.dataset, test_fraction=cfg.test_fraction,
                      synthetic_samples=cfg.synthetic_samples)
    x_train = split.x_train.transpose(0, 2, 3, 1)  # NCHW -> NHWC
    x_test = split.x_test.transpose(0, 2, 3, 1)
    k = cfg.backward_passes_per_step
    micro_per_epoch = adapter.micro_batches_per_epoch(len(x_train), cfg.batch_size, info.size, k)
    steps_per_epoch = micro_per_epoch // k
    dataset = adapter.shard_dataset(x_train, split.y_train, batch_size=cfg.batch_size,
                                    seed=cfg.seed, info=info)

    model = build_model(split.num_classes, x_train.shape[1])
    optimizer = tf.keras.optimizers.SGD(learning_rate=cfg.lr, momentum=cfg.momentum)
    model, optimizer = adapter.distribute(model, optimizer, backward_passes_per_step=k,
                                          lr_scaling=cfg.lr_scaling, compression=cfg.compression,
                                          op=cfg.op)
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    out = Path(cfg.output_dir)
    header = run_header("keras", cfg, info, len(x_train), len(x_test), steps_per_epoch,
                        {"tensorflow": tf.__version__, "horovod": horovod.__version__})
    report = RunReport(out, header, is_root=info.is_root)
    callbacks = adapter.callbacks(optimizer, warmup_epochs=cfg.warmup_epochs,
                                  steps_per_epoch=steps_per_epoch)
    state = {"info": info, "x_test": x_test, "y_test": split.y_test, "out": out, "k": k,
             "batch_size": cfg.batch_size, "report": report, "warmup": callbacks[-1]}
    model.fit(dataset, epochs=cfg.epochs, steps_per_epoch=micro_per_epoch,
              callbacks=[*callbacks, _EpochEnd(state)],
              verbose=1 if (info.is_root and cfg.progress) else 0)
    # Every rank must hold the same weights; a divergence would be a bug worth knowing about.
    checksum = float(sum(np.asarray(w, dtype=np.float64).sum() for w in model.get_weights()))
    report.header["ranks_agree"] = len(set(hvd_tf.allgather_object(checksum))) == 1
    if info.is_root:
        report.write()
    return report.to_dict()
