"""The run report every trainer and mode writes: one JSON schema (:class:`RunHeader`,
:class:`EpochMetrics`) for PyTorch and Keras, written by rank 0.

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
# What metrics.json holds beside the RunHeader: the epochs (EpochMetrics; elastic runs add
# "samples" and "sizes"), the last epoch's test accuracy and the run's samples per second.
RUN_RESULTS = ("epochs", "final_test_accuracy", "samples_per_sec")
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


@dataclass
class RunHeader:
    """The run-level fields of ``metrics.json``, the same in every trainer and mode (the
    schema's one declaration; :func:`run_header` fills it, :meth:`RunReport.to_dict` adds
    ``epochs``, ``final_test_accuracy`` and ``samples_per_sec``; elastic runs add ``samples``
    and ``sizes`` to each epoch). Learning rates are per optimizer step; batches in samples."""
    framework: str
    dataset: str
    size: int
    hosts: int
    local_batch: int
    backward_passes_per_step: int
    global_batch: int
    base_lr: float
    scaled_lr: float
    lr_scaling: str
    warmup_epochs: float
    steps_per_epoch: int
    train_samples: int
    test_samples: int
    threads_per_rank: int
    device: str
    precision: str
    horovod_settings: dict | None
    config: dict
    versions: dict
    large_batch_warning: str | None
    elastic: bool
    recipe: dict  # the dataset recipe's options this run took (hvdtrain.datasets.recipes)
    # Filled in by the run where it applies: the checkpoint resumed from, optimizer steps
    # skipped for non-finite losses and (fp16) for overflowing gradients (kept current, so a run
    # stopped in its first epoch records them too), whether every rank ended with the same
    # weights, the signal that stopped the run after a checkpoint (hvdtrain.run.preempt), and
    # why a run stopped with an error (the divergence check; a non-finite loss with
    # --on-nonfinite stop).
    resumed_from: dict | None = None
    skipped_steps: int = 0
    overflow_steps: int = 0
    ranks_agree: bool | None = None
    preempted: dict | None = None
    diverged: str | None = None
    nonfinite_stop: str | None = None
    # The engine that scheduled the ranks where not a launcher (horovodrun, mpirun, srun):
    # "spark", "spark-driver", "ray" (HVDTRAIN_ENGINE, set by hvdtrain.spark / hvdtrain.ray).
    engine: str | None = None


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
                                                                              info.size, k),
                                        warmup=not cfg.elastic)
    if warning and info.rank == 0:
        log.warning("warning: %s", warning)
    if cfg.recipe:
        log.info("--dataset %s defaults: %s (options given on the command line win)", cfg.dataset,
                 ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in cfg.recipe.items()))
    if info.horovod_settings:
        log.info("Horovod settings: %s", tuning.describe_settings(info.horovod_settings))
    engine = os.environ.get("HVDTRAIN_ENGINE") or None
    if engine:
        log.info("engine: %s (ranks scheduled by %s)", engine, engine.split("-")[0].capitalize())
    return asdict(RunHeader(
        framework=framework, dataset=cfg.dataset, size=info.size, hosts=info.hosts,
        local_batch=cfg.batch_size, backward_passes_per_step=k,
        global_batch=cfg.global_batch(info.size), base_lr=cfg.lr, scaled_lr=scaled,
        lr_scaling=cfg.lr_scaling, warmup_epochs=cfg.warmup_epochs,
        steps_per_epoch=steps_per_epoch, train_samples=train_samples, test_samples=test_samples,
        threads_per_rank=info.threads, device=info.device, precision=cfg.precision,
        horovod_settings=info.horovod_settings, config=cfg.to_dict(), versions=dict(versions),
        large_batch_warning=warning, elastic=bool(cfg.elastic), recipe=dict(cfg.recipe),
        engine=engine))


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
