"""PyTorch checkpoints: written by rank 0 atomically with one previous generation kept, loaded with
``torch.load(weights_only=True)`` and falling back to the previous one when the newest is
truncated or corrupt.

A checkpoint holds the model, the optimizer (momentum buffers, ...), the optimizer step count
(which fixes the LR schedule position), the epoch, RNG states, and the world size and global batch
it was made with, so a resumed run continues exactly where the saved one stopped; a run resumed
at another world size recomputes the scaled learning rate for its own size.

The optimizer's settings (momentum, dampening, weight decay, ...) are this run's, not the
checkpoint's (:func:`load_optimizer`): ``torch.optim.Optimizer.load_state_dict`` would put the
saved run's values back into the param groups, so ``--resume --momentum 0.0`` ran on with the
checkpoint's 0.9 while the record said 0.0. The state (momentum buffers, step counts) carries over.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hvdtrain import runtime
from hvdtrain.files import CheckpointError, load_newest, save_rotating

CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_FILE = "checkpoint.prev.pt"
# Param-group entries a resumed run does not take from the optimizer it built: the parameters,
# and the learning rate's, which the schedule sets from this run's --lr (hvdtrain_base_lr) and
# step (hvdtrain.torch.adapter.distribute, hvdtrain.torch.scheduler).
SCHEDULE_ENTRIES = ("params", "lr", "initial_lr", "hvdtrain_base_lr", "hvdtrain_lr_scale")
__all__ = ["CHECKPOINT_FILE", "PREVIOUS_FILE", "CheckpointError", "rng_state",
           "set_rng_state", "save", "load", "load_optimizer"]


def rng_state() -> dict:
    """Torch (CPU, and the current CUDA device's when CUDA is in use), NumPy and Python RNG
    states in types ``weights_only`` loading accepts."""
    state = {"torch": torch.get_rng_state(), **runtime.python_numpy_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved (the CUDA state only where CUDA is in use)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])
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
    # map_location: a checkpoint written on GPUs loads on a CPU-only machine (load_state_dict
    # then moves each tensor to its parameter's device).
    payload = torch.load(path, weights_only=True, map_location="cpu")
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


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> dict[str, tuple]:
    """Load a checkpoint's optimizer ``state`` (``optimizer.state_dict()``) into ``optimizer``,
    keeping the settings ``optimizer`` was built with (this run's command line: ``momentum``,
    ``dampening``, ``weight_decay``, ``nesterov``, ...); only the state (momentum buffers, step
    counts) comes from the checkpoint. The learning-rate entries (:data:`SCHEDULE_ENTRIES`) are
    left to the schedule, which sets them from this run's ``--lr`` and step.

    A momentum buffer is dropped where this run's momentum is 0 (SGD neither reads nor updates
    it then, and a later resume at a momentum again would start from the stale one, where Keras
    starts a new slot at zero); one the new settings need and the checkpoint lacks starts as
    the optimizer starts it (SGD: the first gradient).

    Args:
        optimizer: the plain ``torch.optim`` optimizer this run built (before
            :func:`hvdtrain.torch.distribute`).
        state: the checkpoint's ``optimizer`` entry.

    Returns:
        ``{setting: (checkpoint's value, this run's value)}`` for each setting that differs
        (taken from group 0 when several groups differ; empty when none does).

    Raises:
        ValueError: the state does not fit the optimizer (another number of parameter groups
            or parameters: ``torch.optim``'s own message).
    """
    built = [{k: v for k, v in group.items() if k not in SCHEDULE_ENTRIES}
             for group in optimizer.param_groups]
    saved = state.get("param_groups", [])
    optimizer.load_state_dict(state)
    changed: dict[str, tuple] = {}
    for group, mine, theirs in zip(optimizer.param_groups, built, saved):
        for key, value in mine.items():
            if key in theirs and theirs[key] != value and key not in changed:
                changed[key] = (theirs[key], value)
            group[key] = value
        if group.get("momentum", None) == 0:
            for p in group["params"]:
                optimizer.state.get(p, {}).pop("momentum_buffer", None)
    return changed
