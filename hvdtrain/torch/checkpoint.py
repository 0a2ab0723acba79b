"""PyTorch checkpoints: written by rank 0 atomically with one previous generation kept, loaded with
``torch.load(weights_only=True)`` and falling back to the previous one when the newest is
truncated or corrupt.

A checkpoint holds the model, the optimizer (momentum buffers, ...), the optimizer step count
(which fixes the LR schedule position), the epoch, RNG states, and the world size and global batch
it was made with, so a resumed run continues exactly where the saved one stopped; a run resumed
at another world size recomputes the scaled learning rate for its own size.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hvdtrain import runtime
from hvdtrain.files import CheckpointError, load_newest, save_rotating

CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_FILE = "checkpoint.prev.pt"
__all__ = ["CHECKPOINT_FILE", "PREVIOUS_FILE", "CheckpointError", "rng_state",
           "set_rng_state", "save", "load"]


def rng_state() -> dict:
    """Torch, NumPy and Python RNG states in types ``weights_only`` loading accepts."""
    return {"torch": torch.get_rng_state(), **runtime.python_numpy_rng_state()}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    runtime.set_python_numpy_rng_state(state)


def save(output_dir: str | Path, payload: dict) -> Path:
    """Write ``payload`` as ``checkpoint.pt`` in ``output_dir`` (rank 0 only).

    The previous ``checkpoint.pt`` is kept as ``checkpoint.prev.pt``; the new one is written to a
    temporary file, fsync'ed and renamed into place (:func:`hvdtrain.files.save_rotating`).

    Returns:
        The path written.
    """
    out = Path(output_dir)
    return save_rotating(out / CHECKPOINT_FILE, out / PREVIOUS_FILE,
                         lambda handle: torch.save(payload, handle))


def _read(path: Path) -> dict:
    payload = torch.load(path, weights_only=True)
    if not isinstance(payload, dict) or "model" not in payload:
        raise ValueError("not an hvdtrain checkpoint (no 'model' entry)")
    return payload


def load(output_dir: str | Path) -> dict:
    """The newest loadable checkpoint in ``output_dir``: ``checkpoint.pt``, or
    ``checkpoint.prev.pt`` when the newest is missing, truncated or corrupt (logged).

    Raises:
        CheckpointError: neither file loads; the message says what each failure was.
    """
    out = Path(output_dir)
    return load_newest([out / CHECKPOINT_FILE, out / PREVIOUS_FILE], _read)[1]
