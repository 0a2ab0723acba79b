"""Keras checkpoints: one ``checkpoint.npz`` written by rank 0 atomically with one previous
generation kept (``checkpoint.prev.npz``), read back with ``numpy.load(allow_pickle=False)`` (no
code runs on load) and falling back to the previous one when the newest is truncated or corrupt.

A checkpoint holds the model's weights (``model.get_weights()`` order), the optimizer's variables
(``optimizer.variables`` order: a ``LossScaleOptimizer``'s own variables, then the inner
optimizer's ``iterations``, slots and gradient accumulators), and a JSON
record of the epoch, the optimizer step, the world size and global batch it was made with, the
configuration, the metrics so far and the NumPy/Python RNG states. The data order
(:class:`~hvdtrain.keras.sharding.ShardedDataset`) is a function of the seed and the position in
the stream, which the record holds too. The same layout as :mod:`hvdtrain.torch.checkpoint`.

Beside it rank 0 writes ``checkpoint.weights.h5`` (:func:`save_weights`, for
``model.load_weights``); :func:`counters` and :func:`restore_counters` carry the run's skipped
and fp16-overflow step counts through the record.
"""
from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
from keras import ops

from hvdtrain.files import CheckpointError, atomic_path, load_newest, save_rotating

CHECKPOINT_FILE = "checkpoint.npz"
PREVIOUS_FILE = "checkpoint.prev.npz"
WEIGHTS_FILE = "checkpoint.weights.h5"
__all__ = ["CHECKPOINT_FILE", "PREVIOUS_FILE", "WEIGHTS_FILE", "CheckpointError", "save", "load",
           "save_weights", "counters", "restore_counters"]


def save(output_dir: str | Path, model_weights: list[np.ndarray],
         optimizer_variables: list[np.ndarray], record: dict) -> Path:
    """Write a checkpoint to ``output_dir`` (rank 0 only), keeping the previous one.

    Args:
        output_dir: run directory.
        model_weights: ``model.get_weights()``.
        optimizer_variables: ``[v.numpy() for v in optimizer.variables]``.
        record: JSON-serialisable metadata (epoch, step, size, global_batch, config, rng,
            metrics).

    Returns:
        The path written.
    """
    arrays = {f"model/{i:04d}": np.asarray(w) for i, w in enumerate(model_weights)}
    arrays.update({f"optimizer/{i:04d}": np.asarray(v) for i, v in enumerate(optimizer_variables)})
    arrays["record"] = np.array(json.dumps(record))
    out = Path(output_dir)
    return save_rotating(out / CHECKPOINT_FILE, out / PREVIOUS_FILE,
                         lambda handle: np.savez(handle, **arrays))


def _read(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as archive:
        if "record" not in archive.files:
            raise ValueError("not an hvdtrain checkpoint (no 'record' entry)")
        payload = {"record": json.loads(str(archive["record"]))}
        for part in ("model", "optimizer"):
            names = sorted(n for n in archive.files if n.startswith(part + "/"))
            payload[part] = [archive[n] for n in names]  # reads (and CRC-checks) every array
    return payload


def load(output_dir: str | Path) -> dict:
    """The newest loadable checkpoint in ``output_dir``: ``checkpoint.npz``, or
    ``checkpoint.prev.npz`` when the newest is missing, truncated or corrupt (logged).

    Returns:
        ``{"model": [arrays], "optimizer": [arrays], "record": {...}}``.

    Raises:
        CheckpointError: neither file loads; the message says what each failure was.
    """
    out = Path(output_dir)
    return load_newest([out / CHECKPOINT_FILE, out / PREVIOUS_FILE], _read)[1]


def save_weights(path: str | Path, model: keras.Model) -> None:
    """Write the model's weights (HDF5, for ``model.load_weights``) atomically: temp file, fsync,
    rename. Rank 0 only. (``--resume`` reads :func:`load`'s ``checkpoint.npz`` instead, which
    also holds the optimizer state.)"""
    # The temporary name keeps the ".weights.h5" ending: Keras picks the file format from it.
    with atomic_path(path, suffix=".weights.h5") as tmp:
        model.save_weights(str(tmp))


def counters(optimizer) -> dict:
    """The run's skipped (non-finite) and fp16-overflow counts, for the checkpoint."""
    guard = getattr(optimizer, "hvdtrain_nonfinite", None)
    scaler = getattr(optimizer, "hvdtrain_loss_scale", None)
    return {"skipped": int(ops.convert_to_numpy(guard.skipped)) if guard is not None else 0,
            "overflows": int(ops.convert_to_numpy(scaler.overflows)) if scaler is not None else 0}


def restore_counters(optimizer, counters: dict) -> None:
    """Set the counts :func:`counters` saved (missing ones to 0)."""
    guard = getattr(optimizer, "hvdtrain_nonfinite", None)
    scaler = getattr(optimizer, "hvdtrain_loss_scale", None)
    if guard is not None:
        guard.skipped.assign(int(counters.get("skipped", 0)))
    if scaler is not None:
        scaler.overflows.assign(int(counters.get("overflows", 0)))
