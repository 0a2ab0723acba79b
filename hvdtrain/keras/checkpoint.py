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
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hvdtrain.files import CheckpointError, load_newest, save_rotating

CHECKPOINT_FILE = "checkpoint.npz"
PREVIOUS_FILE = "checkpoint.prev.npz"
__all__ = ["CHECKPOINT_FILE", "PREVIOUS_FILE", "CheckpointError", "save", "load"]


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
