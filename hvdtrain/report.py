"""The run report both trainers write: one JSON schema for PyTorch and Keras, written by rank 0.

``metrics.json``::

    {"framework": "torch", "dataset": "digits", "size": 2, "local_batch": 16,
     "backward_passes_per_step": 1, "global_batch": 32, "base_lr": 0.02, "scaled_lr": 0.04,
     "lr_scaling": "linear", "warmup_epochs": 2.0, "train_samples": 1437, "test_samples": 360,
     "epochs": [{"epoch": 1, "train_loss": ..., "train_accuracy": ..., "test_loss": ...,
                 "test_accuracy": ..., "lr": ..., "optimizer_steps": ..., "seconds": ...,
                 "samples_per_sec": ...}, ...],
     "final_test_accuracy": 0.97, "samples_per_sec": ..., "config": {...}, "versions": {...}}

Losses are mean cross-entropy (nats per sample); accuracies are fractions in [0, 1];
``seconds`` is wall-clock training time of the epoch (evaluation excluded); ``samples_per_sec`` is
training samples processed by all ranks per second.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdtrain import __version__, guard, runtime
from hvdtrain.launch import tuning
from hvdtrain.files import write_json
from hvdtrain.tensorboard import Board

METRICS_FILE = "metrics.json"
log = logging.getLogger("hvdtrain")


@dataclass
class EpochMetrics:
    """Global (all-rank) numbers for one epoch; see the module docstring for units."""
    epoch: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    lr: float
    optimizer_steps: int
    seconds: float
    samples_per_sec: float


def run_header(framework: str, cfg, info, train_samples: int, test_samples: int,
               steps_per_epoch: int, versions: dict) -> dict:
    """The run-level fields of ``metrics.json`` (identical for both trainers), and log them once;
    rank 0 also warns once when the global batch is past the range where ``cfg.lr_scaling`` was
    shown to hold (:func:`hvdtrain.guard.large_batch_warning`; kept as ``large_batch_warning``).

    Args:
        framework: ``"torch"`` or ``"keras"``.
        cfg: the :class:`~hvdtrain.config.TrainConfig`.
        info: this rank's :class:`~hvdtrain.runtime.RankInfo`.
        train_samples, test_samples: split sizes.
        steps_per_epoch: optimizer steps per epoch.
        versions: framework and Horovod versions.
    """
    from hvdtrain import schedule
    k = cfg.backward_passes_per_step
    scaled = schedule.scaled_lr(cfg.lr, cfg.lr_scaling, info.size, k)
    log.info("%d ranks on %d host(s) x local batch %d x k=%d = global batch %d; lr %g -> %g (%s, "
             "warmup %g epochs); %d optimizer steps per epoch; %d threads per rank; %s, %s",
             info.size, info.hosts, cfg.batch_size, k, cfg.global_batch(info.size), cfg.lr,
             scaled, cfg.lr_scaling, cfg.warmup_epochs, steps_per_epoch, info.threads,
             info.device, cfg.precision)
    warning = guard.large_batch_warning(cfg.global_batch(info.size), train_samples,
                                        cfg.lr_scaling, schedule.scale_factor(cfg.lr_scaling,
                                                                              info.size, k))
    if warning and info.rank == 0:
        log.warning("warning: %s", warning)
    if info.horovod_settings:
        log.info("Horovod settings: %s", tuning.describe_settings(info.horovod_settings))
    return {"framework": framework, "dataset": cfg.dataset, "size": info.size,
            "hosts": info.hosts, "local_batch": cfg.batch_size, "backward_passes_per_step": k,
            "global_batch": cfg.global_batch(info.size), "base_lr": cfg.lr, "scaled_lr": scaled,
            "lr_scaling": cfg.lr_scaling, "warmup_epochs": cfg.warmup_epochs,
            "steps_per_epoch": steps_per_epoch, "train_samples": train_samples,
            "test_samples": test_samples, "threads_per_rank": info.threads,
            "device": info.device, "precision": cfg.precision,
            "horovod_settings": info.horovod_settings,
            "config": cfg.to_dict(), "versions": dict(versions),
            # Filled in by the trainer where it applies: the checkpoint resumed from, optimizer
            # steps skipped for non-finite losses and (fp16) for overflowing gradients (kept
            # current, so a run stopped in its first epoch records them too), whether every rank
            # ended with the same weights, the signal that stopped the run after a
            # checkpoint (hvdtrain.preempt), and why a run stopped with an error (the
            # divergence check; a non-finite loss with --on-nonfinite stop).
            "resumed_from": None, "skipped_steps": 0, "overflow_steps": 0,
            "ranks_agree": None, "preempted": None, "large_batch_warning": warning,
            "diverged": None, "nonfinite_stop": None, "elastic": bool(cfg.elastic)}


def setup_logging(rank: int) -> None:
    """INFO logging on rank 0, warnings only on the other ranks (so the job prints once)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[hvdtrain rank {rank}] %(message)s", force=True)


def stop_together(broadcast_object: Callable[..., object], reason: str) -> None:
    """The point every rank passes together before the job stops (a divergence, a non-finite
    loss with ``--on-nonfinite stop``, a preemption): one broadcast of None from rank 0, named
    ``hvdtrain.<reason>``. Rank 0 arrives once it has written what the stop leaves
    (``metrics.json``, the checkpoint) and printed why; the others wait for it here, since
    launchers end the whole job at the first rank that exits.

    Args:
        broadcast_object: the framework's ``hvd.broadcast_object`` (``horovod.torch``'s, or
            :func:`hvdtrain.keras.collectives.broadcast_object`).
        reason: the stop's name (``diverged``, ``nonfinite_stop``, ``preempt.done``).
    """
    broadcast_object(None, root_rank=0, name=f"hvdtrain.{reason}")


class RunReport:
    """Collects epoch metrics and writes ``metrics.json`` atomically after each epoch (rank 0),
    and the epoch's TensorBoard scalars.

    Args:
        output_dir: directory for ``metrics.json`` (and ``tensorboard/``).
        header: run-level fields (framework, dataset, size, batches, lrs, sample counts, config).
        is_root: only the root rank writes and logs.
        tensorboard: write TensorBoard events (:class:`hvdtrain.tensorboard.Board`, ``board``).
        broadcast_object: the framework's ``hvd.broadcast_object``, for the stops every rank
            takes together (:func:`stop_together`); None for a report that never stops a run.
    """

    def __init__(self, output_dir: str | os.PathLike, header: dict, is_root: bool,
                 tensorboard: bool = False,
                 broadcast_object: Callable[..., object] | None = None):
        self.broadcast_object = broadcast_object
        self.path = Path(output_dir) / METRICS_FILE
        self.header = dict(header)
        self.header.setdefault("versions", {})["hvdtrain"] = __version__
        self.epochs: list[EpochMetrics] = []
        self.is_root = is_root
        self.board = Board(output_dir, tensorboard, is_root)

    def add(self, metrics: EpochMetrics) -> None:
        """Record an epoch, log one line, rewrite ``metrics.json`` and write the epoch's
        TensorBoard scalars (rank 0 only)."""
        self.epochs.append(metrics)
        if not self.is_root:
            return
        self.write()
        self.board.epoch(metrics, self.header["global_batch"])
        log.info("epoch %d: train loss %.4f acc %.4f | test loss %.4f acc %.4f | lr %.5f | "
                 "%.0f samples/s", metrics.epoch, metrics.train_loss, metrics.train_accuracy,
                 metrics.test_loss, metrics.test_accuracy, metrics.lr, metrics.samples_per_sec)

    def write(self) -> None:
        """Rewrite ``metrics.json`` atomically."""
        write_json(self.path, self.to_dict())

    def check_divergence(self, metrics: EpochMetrics, cfg, num_classes: int) -> None:
        """Before an epoch's checkpoint, on every rank: when ``cfg.divergence_check`` is on and
        :func:`hvdtrain.guard.divergence` says the run diverged with ``metrics`` as its last
        epoch, rank 0 records the epoch and the verdict (``diverged`` in ``metrics.json``, the
        TensorBoard events) and prints the error; then every rank stops together
        (:func:`stop_together`) and raises.

        Raises:
            guard.DivergenceError: on every rank alike (the metrics are all-reduced), with
                ``reported`` True (rank 0 printed it already). The message names the epoch, the
                numbers and what to try; this epoch was not checkpointed, so the checkpoints in
                the output directory are the ones before it.
        """
        why = cfg.divergence_check and guard.divergence(self.epochs + [metrics],
                                                        cfg.warmup_epochs, num_classes,
                                                        cfg.lr_scaling)
        if not why:
            return
        message = (f"{why}; epoch {metrics.epoch} was not checkpointed: --resume from "
                   f"{self.path.parent} continues from the checkpoint before it")
        self.add(metrics)  # logged, written and on TensorBoard like any epoch
        self._stop_together("diverged", why, message)
        raise guard.DivergenceError(message, reported=True)

    @contextlib.contextmanager
    def stops_on_nonfinite(self) -> Iterator[None]:
        """Around the training loop, on every rank: a
        :class:`~hvdtrain.runtime.NonFiniteLossError` (``--on-nonfinite stop``; every rank raises
        it at the same step) is recorded as ``nonfinite_stop`` in ``metrics.json`` and printed by
        rank 0, then every rank stops together (:func:`stop_together`) and the error goes on with
        ``reported`` True.

        Raises:
            runtime.NonFiniteLossError: the one raised inside, now with ``reported`` True.
        """
        try:
            yield
        except runtime.NonFiniteLossError as exc:
            self._stop_together("nonfinite_stop", str(exc), str(exc))
            exc.reported = True
            raise

    def _stop_together(self, key: str, value, message: str) -> None:
        """Record why the run stops (``key`` in ``metrics.json``, written atomically), close the
        TensorBoard events and print ``message`` on rank 0; then :func:`stop_together` on every
        rank."""
        self.header[key] = value
        self.board.close()
        if self.is_root:
            self.write()
            print(f"hvdtrain: error: {message}", file=sys.stderr, flush=True)
        stop_together(self.broadcast_object, key)

    def to_dict(self) -> dict:
        """The whole report as a JSON-ready dict."""
        total_samples = sum(e.samples_per_sec * e.seconds for e in self.epochs)
        total_seconds = sum(e.seconds for e in self.epochs)
        return {**self.header,
                "epochs": [asdict(e) for e in self.epochs],
                "final_test_accuracy": self.epochs[-1].test_accuracy if self.epochs else None,
                "samples_per_sec": total_samples / total_seconds if total_seconds else None}


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
        finite; ``bad_ranks``: the ranks whose loss was not finite, :func:`ranks_where`).

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
