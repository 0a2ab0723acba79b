"""What a framework supplies to the training run (:class:`hvdtrain.run.training.Run`): the
operations that differ between PyTorch and Keras, and nothing else. The run written once calls
them; :mod:`hvdtrain.torch.hooks` and :mod:`hvdtrain.keras.hooks` implement them, file by file
and name by name alike (``tests/unit/test_symmetry.py`` keeps them in step).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Hooks(Protocol):
    """The framework side of a training run.

    Attributes:
        framework: ``"torch"`` or ``"keras"`` (``metrics.json``'s ``framework``).
        checkpoint_files: the newest and the previous checkpoint's file names in the output
            directory (``--resume auto`` starts fresh when neither exists).
    """

    framework: str
    checkpoint_files: tuple[str, str]

    def versions(self) -> dict[str, str]:
        """Framework and Horovod versions for ``metrics.json``."""

    def broadcast_object(self, obj, root_rank: int = 0, name: str | None = None):
        """Horovod's ``broadcast_object`` of the framework: ``obj`` from ``root_rank`` on every
        rank (pickled)."""

    def allgather_object(self, obj, name: str | None = None) -> list:
        """Horovod's ``allgather_object``: every rank's ``obj``, in rank order."""

    def allreduce_sums(self, sums: dict[str, float], name: str) -> dict[str, float]:
        """``sums`` summed over ranks (float64), the same on every rank."""

    def sync_buffers(self) -> None:
        """Average the model's non-trainable state (BatchNorm statistics) over ranks."""

    def evaluate(self) -> tuple[float, float]:
        """Mean test loss (nats per sample) and accuracy over the whole test split, every rank
        scoring its own unpadded shard; the same on every rank."""

    def rng_state(self) -> dict:
        """This rank's RNG states (picklable; JSON-ready for Keras)."""

    def set_rng_state(self, state: dict) -> None:
        """Restore what :meth:`rng_state` returned."""

    def counters(self) -> dict[str, int]:
        """The run's optimizer steps skipped for a non-finite loss (``skipped``) and, with
        fp16, for overflowing gradients (``overflows``)."""

    def restore_counters(self, counters: dict) -> None:
        """Set what :meth:`counters` returned (missing ones to 0)."""

    def save(self, output_dir: Path, record: dict) -> None:
        """Rank 0: write the model, the optimizer and ``record`` (the run's position, config,
        metrics, RNG states: :meth:`hvdtrain.run.training.Run.save`) atomically, keeping the
        previous checkpoint."""

    def load(self, output_dir: Path) -> dict:
        """Rank 0: load the newest loadable checkpoint into the model and optimizer.

        Returns:
            The ``record`` it was saved with (plus framework state such as the fp16 scaler's).

        Raises:
            hvdtrain.files.CheckpointError: no checkpoint loads.
            ValueError: it does not fit this model or optimizer (the message says which option).
        """

    def checksum(self) -> float:
        """Sum of the model's floating-point state (weights and buffers), float64: equal on
        every rank when the ranks agree."""
