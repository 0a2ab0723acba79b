"""PyTorch checkpoints: written by rank 0 atomically with one previous generation kept, loaded with
``torch.load(weights_only=True)`` and falling back to the previous one when the newest is
truncated or corrupt.

A checkpoint holds the model, the optimizer (momentum buffers, ...), the optimizer step count
(which fixes the LR schedule position), the epoch, RNG states, and the world size and global batch
it was made with, so a resumed run continues exactly where the saved one stopped; a run resumed
at another world size recomputes the scaled learning rate for its own size.
"""
from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

from hvdtrain.files import atomic_open

CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_FILE = "checkpoint.prev.pt"
log = logging.getLogger("hvdtrain")


class CheckpointError(RuntimeError):
    """No usable checkpoint; the message lists what was tried and why each failed."""


def rng_state() -> dict:
    """Torch, NumPy and Python RNG states in types ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "cached": cached},
            "python": {"version": version, "state": list(state), "gauss": gauss}}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def save(output_dir: str | Path, payload: dict) -> Path:
    """Write ``payload`` as ``checkpoint.pt`` in ``output_dir`` (rank 0 only).

    The previous ``checkpoint.pt`` is first renamed ``checkpoint.prev.pt``; the new one is written
    to a temporary file, fsync'ed and renamed into place, so at every moment one complete
    checkpoint exists and a crash mid-write loses nothing.

    Returns:
        The path written.
    """
    out = Path(output_dir)
    current = out / CHECKPOINT_FILE
    if current.exists():
        os.replace(current, out / PREVIOUS_FILE)
    with atomic_open(current, "wb") as handle:
        torch.save(payload, handle)
    return current


def load(output_dir: str | Path) -> dict:
    """The newest loadable checkpoint in ``output_dir``: ``checkpoint.pt``, or
    ``checkpoint.prev.pt`` when the newest is missing, truncated or corrupt (logged).

    Raises:
        CheckpointError: neither file loads; the message says what each failure was.
    """
    out = Path(output_dir)
    problems = []
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        path = out / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        try:
            payload = torch.load(path, weights_only=True)
            if not isinstance(payload, dict) or "model" not in payload:
                raise ValueError("not an hvdtrain checkpoint (no 'model' entry)")
        except Exception as exc:  # torch raises many types for truncated/corrupt files
            problems.append(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:200]})")
            log.error("checkpoint %s is unreadable (%s); trying the previous one", path,
                      type(exc).__name__)
            continue
        if problems:
            log.warning("resuming from %s (epoch %d) because %s", path, payload["epoch"],
                        "; ".join(problems))
        return payload
    raise CheckpointError("no usable checkpoint: " + "; ".join(problems) +
                          ". Start without --resume, or point --output-dir at a run's directory")
