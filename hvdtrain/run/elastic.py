"""What an elastic run records and how it stops (:mod:`hvdtrain.torch.elastic`,
:mod:`hvdtrain.keras.elastic`): ``metrics.json`` built from the committed epoch history, the
TensorBoard epochs of whichever process is rank 0 now, and the stops every worker takes together.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hvdtrain import guard, runtime
from hvdtrain.files import write_json
from hvdtrain.run.report import EpochMetrics, RunReport, stop_together
from hvdtrain.tensorboard import Board

log = logging.getLogger("hvdtrain")


ELASTIC_EXTRA = ("samples", "sizes")


def write_elastic_report(output_dir: str | os.PathLike, header: dict, history: list[dict],
                         size: int, is_root: bool) -> dict:
    """``metrics.json`` of an elastic run, built from the committed epoch history (each entry an
    :class:`EpochMetrics` dict plus ``samples``: training samples committed in that epoch over all
    workers, and ``sizes``: the world sizes it ran at). ``size`` is the current world size.
    An elastic epoch's ``seconds`` run from its start to the end of its evaluation (its start is
    committed state: a reset back to a commit inside the epoch keeps it, the time lost counted).
    Rank 0 writes it atomically; every rank gets it back."""
    report = RunReport(output_dir, header, is_root=is_root)
    report.epochs = [EpochMetrics(**{k: v for k, v in e.items() if k not in ELASTIC_EXTRA})
                     for e in history]
    result = report.to_dict()
    result["size"] = size
    for epoch, extra in zip(result["epochs"], history):
        epoch.update({k: extra[k] for k in ELASTIC_EXTRA})
    if is_root:
        write_json(report.path, result)
    return result


class ElasticReport:
    """What the two elastic trainers (:mod:`hvdtrain.torch.elastic`, :mod:`hvdtrain.keras.elastic`)
    record and how they stop, in one place.

    ``state`` is the trainer's Horovod Elastic state, with the attributes ``history`` (committed
    epochs: :class:`EpochMetrics` dicts plus ``samples`` and ``sizes``), ``epoch``, ``skipped``
    and ``epoch_skipped`` (optimizer steps skipped for non-finite gradients, in the run and in the
    epoch; rolled back with the rest of the state). ``size``/``is_root`` are read at each call
    (the world changes at a reset); ``broadcast_object`` is the backend's
    ``hvd.broadcast_object``, the collective every rank holds in before stopping.

    Stopping (a non-finite loss with ``--on-nonfinite stop``: ``nonfinite_stop``; the divergence
    check: ``diverged``) happens on every rank at the same point: rank 0 rewrites
    ``metrics.json`` with the reason and prints the error, every rank holds in one broadcast so
    that none exits first, then every rank raises. Every worker exits 1, and Horovod Elastic's
    driver, seeing all of them fail, ends the job instead of resetting it.
    """

    def __init__(self, output_dir: str | os.PathLike, header: dict, state, cfg,
                 size: Callable[[], int], is_root: Callable[[], bool],
                 broadcast_object: Callable[..., object]):
        self.out, self.header, self.state, self.cfg = Path(output_dir), header, state, cfg
        self.size, self.is_root, self.broadcast_object = size, is_root, broadcast_object
        self._board: Board | None = None  # opened when this process first writes as rank 0
        self._written: set[int] = set()  # the epochs on its event file

    def board_epochs(self, history: list[dict], last_tentative: bool = False) -> None:
        """On rank 0 (whoever it is now: after a reset another process may be), the TensorBoard
        scalars (:meth:`hvdtrain.tensorboard.Board.epoch`, flushed at once) of every epoch in
        ``history`` (entries as in ``state.history``) that this process has not written yet, with
        the global batch at the last size in the epoch's ``sizes`` (the size it ended at, unless
        it went back to a size it had run at before); nothing elsewhere or with
        ``--no-tensorboard``. Each process that writes as rank 0 opens its own event file in
        ``<output_dir>/tensorboard`` and starts it with the epochs before it (a rank 0 lost
        after ``metrics.json`` but before its events would otherwise leave a gap); TensorBoard
        reads the files as one run, where an epoch both wrote shows twice at the same step (the
        same losses, accuracies and lr; ``samples_per_sec`` is each one's own timing). No
        per-step points.

        ``last_tentative``: the last entry is written but not counted as written (the diverged
        epoch: if a worker is lost while the run stops, the survivors train it again, and the
        new numbers are written too).
        """
        if not (self.cfg.tensorboard and self.is_root()):
            return
        if self._board is None:
            self._board = Board(self.out, True, True)
        for i, entry in enumerate(history):
            if entry["epoch"] in self._written:
                continue
            metrics = EpochMetrics(**{k: v for k, v in entry.items() if k not in ELASTIC_EXTRA})
            sizes = entry.get("sizes") or [self.size()]
            self._board.epoch(metrics, self.cfg.global_batch(sizes[-1]))
            if not (last_tentative and i == len(history) - 1):
                self._written.add(entry["epoch"])

    def close(self) -> None:
        """Close the TensorBoard event file, where this process opened one (a later
        :meth:`board_epochs` opens a new one)."""
        if self._board is not None:
            self._board.close()
            self._board = None

    def write(self) -> dict:
        """Rewrite ``metrics.json`` from the committed history (rank 0); the report, every rank."""
        self.header["skipped_steps"] = self.state.skipped
        return write_elastic_report(self.out, self.header, self.state.history, self.size(),
                                    self.is_root())

    def stop(self, key: str, message: str, history: list[dict]) -> None:
        """Record ``key`` = ``message`` with ``history`` (rank 0), print it, hold (every rank).
        The header changes only after the hold: a worker lost in it resets and trains on."""
        self.header["skipped_steps"] = self.state.skipped
        write_elastic_report(self.out, {**self.header, key: message}, history, self.size(),
                             self.is_root())
        if self.is_root():
            print(f"hvdtrain: error: {message}", file=sys.stderr, flush=True)
        stop_together(self.broadcast_object, key)
        self.header[key] = message

    def skipped_step(self, bad_ranks: list[int], step: int) -> None:
        """After an optimizer step skipped on every rank (its all-reduced gradients were not
        finite; ``bad_ranks``: the ranks whose loss was not finite, from ``ranks_where``).

        Raises:
            runtime.NonFiniteLossError: with ``--on-nonfinite stop``, on every rank, after
                :meth:`stop` (``reported`` True).
        """
        message = runtime.nonfinite_message(bad_ranks, step, self.state.epoch + 1)
        if self.cfg.on_nonfinite == "stop":
            error = runtime.nonfinite_stop(message)
            self.stop("nonfinite_stop", str(error), self.state.history)
            error.reported = True
            raise error
        log.warning("%s: step skipped on all ranks", message)
        self.state.skipped += 1
        self.state.epoch_skipped += 1

    def check_divergence(self, metrics: EpochMetrics, entry: dict, num_classes: int) -> None:
        """The divergence check (:func:`hvdtrain.guard.divergence`) at an epoch's end, before its
        checkpoint: ``metrics`` the epoch just trained (all-reduced, so every rank reaches the
        same verdict), ``entry`` its history entry. Elastic runs have no warmup: every epoch from
        the second on is checked. Off with ``--no-divergence-check``.

        Raises:
            guard.DivergenceError: on every rank, after :meth:`stop` recorded the epoch and
                ``diverged`` (``reported`` True); the epoch is not checkpointed.
        """
        if not self.cfg.divergence_check:
            return
        epochs = [EpochMetrics(**{k: v for k, v in e.items() if k not in ELASTIC_EXTRA})
                  for e in self.state.history]
        why = guard.divergence(epochs + [metrics], 0, num_classes, self.cfg.lr_scaling,
                               warmup=False)
        if why:
            message = (f"{why}; epoch {metrics.epoch} was not checkpointed: the checkpoint in "
                       f"{self.out} is the epoch before it")
            self.board_epochs(self.state.history + [entry], last_tentative=True)
            self.stop("diverged", message, self.state.history + [entry])
            raise guard.DivergenceError(message, reported=True)

    def end_epoch(self, hooks, lr: float, num_classes: int) -> EpochMetrics:
        """An elastic epoch's end, every worker (the same steps as
        :meth:`hvdtrain.run.training.Run.end_epoch`, from the committed state's sums, which are
        already over all workers): evaluate (:meth:`Hooks.evaluate
        <hvdtrain.run.hooks.Hooks.evaluate>`), check for divergence (before the checkpoint),
        append the epoch to ``state.history``, and on rank 0 log, checkpoint
        (:meth:`Hooks.save <hvdtrain.run.hooks.Hooks.save>`) and rewrite ``metrics.json``; then
        the TensorBoard scalars. The trainer then starts the next epoch's state and commits.

        Args:
            hooks: the framework's :class:`~hvdtrain.run.hooks.Hooks`.
            lr: the learning rate the epoch ended at; num_classes: the chance level's classes.

        Raises:
            guard.DivergenceError: :meth:`check_divergence`.
        """
        state = self.state
        test_loss, test_acc = hooks.evaluate()
        seconds = time.time() - state.started  # resets and replays included
        seen = max(state.seen, 1)
        metrics = EpochMetrics(state.epoch + 1, state.loss_sum / seen, state.correct / seen,
                               test_loss, test_acc, lr, state.batch - state.epoch_skipped,
                               seconds, state.samples / seconds)
        entry = {**vars(metrics), "samples": state.samples, "sizes": list(state.sizes)}
        self.check_divergence(metrics, entry, num_classes)  # before its checkpoint
        state.history = state.history + [entry]
        if self.is_root():
            log.info("epoch %d: %d samples at sizes %s | test acc %.4f", state.epoch + 1,
                     state.samples, state.sizes, test_acc)
            size = self.size()
            hooks.save(self.out, {
                "epoch": state.epoch + 1, "batch": 0, "step": 0, "partial_per_rank": None,
                "size": size, "global_batch": self.cfg.global_batch(size),
                "config": self.cfg.to_dict(), "rng": hooks.rng_state(),
                "counters": {"skipped": state.skipped, "overflows": 0},
                "metrics": state.history})
            self.write()
        self.board_epochs(state.history)
        return metrics
