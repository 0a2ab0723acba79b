"""TensorBoard event files for both trainers, written by rank 0 with tensorboardX (a framework-free
writer, so PyTorch, Keras on TensorFlow and Keras on PyTorch write the same tags).

Watch a run while it trains::

    tensorboard --logdir runs/           # every run under runs/, each in <output_dir>/tensorboard

Tags (x axis: the optimizer step for ``step/*``, the epoch for ``epoch/*``):

* ``step/loss``, ``step/accuracy``: rank 0's training loss (mean cross-entropy, nats per sample)
  and accuracy over the micro-batches since the previous point (rank 0's shard only: reading
  all ranks would add a collective to the training step);
* ``step/lr``: the learning rate of the step; ``step/samples_per_sec``: training samples over all
  ranks per second of wall time since the previous point; ``step/global_batch``: samples per
  optimizer step over all ranks; ``step/allreduces_per_micro_batch``: gradient all-reduces per
  micro-batch counted since the previous point (``1/k`` with ``backward_passes_per_step`` k);
* ``epoch/train_loss``, ``epoch/train_accuracy``, ``epoch/test_loss``, ``epoch/test_accuracy``,
  ``epoch/lr``, ``epoch/samples_per_sec``: the epoch's numbers of ``metrics.json``, averaged over
  all ranks; ``epoch/global_batch``.
"""
from __future__ import annotations

import os
from pathlib import Path

TENSORBOARD_DIR = "tensorboard"
EPOCH_FIELDS = ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr",
                "samples_per_sec")


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without importing PyTorch into a process that
    has not (a Keras/TensorFlow rank): tensorboardX imports torch, when installed, only to
    accept torch tensors (``tensorboardX/writer.py``, ``x2num.py``), which costs such a rank
    about 1.5 s and 200 MB; hvdtrain passes Python floats."""
    import sys
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class Board:
    """Rank 0's TensorBoard writer; on other ranks, or when disabled, every call does nothing.

    Args:
        output_dir: the run's output directory; events go to ``<output_dir>/tensorboard``.
        enabled: write at all (``hvdtrain train --no-tensorboard`` turns it off).
        is_root: only the root rank writes.
    """

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, is_root: bool):
        self.log_dir = Path(output_dir) / TENSORBOARD_DIR
        self._writer = None
        if enabled and is_root:
            SummaryWriter = _summary_writer_class()
            # The pid in the name: tensorboardX names files by the second and host, and two
            # processes of one host (an elastic rank 0 and its successor) must not share a file.
            self._writer = SummaryWriter(logdir=str(self.log_dir), flush_secs=10,
                                         filename_suffix=f".{os.getpid()}")

    @property
    def enabled(self) -> bool:
        """True where this rank writes events."""
        return self._writer is not None

    def step(self, step: int, values: dict) -> None:
        """Write ``values`` (tag suffix -> number) as ``step/<name>`` at optimizer step ``step``."""
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(f"step/{name}", float(value), global_step=step)

    def epoch(self, metrics, global_batch: int) -> None:
        """Write an epoch's :class:`~hvdtrain.run.report.EpochMetrics` as ``epoch/<field>`` at
        ``metrics.epoch``, then flush (an epoch's numbers appear at once)."""
        if self._writer is None:
            return
        for name in EPOCH_FIELDS:
            self._writer.add_scalar(f"epoch/{name}", float(getattr(metrics, name)),
                                    global_step=metrics.epoch)
        self._writer.add_scalar("epoch/global_batch", float(global_batch),
                                global_step=metrics.epoch)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (again: nothing)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Board":
        return self

    def __exit__(self, *exc) -> None:
        """Close on every way out of the training loop (an error, a stop, a preemption), so the
        points written so far reach the disk even when the launcher then kills the process."""
        self.close()


class StepMeter:
    """Per-step TensorBoard points every ``every`` optimizer steps, from running sums the trainer
    keeps anyway (so nothing is read from the device between points).

    Args:
        board: the :class:`Board` (the meter is idle where it is disabled).
        every: optimizer steps between points, >= 1.
        global_batch: samples per optimizer step over all ranks.
        samples_per_micro_batch: samples of one micro-batch over all ranks (local batch x size).
    """

    def __init__(self, board: Board, every: int, global_batch: int, samples_per_micro_batch: int):
        self.board, self.every = board, every
        self.global_batch, self.samples_per_micro_batch = global_batch, samples_per_micro_batch
        self._last = None  # (time, loss_sum, correct, seen, micro_batches, allreduces)

    def start(self, now: float, loss_sum: float = 0.0, correct: float = 0.0, seen: float = 0.0,
              micro_batches: int = 0, allreduces: int = 0) -> None:
        """Start an interval at the running sums' current values (at each epoch's start: the
        trainers' sums restart there; a resumed epoch starts from its checkpointed sums)."""
        self._last = (now, loss_sum, correct, seen, micro_batches, allreduces)

    def due(self, step: int) -> bool:
        """True when optimizer step ``step`` (1-based count of steps taken) gets a point."""
        return self.board.enabled and step % self.every == 0

    def point(self, step: int, now: float, lr: float, loss_sum: float, correct: float,
              seen: float, micro_batches: int, allreduces: int) -> None:
        """Write the point for optimizer step ``step`` from this epoch's running sums on rank 0
        (``loss_sum`` in nats, ``correct`` and ``seen`` samples, micro-batches trained and
        gradient all-reduces run), then start the next interval there."""
        if not self.board.enabled or self._last is None:
            return
        t0, loss0, correct0, seen0, micro0, allreduces0 = self._last
        seen_delta, micro_delta = seen - seen0, micro_batches - micro0
        values = {"lr": lr, "global_batch": self.global_batch}
        if seen_delta > 0:
            values["loss"] = (loss_sum - loss0) / seen_delta
            values["accuracy"] = (correct - correct0) / seen_delta
        if micro_delta > 0:
            values["allreduces_per_micro_batch"] = (allreduces - allreduces0) / micro_delta
            if now > t0:
                values["samples_per_sec"] = micro_delta * self.samples_per_micro_batch / (now - t0)
        self.board.step(step, values)
        self._last = (now, loss_sum, correct, seen, micro_batches, allreduces)
