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

Each optimizer variable is saved under a key that names its role, not its position
(:func:`optimizer_keys`: ``inner/iteration``, ``inner/3:momentum`` for trainable variable 3's
slot, ``outer/dynamic_scale`` for a ``LossScaleOptimizer``'s own), and a resumed run loads by key
(:func:`load_optimizer`): a slot this run's optimizer has and the checkpoint lacks starts at its
initial value (``--momentum`` from 0 to 0.9, ``-k`` from 1 to 2: momentum slots, gradient
accumulators), one it lacks is dropped (``--momentum 0``, ``-k 1``, fp16 to fp32), as the
PyTorch trainer does with ``torch.optim``'s state. Before, the variables went back by position
and a resume with another count was refused. Checkpoints written before the keys existed load by
position when the counts agree.

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
           "save_weights", "counters", "restore_counters", "optimizer_keys", "load_optimizer",
           "restart_loss_scale"]


def save(output_dir: str | Path, model_weights: list[np.ndarray],
         optimizer_variables: list[np.ndarray], record: dict,
         keys: list[str] | None = None) -> Path:
    """Write a checkpoint to ``output_dir`` (rank 0 only), keeping the previous one.

    Args:
        output_dir: run directory.
        model_weights: ``model.get_weights()``.
        optimizer_variables: ``[v.numpy() for v in optimizer.variables]``.
        record: JSON-serialisable metadata (epoch, step, size, global_batch, config, rng,
            metrics).
        keys: :func:`optimizer_keys` of ``optimizer_variables`` (saved as ``optimizer_keys``).

    Returns:
        The path written.
    """
    arrays = {f"model/{i:04d}": np.asarray(w) for i, w in enumerate(model_weights)}
    arrays.update({f"optimizer/{i:04d}": np.asarray(v) for i, v in enumerate(optimizer_variables)})
    arrays["record"] = np.array(json.dumps(record))
    if keys is not None:
        if len(keys) != len(optimizer_variables):
            raise ValueError(f"{len(keys)} keys for {len(optimizer_variables)} optimizer variables")
        arrays["optimizer_keys"] = np.array(json.dumps(list(keys)))
    out = Path(output_dir)
    return save_rotating(out / CHECKPOINT_FILE, out / PREVIOUS_FILE,
                         lambda handle: np.savez(handle, **arrays))


def _read(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as archive:
        if "record" not in archive.files:
            raise ValueError("not an hvdtrain checkpoint (no 'record' entry)")
        payload = {"record": json.loads(str(archive["record"])),
                   "optimizer_keys": (json.loads(str(archive["optimizer_keys"]))
                                      if "optimizer_keys" in archive.files else None)}
        for part in ("model", "optimizer"):
            names = sorted(n for n in archive.files if n.startswith(part + "/"))
            payload[part] = [archive[n] for n in names]  # reads (and CRC-checks) every array
    return payload


def load(output_dir: str | Path) -> dict:
    """The newest loadable checkpoint in ``output_dir``: ``checkpoint.npz``, or
    ``checkpoint.prev.npz`` when the newest is missing, truncated or corrupt (logged).

    Returns:
        ``{"model": [arrays], "optimizer": [arrays], "optimizer_keys": [str] or None (a
        checkpoint from before keys were saved), "record": {...}}``.

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


def optimizer_keys(optimizer, trainable_variables) -> list[str]:
    """A key per ``optimizer.variables`` entry that names its role and does not depend on the
    variables' order or on Keras's unique layer names: ``"<owner>/<name>"``, with owner
    ``inner`` for the optimizer that owns the slots (a ``LossScaleOptimizer``'s inner one, or
    the optimizer itself) and ``outer`` for a ``LossScaleOptimizer``'s own variables (its loss
    scale and counters), and a slot's name ``<i>:<slot>`` for the slot Keras made for
    ``trainable_variables[i]`` (Keras names it ``<that variable's path>_<slot>``).

    Args:
        optimizer: the distributed optimizer (built).
        trainable_variables: ``model.trainable_variables``, in the model's order.

    Returns:
        One key per optimizer variable, in ``optimizer.variables`` order, e.g.
        ``["inner/iteration", "inner/0:momentum", ..., "inner/0:gradient_accumulator"]``.
    """
    owner = getattr(optimizer, "inner_optimizer", optimizer)
    inner_ids = {id(v) for v in owner.variables}
    prefixes = sorted(((v.path.replace("/", "_") + "_", i)
                       for i, v in enumerate(trainable_variables)), key=lambda p: -len(p[0]))
    keys = []
    for var in optimizer.variables:
        name = var.name
        for prefix, i in prefixes:  # the longest first: conv2d_1_kernel before conv2d_1
            if name.startswith(prefix):
                name = f"{i}:{name[len(prefix):]}"
                break
        keys.append(f"{'inner' if id(var) in inner_ids else 'outer'}/{name}")
    return keys


def load_optimizer(optimizer, trainable_variables, keys: list[str] | None,
                   values: list[np.ndarray]) -> dict[str, list[str]]:
    """Put a checkpoint's optimizer variables into ``optimizer`` by key
    (:func:`optimizer_keys`): each variable the checkpoint holds gets its value; one it does not
    hold keeps its initial value (zeros for momentum slots and gradient accumulators, the
    initial loss scale), and saved values this optimizer has no variable for are dropped. So a
    resume may change ``--momentum`` (to or from 0), ``-k`` and ``--precision``, as with the
    PyTorch trainer; the settings (momentum, ...) are always this run's, since Keras keeps them
    as Python attributes, not variables.

    Args:
        optimizer: the distributed optimizer (built).
        trainable_variables: ``model.trainable_variables``.
        keys: the checkpoint's ``optimizer_keys``; None for a checkpoint from before they were
            saved, which loads by position and only into an optimizer with as many variables.
        values: the checkpoint's optimizer arrays, in the same order.

    Returns:
        ``{"restored": [...], "fresh": [...], "dropped": [...]}``: the keys loaded, the keys
        this optimizer has that the checkpoint lacks, and the checkpoint's keys left out.

    Raises:
        ValueError: a saved value whose shape does not fit its variable, or (no keys) another
            number of variables; the message says which options to compare.
    """
    variables = list(optimizer.variables)
    mine = optimizer_keys(optimizer, trainable_variables)
    if keys is None:
        if len(values) != len(variables):
            raise ValueError(
                f"the checkpoint holds {len(values)} optimizer variables by position (written "
                f"before hvdtrain saved their names), this optimizer has {len(variables)}: "
                "resume it with the --momentum (0 or not), -k (1 or more) and --precision "
                "(fp16 or not) it was made with")
        keys = mine
    saved = dict(zip(keys, values))
    for var, key in zip(variables, mine):
        if key not in saved:
            continue
        value = np.asarray(saved[key])
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"the checkpoint's optimizer variable {key} has shape "
                             f"{tuple(value.shape)}, this optimizer's {tuple(var.shape)} "
                             "(another model: --dataset or --batchnorm?)")
        var.assign(value)
    return {"restored": [k for k in mine if k in saved],
            "fresh": [k for k in mine if k not in saved],
            "dropped": [k for k in keys if k not in set(mine)]}


def restart_loss_scale(optimizer, initial_scale: float) -> None:
    """Start a ``LossScaleOptimizer``'s dynamic loss scale again at ``initial_scale`` (a resume
    with another ``--init-loss-scale``), as a new ``torch.amp.GradScaler`` would; nothing for
    another optimizer."""
    if hasattr(optimizer, "dynamic_scale"):
        optimizer.dynamic_scale.assign(float(initial_scale))
        optimizer.step_counter.assign(0)
