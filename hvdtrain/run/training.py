"""The training run, written once for both frameworks: start-up (rank set-up, resume, the run
header), the end of each epoch (sums -> evaluation -> divergence -> checkpoint -> record ->
TensorBoard), the stop on a preemption signal, and the end (rank agreement, ``metrics.json``).

A framework's trainer (:mod:`hvdtrain.torch.trainer`, :mod:`hvdtrain.keras.trainer`) builds the
model, the data and its :class:`~hvdtrain.run.hooks.Hooks`, runs the steps of each epoch, and
calls this module for everything else::

    info, signals = start(cfg, adapter.init)
    run = Run(cfg, info, signals, hooks, num_classes)
    resumed = run.resume()                       # before or after distribute(), per framework
    at = run.position(resumed)
    run.open(train_samples, test_samples, steps_per_epoch, resumed, at)
    with run.training():
        for epoch in ...:
            ...                                  # the framework's steps
            if agreed: run.preempted_stop(agreed, epoch, batch, step, partial)
            run.end_epoch(epoch, sums, lr, steps, step)
    return run.finish()

Every rank calls every method, in the same order: each holds collectives.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hvdtrain import runtime
from hvdtrain.accumulation import adasum_takes
from hvdtrain.files import CheckpointError
from hvdtrain.run import preempt
from hvdtrain.run.hooks import Hooks
from hvdtrain.run.report import EpochMetrics, RunReport, run_header, setup_logging, stop_together
from hvdtrain.tensorboard import StepMeter

log = logging.getLogger("hvdtrain")

# The per-rank sums an epoch's end all-reduces: loss x samples and correct predictions over the
# samples whose loss was finite (``n``), samples trained on (``processed``), wall seconds.
EPOCH_SUMS = ("loss", "correct", "n", "processed", "seconds")
# What a checkpoint's record must hold for a run to continue from it.
RECORD_KEYS = ("epoch", "size", "global_batch", "metrics")
# The options a resumed run takes from its own command line although the checkpoint was made
# with others (logged when they differ); the optimizer's state carries over. Both trainers apply
# each: --lr and the schedule's options through the schedule they rebuild from this run's
# options at its step, --momentum in the optimizer (hvdtrain.torch.checkpoint.load_optimizer;
# Keras's SGD is built with it), -k, --batch-size and the world size through the position
# (Run.position), --precision and --init-loss-scale through the loss scale (a new
# --init-loss-scale starts the scale again), the rest (no state) as they are.
RESUME_SETTINGS = ("lr", "momentum", "lr_scaling", "warmup_epochs", "lr_schedule",
                   "lr_min_ratio", "lr_steps", "batch_size", "backward_passes_per_step",
                   "precision", "init_loss_scale", "compression", "op", "on_nonfinite")
# The fields of an epoch in the checkpoint's metrics; an elastic run's epochs hold more
# (hvdtrain.run.elastic.ELASTIC_EXTRA: samples, sizes), which a fixed-size run does not record.
EPOCH_FIELDS = tuple(f.name for f in dataclasses.fields(EpochMetrics))


def resume_changes(saved_config: dict | None, cfg) -> dict[str, tuple]:
    """The :data:`RESUME_SETTINGS` this run sets otherwise than the checkpoint's run did:
    ``{option: (checkpoint's value, this run's value)}`` (none for a record without a
    configuration)."""
    if not saved_config:
        return {}
    return {name: (saved_config[name], getattr(cfg, name)) for name in RESUME_SETTINGS
            if name in saved_config and saved_config[name] != getattr(cfg, name)}


def start(cfg, init: Callable[..., object]):
    """Set up this rank: ``init(cfg.seed, device=cfg.device)`` (the adapter's, which pins the
    device, sets threads and Horovod's runtime settings, and seeds), rank-0 logging, the
    preemption signal handlers (from here on a signal stops the run after a step), and the
    warning for a Slurm job whose ranks landed on fewer hosts than it was given.

    Returns:
        ``(info, signals)``: the :class:`~hvdtrain.runtime.RankInfo` and the entered
        :class:`~hvdtrain.run.preempt.Preemption`.

    Raises:
        SystemExit: a ``--device`` this host cannot give every rank, or ``--op adasum`` at a
            world size that is not a power of 2 (Horovod 0.28.1's Adasum takes no other); on
            every rank, before any work.
    """
    try:
        info = init(cfg.seed, device=cfg.device)
    except ValueError as exc:
        raise SystemExit(f"hvdtrain: error: --device {cfg.device}: {exc}") from None
    if cfg.op == "adasum" and not adasum_takes(info.size):
        raise SystemExit(f"hvdtrain: error: --op adasum needs a power-of-2 number of ranks "
                         f"(Horovod 0.28.1 supports no other), got {info.size}: use --op average, "
                         "or launch 2, 4, 8 ... ranks")
    setup_logging(info.rank)
    signals = preempt.taken()  # with any signal that came since install_early()
    warning = runtime.slurm_hosts_warning(info.hosts)
    if warning and info.is_root:
        log.warning(warning)
    return info, signals


@dataclass
class Position:
    """Where a run starts.

    Attributes:
        epoch: epochs already done (0-based index of the first epoch to train).
        batch: micro-batches of that epoch already trained (a mid-epoch checkpoint at the same
            world size and data options), else 0.
        partial: this rank's sums of that epoch so far (``batch`` > 0), else None.
        moved: why the checkpoint's data position does not hold in this run (another world
            size or data options), or None.
    """
    epoch: int = 0
    batch: int = 0
    partial: dict | None = None
    moved: str | None = None


class Run:
    """One training run on every rank.

    Args:
        cfg: the :class:`~hvdtrain.config.TrainConfig`.
        info: this rank's :class:`~hvdtrain.runtime.RankInfo` (:func:`start`).
        signals: the entered :class:`~hvdtrain.run.preempt.Preemption` (:func:`start`).
        hooks: the framework's :class:`~hvdtrain.run.hooks.Hooks`.
        num_classes: classes of the dataset (the divergence check's chance level).

    Attributes:
        report: the :class:`~hvdtrain.run.report.RunReport` (after :meth:`open`).
        meter: rank 0's per-step TensorBoard :class:`~hvdtrain.tensorboard.StepMeter`.
    """

    def __init__(self, cfg, info, signals: preempt.Preemption, hooks: Hooks, num_classes: int):
        self.cfg, self.info, self.signals, self.hooks = cfg, info, signals, hooks
        self.num_classes = num_classes
        self.out = Path(cfg.output_dir)
        self.report: RunReport | None = None
        self.meter: StepMeter | None = None

    # -- start-up ---------------------------------------------------------------------------
    def resume(self) -> dict | None:
        """With ``--resume``: rank 0 loads the checkpoint into the model and optimizer
        (:meth:`Hooks.load`) and every rank gets its record; every rank's RNG state comes back
        unless the checkpoint was made mid-epoch (then the trainer calls :meth:`restore_rng`
        once the epoch's data iterator exists). Without ``--resume``: None.

        Returns:
            The checkpoint's record (``epoch``, ``batch``, ``step``, ``size``, ``global_batch``,
            ``config``, ``metrics``, ``counters``, ``partial_per_rank``, ``rng``: a list per
            rank, and framework state), or None (no ``--resume``, or ``--resume auto`` with no
            checkpoint file yet: a first run).

        Raises:
            SystemExit: no usable checkpoint (on every rank, so none waits for the others);
                with ``--resume auto`` only when checkpoint files exist but none loads.
        """
        if not self.cfg.resume:
            return None
        meta = None
        if self.info.is_root:
            try:
                if self.cfg.resume == "auto" and not any(
                        (self.out / f).exists() for f in self.hooks.checkpoint_files):
                    meta = {"fresh": True}
                else:
                    meta = dict(self.hooks.load(self.out))
                    missing = [k for k in RECORD_KEYS if k not in meta]
                    if missing:
                        raise ValueError(f"the checkpoint's record lacks {', '.join(missing)}: "
                                         "not a complete hvdtrain checkpoint")
                    meta["rng"] = meta.get("rng_per_rank") or [meta.get("rng")]
                    meta["batch"] = meta.get("batch") or 0
                    meta["counters"] = meta.get("counters") or {}
                    self._take_settings(meta)
            except (CheckpointError, ValueError) as exc:
                meta = {"error": str(exc)}
            except Exception as exc:  # any failure on rank 0 must reach the others, not hang
                meta = {"error": f"{type(exc).__name__}: {exc}"}
        meta = self.hooks.broadcast_object(meta, root_rank=0, name="hvdtrain.resume")
        if "error" in meta:
            raise SystemExit(f"hvdtrain: error: --resume: {meta['error']}")
        if "fresh" in meta:
            log.info("--resume auto: no checkpoint in %s yet, starting fresh", self.out)
            return None
        if not meta["batch"]:
            self.restore_rng(meta)
        return meta

    def _take_settings(self, meta: dict) -> None:
        """Rank 0, on a loaded checkpoint's record: log the options this run changes
        (:func:`resume_changes`; this run's values are the ones used and recorded), and with a
        new ``--init-loss-scale`` under fp16 mark the loss scale to start again
        (``restart_loss_scale``; the PyTorch trainer's scaler starts fresh without the saved
        ``scaler``)."""
        changes = resume_changes(meta.get("config"), self.cfg)
        if not changes:
            return
        log.info("--resume: this run's %s (the checkpoint's: %s); the optimizer's state "
                 "carries over", ", ".join(f"--{k.replace('_', '-')} {new!r}"
                                          for k, (_, new) in changes.items()),
                 ", ".join(f"{old!r}" for old, _ in changes.values()))
        if "init_loss_scale" in changes and self.cfg.precision == "fp16":
            meta["scaler"] = None
            meta["restart_loss_scale"] = True

    def restore_rng(self, resumed: dict) -> None:
        """This rank's saved RNG state (ranks the checkpoint did not have keep their seeds)."""
        if self.info.rank < len(resumed["rng"]) and resumed["rng"][self.info.rank] is not None:
            self.hooks.set_rng_state(resumed["rng"][self.info.rank])

    def position(self, resumed: dict | None) -> Position:
        """Where this run starts. A mid-epoch checkpoint (preemption) continues at its
        micro-batch at the same world size and data options; otherwise the shards or the data
        order differ, so the interrupted epoch restarts from its beginning (logged, and the RNG
        comes back as at the checkpoint)."""
        if not resumed:
            return Position()
        moved = preempt.mid_epoch_mismatch(resumed.get("config"), resumed["size"], self.cfg,
                                           self.info.size) or None
        if not moved and (resumed.get("config") or {}).get("elastic"):
            # Its step counters ran over resets at other sizes: the position is recomputed.
            moved = "it was made by an elastic run (--elastic)"
        batch = resumed["batch"]
        if batch and moved:
            log.warning("the checkpoint was made %d micro-batches into epoch %d, but %s: that "
                        "epoch restarts", batch, resumed["epoch"] + 1, moved)
            self.restore_rng(resumed)
            batch = 0
        partial = resumed["partial_per_rank"][self.info.rank] if batch else None
        return Position(resumed["epoch"], batch, partial, moved)

    def open(self, train_samples: int, test_samples: int, steps_per_epoch: int,
             resumed: dict | None, at: Position) -> RunReport:
        """Log the run header and open the report (``metrics.json``, TensorBoard) with the
        epochs a resumed run already has; restore the resumed run's step counters."""
        cfg, info = self.cfg, self.info
        header = run_header(self.hooks.framework, cfg, info, train_samples, test_samples,
                            steps_per_epoch, self.hooks.versions())
        if resumed:
            header["resumed_from"] = {"epoch": resumed["epoch"], "size": resumed["size"],
                                      "global_batch": resumed["global_batch"], "batch": at.batch}
            self.hooks.restore_counters(resumed["counters"])
        self.report = RunReport(self.out, header, is_root=info.is_root,
                                tensorboard=cfg.tensorboard,
                                broadcast_object=self.hooks.broadcast_object)
        self.record_counters()
        if resumed:
            # An elastic run's checkpoint: its epochs' samples and sizes are not carried over.
            self.report.epochs = [EpochMetrics(**{k: e[k] for k in EPOCH_FIELDS})
                                  for e in resumed["metrics"]]
            log.info("resumed after epoch %d%s (made with %d ranks, global batch %d)",
                     resumed["epoch"], f" and {at.batch} micro-batches" if at.batch else "",
                     resumed["size"], resumed["global_batch"])
        self.meter = StepMeter(self.report.board, cfg.log_every, cfg.global_batch(info.size),
                               cfg.batch_size * info.size)
        return self.report

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around the epochs: the signal handlers, the TensorBoard writer, and the stop that a
        non-finite loss with ``--on-nonfinite stop`` takes together
        (:meth:`~hvdtrain.run.report.RunReport.stops_on_nonfinite`)."""
        with self.signals, self.report.board, self.report.stops_on_nonfinite():
            yield

    def record_counters(self) -> dict:
        """Put the framework's skipped and overflowed step counts into the header (kept
        current, so a run stopped mid-epoch records them too). Returns them."""
        counters = self.hooks.counters()
        self.report.header["skipped_steps"] = counters["skipped"]
        self.report.header["overflow_steps"] = counters["overflows"]
        return counters

    # -- the epoch's end ----------------------------------------------------------------------
    def end_epoch(self, epoch: int, sums: dict[str, float], lr: float, steps: int,
                  step: int) -> EpochMetrics:
        """After epoch ``epoch`` (0-based) trained, on every rank: all-reduce the ranks'
        ``sums`` (:data:`EPOCH_SUMS`), average the buffers, evaluate, check for divergence
        (before the checkpoint), checkpoint, record and write the TensorBoard scalars.

        Args:
            sums: this rank's :data:`EPOCH_SUMS`.
            lr: the learning rate at the epoch's first step.
            steps: optimizer steps taken in the epoch (skipped ones left out).
            step: the run's step counter after the epoch (saved in the checkpoint).

        Raises:
            guard.DivergenceError: the run diverged (every rank; the epoch is not saved).
        """
        totals = self.hooks.allreduce_sums({key: sums[key] for key in EPOCH_SUMS},
                                           name="hvdtrain.train")
        self.hooks.sync_buffers()  # equal BatchNorm statistics before evaluating and saving
        test_loss, test_acc = self.hooks.evaluate()
        seconds = totals["seconds"] / self.info.size  # mean wall time over ranks
        n = max(totals["n"], 1)
        metrics = EpochMetrics(epoch + 1, totals["loss"] / n, totals["correct"] / n, test_loss,
                               test_acc, lr, steps, seconds, totals["processed"] / seconds)
        self.record_counters()
        # Before its checkpoint; rank 0 reports, then all stop together.
        self.report.check_divergence(metrics, self.cfg, self.num_classes)
        self.save(epoch + 1, 0, None, self.report.epochs + [metrics], step)
        self.report.add(metrics)
        return metrics

    def save(self, epochs_done: int, batch: int, partial: dict | None,
             epochs: list[EpochMetrics], step: int) -> None:
        """Checkpoint, every rank: each rank's RNG state and (mid-epoch) its share of the
        epoch's sums are gathered, and rank 0 writes them with the model and optimizer
        (:meth:`Hooks.save`).

        Args:
            epochs_done: epochs complete; batch: micro-batches of the next one trained.
            partial: this rank's state of the unfinished epoch (``batch`` > 0), else None.
            epochs: the metrics so far; step: the run's step counter.
        """
        per_rank = self.hooks.allgather_object(
            {"rng": self.hooks.rng_state(), "partial": partial}, name="hvdtrain.rng")
        if not self.info.is_root:
            return
        cfg, size = self.cfg, self.info.size
        self.hooks.save(self.out, {
            "epoch": epochs_done, "batch": batch, "step": step,
            "partial_per_rank": [r["partial"] for r in per_rank] if batch else None,
            "size": size, "global_batch": cfg.global_batch(size), "config": cfg.to_dict(),
            "rng": per_rank[0]["rng"], "rng_per_rank": [r["rng"] for r in per_rank],
            "counters": self.hooks.counters(), "metrics": [vars(e) for e in epochs]})

    # -- stops and the end --------------------------------------------------------------------
    def preempted_stop(self, agreed: str, epoch: int, batch: int, step: int,
                       partial: dict | None) -> None:
        """After the step in which some rank saw SIGTERM/SIGUSR1, on every rank: average the
        buffers, write the checkpoint (mid-epoch when ``batch`` > 0), record the stop in
        ``metrics.json`` and requeue under Slurm (rank 0), hold together until rank 0 has done
        all that (launchers end the whole job when the first rank exits), then raise.

        Args:
            agreed: the signal all ranks act on (:func:`~hvdtrain.run.preempt.agreed_signal`).
            epoch: the 0-based epoch stopped in; batch: micro-batches of it trained.
            step: the run's step counter; partial: this rank's sums of the epoch so far.

        Raises:
            preempt.Preempted: always (exit code 75).
        """
        self.hooks.sync_buffers()
        self.record_counters()
        self.save(epoch, batch, partial if batch else None, self.report.epochs, step)
        waited = self.hooks.allgather_object(self.signals.seconds_since_signal(),
                                             name="hvdtrain.preempt.saved")
        seconds = max((w for w in waited if w is not None), default=None)
        preempt.record_stop(self.report, agreed, epoch + 1, batch, step, seconds,
                            self.cfg.requeue, self.info.is_root)
        stop_together(self.hooks.broadcast_object, "preempt.done")
        raise preempt.Preempted(agreed, seconds)

    def finish(self) -> dict:
        """Every rank: whether all ranks hold the same model (``ranks_agree``: a difference
        would be a bug worth knowing about); rank 0 writes ``metrics.json``.

        Returns:
            The run report (the content of ``metrics.json``), on every rank.
        """
        checksums = self.hooks.allgather_object(self.hooks.checksum(), name="hvdtrain.agree")
        self.report.header["ranks_agree"] = len(set(checksums)) == 1
        if self.info.is_root:
            self.report.write()
        return self.report.to_dict()
