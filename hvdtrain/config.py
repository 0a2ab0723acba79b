"""One ``TrainConfig`` for ``hvdtrain train``, validated before any framework or process starts.

Global batch = local batch (``batch_size``) x ``backward_passes_per_step`` x ``size``.
"""
from __future__ import annotations

import math
import os
import tempfile
import argparse
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hvdtrain.runtime import DEVICES
from hvdtrain import progress, schedule
from hvdtrain.schedule import LR_SCALING_RULES, LR_SCHEDULES

FRAMEWORKS = ("torch", "keras")
# Keras 3 backends hvdtrain.keras runs on (KERAS_BACKEND); jax has no Horovod binding.
KERAS_BACKENDS = ("tensorflow", "torch")

DATASETS = ("digits", "mnist", "synthetic")
COMPRESSIONS = ("none", "fp16")
OPS = ("average", "adasum")
PRECISIONS = ("fp32", "bf16", "fp16")
RESUME_MODES = ("", "yes", "auto")  # --resume: off, required, when a checkpoint exists


def default_keras_backend() -> str:
    """The Keras backend a job gets without ``--keras-backend``: ``$KERAS_BACKEND``, else Keras's
    own default, ``tensorflow``."""
    return os.environ.get("KERAS_BACKEND") or "tensorflow"


class ConfigError(ValueError):
    """An option value that cannot work; the message says which option and what to change."""


def option(default, help: str, *, choices: tuple | None = None, flags: tuple[str, ...] = (),
           minimum: int | None = None, elastic: str = "", hidden: bool = False,
           **argparse_options):
    """A :class:`TrainConfig` field with its command-line declaration: the default, the help
    (the option's documentation: units, ranges, sources), the allowed values and the least
    whole number (both checked by :meth:`TrainConfig.validate`), its flags (``--field-name``
    unless given), why an elastic run cannot honour it (``elastic``: refused there, with this
    reason, when not at its default; empty: elastic runs honour it), whether ``--help`` leaves
    it out (``hidden``: the tests' fault drills; still accepted) and any other
    ``argparse.add_argument`` settings (``action``, ``type``, ``nargs``, ``const``, ``metavar``).
    Its place in ``--help`` is :data:`OPTION_GROUPS`.
    """
    return field(default=default, metadata={
        "help": help, "choices": choices, "flags": flags, "minimum": minimum, "elastic": elastic,
        "hidden": hidden, "argparse": argparse_options})


@dataclass
class TrainConfig:
    """Everything ``hvdtrain train`` needs: each option declared once, here (default, help,
    allowed values, flags, modes); ``hvdtrain train --help`` and :meth:`validate` read it.

    Global batch = ``batch_size`` x ``backward_passes_per_step`` x size. A dataset's own
    defaults (:data:`hvdtrain.datasets.recipes.RECIPES`) replace these where the command line
    leaves an option out (:meth:`from_options`); ``recipe`` records which.
    """
    framework: str = option("torch", "the framework: torch or keras", choices=FRAMEWORKS)
    dataset: str = option(
        "digits", "digits (scikit-learn's 1,797 8x8 digits, offline, quick checks), mnist "
        "(60,000 + 10,000 28x28 digits, cached offline) or synthetic (random images, for "
        "throughput)", choices=DATASETS)
    epochs: int = option(15, "passes over the training split, >= 1", minimum=1)
    batch_size: int = option(16, "local batch: samples per micro-batch on each rank, >= 1",
                             minimum=1)
    backward_passes_per_step: int = option(
        1, "micro-batches accumulated per optimizer step (k; one all-reduce each), >= 1",
        flags=("--backward-passes-per-step", "-k"), minimum=1,
        elastic="trains with -k 1 (Horovod Elastic's committed state holds no open group)")
    lr: float = option(0.02, "single-process learning rate (one local batch per step), > 0; "
                       "scaled by --lr-scaling")
    momentum: float = option(0.9, "SGD momentum, in [0, 1)")
    dropout: float = option(0.0, "dropout probability before the model's last layer, in [0, 1)")
    lr_scaling: str = option("linear", "learning-rate scaling with the global batch: linear "
                             "(Goyal et al. 2017), sqrt or none", choices=LR_SCALING_RULES)
    warmup_epochs: float = option(
        2.0, "epochs of gradual warmup from --lr to the scaled rate (Goyal et al. 2017), >= 0",
        elastic="trains without warmup (the world size, and so the scaled rate, changes at every "
                "reset)")
    lr_schedule: str = option(
        "constant", "the rate after warmup: constant, cosine (down to --lr-min-ratio of the "
        "peak at the last step; Loshchilov & Hutter 2017) or step (/10 at each of --lr-steps; "
        "Goyal et al. 2017)", choices=LR_SCHEDULES)
    lr_min_ratio: float = option(0.1, "--lr-schedule cosine: the last step's rate as a "
                                 "fraction of the peak, in [0, 1] (nanoGPT: 0.1)")
    lr_steps: str = option("", "--lr-schedule step: comma-separated epochs (may be fractional) "
                           "at which the rate drops by 10x, after warmup and before the end (e.g. "
                           "8,11 for 15 epochs with 2 of warmup)", metavar="EPOCHS")
    compression: str = option("none", "gradient compression for the all-reduce: none or fp16",
                              choices=COMPRESSIONS)
    op: str = option("average", "reduction of the gradients: average or adasum", choices=OPS,
                     elastic="trains with --op average: Adasum needs a power-of-2 number of "
                             "workers, which a reset may change")
    seed: int = option(42, "base seed; rank r uses runtime.rank_seed(seed, r)")
    output_dir: str = option("runs/latest", "where rank 0 writes checkpoints, metrics.json and "
                             "TensorBoard events")
    test_fraction: float = option(0.2, "held-out share of digits/synthetic, in (0, 1)")
    synthetic_samples: int = option(2048, "size of the synthetic dataset, >= 1", minimum=1)
    progress: bool = option(
        True, "no progress output on rank 0. Rank 0 shows a progress bar when its stderr is a "
        "terminal, else (a log file; under horovodrun or mpirun, whose ranks write to pipes) a "
        "line every HVDTRAIN_PROGRESS_SECONDS (default 30) and one line per epoch; "
        "HVDTRAIN_PROGRESS=bar, lines or off chooses", flags=("--no-progress",),
        action="store_false")
    resume: str = option(
        "", "continue from --output-dir's checkpoint; '--resume auto' starts fresh when there "
        "is none (one job script for first runs and requeues)", choices=RESUME_MODES,
        nargs="?", const="yes", elastic="keeps its own state (commits), not --resume")
    requeue: bool = option(True, "after a SIGUSR1 checkpoint in a Slurm batch job, do not run "
                           "'scontrol requeue' (see README, Slurm)", flags=("--no-requeue",),
                           action="store_false")
    on_nonfinite: str = option("skip", "when any rank's loss is NaN/Inf: skip the optimizer "
                               "step on every rank, or stop the job", choices=("skip", "stop"))
    fault_nan_at: str = option("", "fault drill: RANK's loss becomes NaN at optimizer STEP "
                               "(0-based)", metavar="RANK:STEP", hidden=True)
    fault_slow_from: str = option(
        "", "fault drill: from optimizer STEP (0-based, over the run) on, every rank sleeps "
        "SECONDS (<= 60) before each step, as on a slow node; tests time signals with it",
        metavar="STEP:SECONDS", hidden=True)
    elastic: bool = option(False, "Horovod Elastic training (launch with hvdtrain launch "
                           "--elastic)", action="store_true")
    commit_every: int = option(10, "elastic: commit the training state every N optimizer "
                               "steps, >= 1", minimum=1)
    device: str = option("auto", "auto (a GPU per rank when the host has them, else the CPU), "
                         "cpu or cuda", choices=DEVICES)
    precision: str = option("fp32", "fp32, bf16 (mixed, also on CPUs) or fp16 (mixed, with a "
                            "dynamic loss scale)", choices=PRECISIONS,
                            elastic="trains in fp32 on the CPU, for now")
    batchnorm: bool = option(False, "BatchNorm after each convolution (statistics averaged over "
                             "ranks before every evaluation and checkpoint)",
                             action="store_true",
                             elastic="trains in fp32 on the CPU without --batchnorm, for now")
    init_loss_scale: float = option(65536.0, "fp16: the dynamic loss scale's starting value "
                                    "(halves on overflow, doubles after 2,000 clean steps)")
    keras_backend: str = option("", "--framework keras: Keras 3's backend, tensorflow or torch "
                                "(default: $KERAS_BACKEND, else tensorflow)",
                                metavar="{" + ",".join(KERAS_BACKENDS) + "}")
    data_dir: str = option("", "--dataset mnist: a directory with the four IDX files (or an "
                           ".npz with x_train, y_train, x_test, y_test) instead of the cache")
    tensorboard: bool = option(True, "TensorBoard events in OUTPUT_DIR/tensorboard (rank 0): "
                               "tensorboard --logdir OUTPUT_DIR",
                               action=argparse.BooleanOptionalAction)
    log_every: int = option(10, "optimizer steps between per-step TensorBoard points, >= 1",
                            minimum=1)
    divergence_check: bool = option(
        True, "train on when the loss or accuracy says the run diverged after warmup",
        flags=("--no-divergence-check",), action="store_false")
    recipe: dict = field(default_factory=dict, metadata={"cli": False})

    @classmethod
    def from_options(cls, given: dict) -> "TrainConfig":
        """The configuration for the options a user gave (``given``: field -> value): the
        dataset's recipe (:data:`hvdtrain.datasets.recipes.RECIPES`) fills what ``given``
        leaves out, then these defaults; ``recipe`` records the recipe's values used. An
        elastic run takes none of the recipe's options it cannot honour (those declared with an
        ``elastic`` reason, e.g. warmup). Not validated (call :meth:`validate`).
        """
        from hvdtrain.datasets.recipes import RECIPES
        dataset = given.get("dataset", cls.__dataclass_fields__["dataset"].default)
        refused = {f.name for f in cli_fields() if given.get("elastic") and f.metadata["elastic"]}
        used = {k: v for k, v in RECIPES.get(dataset, {}).items()
                if k not in given and k not in refused}
        return cls(**{**used, **given}, recipe=used)

    def global_batch(self, size: int) -> int:
        """Samples per optimizer step across all ranks: ``batch_size x k x size``."""
        return self.batch_size * self.backward_passes_per_step * size

    def fault(self) -> tuple[int, int] | None:
        """``(rank, step)`` parsed from ``fault_nan_at``, or None.

        Raises:
            ConfigError: not of the form ``RANK:STEP`` with whole numbers.
        """
        if not self.fault_nan_at:
            return None
        rank, _, step = self.fault_nan_at.partition(":")
        if not (rank.isdigit() and step.isdigit()):
            raise ConfigError(f"--fault-nan-at must be RANK:STEP, e.g. 1:5; got "
                              f"{self.fault_nan_at!r}")
        return int(rank), int(step)

    def slow_fault(self) -> tuple[int, float] | None:
        """``(step, seconds)`` parsed from ``fault_slow_from``, or None.

        Raises:
            ConfigError: not of the form ``STEP:SECONDS`` with a whole STEP >= 0 and
                0 <= SECONDS <= 60.
        """
        if not self.fault_slow_from:
            return None
        step, _, seconds = self.fault_slow_from.partition(":")
        try:
            pause = float(seconds)
        except ValueError:
            pause = -1.0
        if not step.isdigit() or not 0 <= pause <= 60:
            raise ConfigError(f"--fault-slow-from must be STEP:SECONDS with SECONDS in [0, 60], "
                              f"e.g. 75:0.05; got {self.fault_slow_from!r}")
        return int(step), pause

    def decay(self, steps_per_epoch: int) -> schedule.Decay:
        """The decay after warmup (``--lr-schedule``) in optimizer steps at ``steps_per_epoch``
        (:func:`hvdtrain.schedule.decay`); a resumed run at another world size gets the same
        curve over its epochs.

        Raises:
            ConfigError: ``--lr-steps`` is not a list of epochs after warmup, before the end.
        """
        try:
            epochs = tuple(float(e) for e in self.lr_steps.split(",") if e.strip())
            return schedule.decay(self.lr_schedule, epochs=self.epochs,
                                  steps_per_epoch=steps_per_epoch,
                                  warmup_epochs=self._warmup,
                                  min_ratio=self.lr_min_ratio, step_epochs=epochs)
        except ValueError as exc:
            raise ConfigError(f"--lr-steps {self.lr_steps!r}: {exc}; {self._steps_advice()}") \
                from None

    @property
    def _warmup(self) -> float:
        """The warmup this run has, in epochs: ``warmup_epochs``; none for elastic runs."""
        return 0.0 if self.elastic else self.warmup_epochs

    def _steps_advice(self) -> str:
        """What to give ``--lr-steps`` in this run: drops at about half and three quarters of
        the epochs after warmup, each strictly after warmup's end and before the last epoch's
        end (:func:`hvdtrain.schedule.decay`'s rule), whole epochs where they fit (e.g. 8,11 for
        15 epochs with 2 of warmup; 1.75,1.88 for 2 with 1.5), or what to change when none
        fits."""
        start = self._warmup
        if not (math.isfinite(start) and start >= 0):
            return "give --warmup-epochs a number >= 0 first"
        picks = []
        for at in (start + f * (self.epochs - start) for f in (0.5, 0.75)):
            # a whole epoch after warmup's end, else the point itself, shortened where that
            # stays inside (start, epochs); printed so that it parses back to the same number
            fits = [e for e in (math.floor(at), round(at, 2), round(at, 4), at)
                    if start < e < self.epochs]
            if fits and fits[0] not in picks:
                picks.append(fits[0])
        if not picks:
            return (f"no epoch lies after {start:g} of warmup and before {self.epochs}: lower "
                    "--warmup-epochs or raise --epochs")
        return "e.g. --lr-steps " + ",".join(str(e) for e in picks)

    def to_dict(self) -> dict:
        """A JSON-ready copy of the options."""
        return asdict(self)

    def validate(self) -> "TrainConfig":
        """Check every option; return ``self``.

        Raises:
            ConfigError: the first option that cannot work, named with the flag to change.
        """
        if isinstance(self.resume, bool):
            self.resume = "yes" if self.resume else ""
        if self.framework == "keras" and not self.keras_backend:
            self.keras_backend = default_keras_backend()
            if self.keras_backend not in KERAS_BACKENDS:
                raise ConfigError(f"KERAS_BACKEND={self.keras_backend} is not one hvdtrain "
                                  f"runs on: use {' or '.join(KERAS_BACKENDS)} (or "
                                  "--keras-backend)")
        for f in cli_fields():
            value, meta = getattr(self, f.name), f.metadata
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ConfigError(f"{flag_of(f)} must be one of {', '.join(meta['choices'])}; "
                                  f"got {value!r}")
            if meta["minimum"] is not None and (isinstance(value, bool) or not isinstance(
                    value, int) or value < meta["minimum"]):
                raise ConfigError(f"{flag_of(f)} must be a whole number >= {meta['minimum']}; "
                                  f"got {value!r}")
        if self.framework == "keras":
            if self.keras_backend not in KERAS_BACKENDS:
                raise ConfigError(f"--keras-backend must be one of {', '.join(KERAS_BACKENDS)}; "
                                  f"got {self.keras_backend!r}")
        elif self.keras_backend:
            raise ConfigError("--keras-backend is for --framework keras; drop it")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ConfigError(f"--lr-min-ratio must be in [0, 1]; got {self.lr_min_ratio!r}")
        if self.lr_steps and self.lr_schedule != "step":
            raise ConfigError("--lr-steps is for --lr-schedule step; drop it or add "
                              "--lr-schedule step")
        if self.lr_schedule == "step":
            if not self.lr_steps:
                raise ConfigError("--lr-schedule step needs --lr-steps, the epochs at which the "
                                  "rate drops 10x (after warmup, before the end); "
                                  + self._steps_advice())
            self.decay(1)  # the epochs parse and lie after warmup, before the end
        if self.fault_nan_at:
            self.fault()
        self.slow_fault()
        if self.elastic:
            if self.device == "cuda":
                raise ConfigError("--elastic trains in fp32 on the CPU, for now; drop --device "
                                  "cuda")
            for f in cli_fields():
                value, why = getattr(self, f.name), f.metadata["elastic"]
                if why and value != f.default and not (f.name == "warmup_epochs" and value == 0):
                    raise ConfigError(f"--elastic {why}; drop {flag_of(f)}")
        if self.data_dir:
            if self.dataset != "mnist":
                raise ConfigError("--data-dir is for --dataset mnist (IDX files or an .npz); "
                                  "drop it or use --dataset mnist")
            if not Path(self.data_dir).expanduser().exists():
                raise ConfigError(f"--data-dir {self.data_dir!r} does not exist; pass the "
                                  "directory with MNIST's four IDX files or an .npz file")
        try:  # rank 0's progress output (hvdtrain.progress): a bad variable, named now
            progress.check_env()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.init_loss_scale > 0:
            raise ConfigError(f"--init-loss-scale must be > 0; got {self.init_loss_scale!r}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0; got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1); got {self.momentum!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1); got {self.dropout!r}")
        if not self.warmup_epochs >= 0:
            raise ConfigError(f"--warmup-epochs must be >= 0; got {self.warmup_epochs!r}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"--test-fraction must be in (0, 1); got {self.test_fraction!r}")
        if self.op == "adasum" and self.framework == "keras":
            raise ConfigError("--op adasum is not available with --framework keras (hvdtrain's "
                              "Keras optimizer averages); use --op average")
        if self.framework == "keras" and self.precision == "fp16" and self.compression == "fp16":
            raise ConfigError("--precision fp16 with --compression fp16 would all-reduce Keras's "
                              "unscaled gradients in float16, where small ones underflow; use "
                              "--compression none")
        if self.op == "adasum" and self.precision == "fp16":
            raise ConfigError("--precision fp16 needs a step the loss scaler can skip, which "
                              "--op adasum cannot do (the update is combined inside step()); "
                              "use --precision bf16 or --op average")
        if self.op == "adasum" and self.lr_scaling == "linear":
            raise ConfigError("--op adasum adapts the step size itself; use --lr-scaling none "
                              "(or sqrt) with it, not linear")
        check_writable_dir(self.output_dir, "--output-dir")
        return self


def cli_fields() -> list:
    """The :class:`TrainConfig` fields that are command-line options, in declaration order."""
    return [f for f in fields(TrainConfig) if f.metadata.get("cli", True)]


def flag_of(f) -> str:
    """The first flag of option field ``f`` (``--batch-size``; ``--no-progress``)."""
    return (f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",))[0]


def check_writable_dir(path: str, flag: str) -> None:
    """Make sure ``path`` is (or can be created as) a directory this process can write into.

    Raises:
        ConfigError: it is a file, cannot be created, or cannot be written (read-only mount,
            permissions). The message names ``flag`` and the path.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path!r} is a file, not a directory; pass a directory path")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".hvdtrain-write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r} is not writable ({exc.strerror or exc}); "
                          "pass a directory you can write to") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r} is not writable; pass a directory you can write to")
