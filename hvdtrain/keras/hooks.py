"""Keras's side of the training run (:class:`hvdtrain.run.hooks.Hooks`), on either backend:
Horovod's collectives through :mod:`hvdtrain.keras.collectives`, the model's evaluation,
buffers, checkpoint and RNG states. The PyTorch mirror is :mod:`hvdtrain.torch.hooks`.
"""
from __future__ import annotations

from pathlib import Path

import horovod
import keras
import numpy as np
from keras import ops

from hvdtrain import datasets, runtime
from hvdtrain.keras import adapter, checkpoint, collectives


def backend_version() -> str:
    """The version of the framework under the Keras backend in use."""
    if adapter.backend() == "torch":
        import torch
        return torch.__version__
    import tensorflow as tf
    return tf.__version__


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


class Hooks:
    """The run's Keras operations on one distributed model and optimizer.

    Args:
        model: the model (``(B, S, S, 1)`` images -> ``(B, classes)`` logits).
        optimizer: its optimizer after :func:`~hvdtrain.keras.adapter.distribute` (the state is
            loaded into it on rank 0 and then broadcast by the trainer).
        x_test, y_test: the test split, ``(N, S, S, 1)`` and ``(N,)``.
    """

    framework = "keras"
    checkpoint_files = (checkpoint.CHECKPOINT_FILE, checkpoint.PREVIOUS_FILE)

    def __init__(self, model: keras.Model, optimizer, x_test: np.ndarray, y_test: np.ndarray):
        self.model, self.optimizer, self.x_test, self.y_test = model, optimizer, x_test, y_test

    def versions(self) -> dict[str, str]:
        return {"keras": keras.__version__, "keras_backend": adapter.backend(),
                adapter.backend(): backend_version(), "horovod": horovod.__version__}

    def broadcast_object(self, obj, root_rank: int = 0, name: str | None = None):
        return collectives.broadcast_object(obj, root_rank=root_rank, name=name)

    def allgather_object(self, obj, name: str | None = None) -> list:
        return collectives.allgather_object(obj, name=name)

    def allreduce_sums(self, sums: dict[str, float], name: str) -> dict[str, float]:
        return adapter.allreduce_sums(sums, name=name)

    def sync_buffers(self) -> None:
        adapter.sync_buffers(self.model)

    def evaluate(self) -> tuple[float, float]:
        # The current rank and size (an elastic run's change at a reset).
        return evaluate(self.model, self.x_test, self.y_test, collectives.hvd.rank(),
                        collectives.hvd.size())

    def rng_state(self) -> dict:
        return runtime.python_numpy_rng_state()

    def set_rng_state(self, state: dict) -> None:
        runtime.set_python_numpy_rng_state(state)

    def counters(self) -> dict[str, int]:
        return checkpoint.counters(self.optimizer)

    def restore_counters(self, counters: dict) -> None:
        checkpoint.restore_counters(self.optimizer, counters)

    def save(self, output_dir: Path, record: dict) -> None:
        checkpoint.save(output_dir, self.model.get_weights(),
                        [ops.convert_to_numpy(v) for v in self.optimizer.variables], record,
                        checkpoint.optimizer_keys(self.optimizer, self.model.trainable_variables))
        checkpoint.save_weights(Path(output_dir) / checkpoint.WEIGHTS_FILE, self.model)

    def load(self, output_dir: Path) -> dict:
        payload = checkpoint.load(output_dir)
        weights = self.model.get_weights()
        if [w.shape for w in weights] != [np.shape(w) for w in payload["model"]]:
            raise ValueError("the checkpoint's weights do not fit this model (another "
                             "--dataset or --batchnorm?)")
        self.model.set_weights(payload["model"])
        # By key: slots this run's --momentum, -k or --precision adds start fresh, others drop.
        checkpoint.load_optimizer(self.optimizer, self.model.trainable_variables,
                                  payload["optimizer_keys"], payload["optimizer"])
        return payload["record"]

    def checksum(self) -> float:
        return float(sum(np.asarray(w, dtype=np.float64).sum() for w in self.model.get_weights()))
