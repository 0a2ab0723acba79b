"""One ``TrainConfig`` for ``hvdtrain train``, validated before any framework or process starts.

Global batch = local batch (``batch_size``) x ``backward_passes_per_step`` x ``size``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdtrain.runtime import DEVICES
from hvdtrain.schedule import LR_SCALING_RULES

FRAMEWORKS = ("torch", "keras")
# Keras 3 backends hvdtrain.keras runs on (KERAS_BACKEND); jax has no Horovod binding.
KERAS_BACKENDS = ("tensorflow", "torch")
DATASETS = ("digits", "mnist", "synthetic")
COMPRESSIONS = ("none", "fp16")
OPS = ("average", "adasum")
PRECISIONS = ("fp32", "bf16", "fp16")
RESUME_MODES = ("", "yes", "auto")  # --resume: off, required, when a checkpoint exists


class ConfigError(ValueError):
    """An option value that cannot work; the message says which option and what to change."""


@dataclass
class TrainConfig:
    """Everything ``hvdtrain train`` needs.

    Attributes:
        framework: ``"torch"`` or ``"keras"``.
        dataset: ``"digits"`` (scikit-learn's 1,797 8x8 handwritten digits, offline, for quick
            checks), ``"mnist"`` (60,000 + 10,000 28x28 handwritten digits, cached offline:
            :func:`hvdtrain.datasets.mnist.load_mnist`) or ``"synthetic"`` (random images and labels, for
            throughput).
        data_dir: ``--dataset mnist``: read MNIST from this directory's four IDX files (or an
            ``.npz`` with ``x_train, y_train, x_test, y_test``) instead of the cache; empty: the
            cache.
        epochs: passes over the training split, >= 1.
        batch_size: local batch: samples per micro-batch on one rank, >= 1.
        backward_passes_per_step: micro-batches accumulated per optimizer step (k), >= 1.
        lr: base learning rate, tuned for one process with one local batch per step, > 0.
        momentum: SGD momentum in [0, 1).
        dropout: dropout probability before the model's last layer, in [0, 1).
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"`` (see :mod:`hvdtrain.schedule`).
        warmup_epochs: epochs of gradual warmup from ``lr`` to the scaled rate, >= 0.
        compression: gradient compression for the all-reduce, ``"none"`` or ``"fp16"``.
        op: ``"average"`` or ``"adasum"`` reduction of gradients.
        seed: base seed; rank r uses ``runtime.rank_seed(seed, r)``.
        output_dir: where rank 0 writes ``checkpoint.*`` and ``metrics.json``.
        test_fraction: held-out share of the dataset, in (0, 1).
        synthetic_samples: size of the synthetic dataset.
        progress: show a progress bar on rank 0.
        resume: ``""`` (start fresh), ``"yes"`` (continue from ``output_dir``'s checkpoint; none
            is an error) or ``"auto"`` (continue when a checkpoint exists, else start fresh: one
            job script serves the first run and every requeue). ``True``/``False`` mean
            ``"yes"``/``""``.
        requeue: after a preemption checkpoint made on ``SIGUSR1`` in a Slurm batch job, requeue
            the job (``scontrol requeue``; :mod:`hvdtrain.run.preempt`).
        on_nonfinite: what to do when any rank's loss is NaN/Inf: ``"skip"`` the optimizer step
            on every rank, or ``"stop"`` the job (PyTorch).
        fault_nan_at: fault injection for drills and tests, ``"RANK:STEP"``: that rank's loss
            becomes NaN at that optimizer step (0-based); empty for none.
        fault_slow_from: fault drill for tests and drills, ``"STEP:SECONDS"``: from optimizer
            step STEP (0-based, counted over the run) on, every rank sleeps SECONDS before each
            optimizer step, as on a slow or overloaded node. A signal or a kill sent once an
            earlier epoch is recorded then lands in a known epoch on any machine, however fast.
            Training math is unchanged; empty for none.
        elastic: train with Horovod Elastic (launch with ``hvdtrain launch --elastic``).
        commit_every: elastic: commit the training state every this many optimizer steps.
        device: ``"auto"`` (a GPU per rank when the host has them, else the CPU), ``"cpu"`` or
            ``"cuda"`` (:func:`hvdtrain.runtime.choose_device`).
        precision: ``"fp32"``, ``"bf16"`` (autocast / Keras ``mixed_bfloat16``, also on CPUs) or
            ``"fp16"`` (autocast with a dynamic loss scale: ``torch.amp.GradScaler``, Keras
            ``LossScaleOptimizer``).
        init_loss_scale: fp16: the dynamic loss scale's starting value (``GradScaler``'s
            ``init_scale``, 2**16); it halves after each step whose gradients overflow and
            doubles after 2,000 clean steps.
        keras_backend: ``--framework keras``: Keras 3's backend, ``"tensorflow"`` or ``"torch"``;
            empty: the ``KERAS_BACKEND`` variable, else ``"tensorflow"`` (filled in by
            :meth:`validate`).
        batchnorm: a BatchNorm layer after each convolution of the model; its running
            statistics are averaged over ranks (``sync_buffers``) before every evaluation and
            checkpoint.
        tensorboard: rank 0 writes TensorBoard events to ``<output_dir>/tensorboard``
            (:mod:`hvdtrain.tensorboard`).
        log_every: optimizer steps between the per-step TensorBoard points, >= 1.
        divergence_check: stop with an error when training diverges after warmup
            (:func:`hvdtrain.guard.divergence`), keeping the last good checkpoint.
    """
    framework: str = "torch"
    dataset: str = "digits"
    epochs: int = 15
    batch_size: int = 16
    backward_passes_per_step: int = 1
    lr: float = 0.02
    momentum: float = 0.9
    dropout: float = 0.0
    lr_scaling: str = "linear"
    warmup_epochs: float = 2.0
    compression: str = "none"
    op: str = "average"
    seed: int = 42
    output_dir: str = "runs/latest"
    test_fraction: float = 0.2
    synthetic_samples: int = 2048
    progress: bool = True
    resume: str = ""
    requeue: bool = True
    on_nonfinite: str = "skip"
    fault_nan_at: str = ""
    fault_slow_from: str = ""
    elastic: bool = False
    commit_every: int = 10
    device: str = "auto"
    precision: str = "fp32"
    batchnorm: bool = False
    init_loss_scale: float = 65536.0
    keras_backend: str = ""
    data_dir: str = ""
    tensorboard: bool = True
    log_every: int = 10
    divergence_check: bool = True

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

    def to_dict(self) -> dict:
        """A JSON-ready copy of the options."""
        return asdict(self)

    def validate(self) -> "TrainConfig":
        """Check every option; return ``self``.

        Raises:
            ConfigError: the first option that cannot work, named with the flag to change.
        """
        def choice(flag, value, allowed):
            if value not in allowed:
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}; got {value!r}")

        choice("--framework", self.framework, FRAMEWORKS)
        if self.framework == "keras":
            if not self.keras_backend:
                self.keras_backend = os.environ.get("KERAS_BACKEND") or "tensorflow"
                if self.keras_backend not in KERAS_BACKENDS:
                    raise ConfigError(f"KERAS_BACKEND={self.keras_backend} is not one hvdtrain "
                                      f"runs on: use {' or '.join(KERAS_BACKENDS)} (or "
                                      "--keras-backend)")
            choice("--keras-backend", self.keras_backend, KERAS_BACKENDS)
        elif self.keras_backend:
            raise ConfigError("--keras-backend is for --framework keras; drop it")
        choice("--dataset", self.dataset, DATASETS)
        choice("--lr-scaling", self.lr_scaling, LR_SCALING_RULES)
        choice("--compression", self.compression, COMPRESSIONS)
        choice("--op", self.op, OPS)
        for flag, value in (("--epochs", self.epochs), ("--batch-size", self.batch_size),
                            ("--backward-passes-per-step", self.backward_passes_per_step),
                            ("--synthetic-samples", self.synthetic_samples)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be a whole number >= 1; got {value!r}")
        choice("--on-nonfinite", self.on_nonfinite, ("skip", "stop"))
        if isinstance(self.resume, bool):
            self.resume = "yes" if self.resume else ""
        choice("--resume", self.resume, RESUME_MODES)
        choice("--device", self.device, DEVICES)
        choice("--precision", self.precision, PRECISIONS)
        if self.fault_nan_at:
            self.fault()
        self.slow_fault()
        if self.elastic:
            if self.backward_passes_per_step != 1 or self.resume:
                raise ConfigError("--elastic trains with -k 1 and without --resume (it keeps "
                                  "its own state); drop those options")
            if self.precision != "fp32" or self.batchnorm or self.device == "cuda":
                raise ConfigError("--elastic trains in fp32 on the CPU, without --batchnorm, "
                                  "for now; drop --precision/--batchnorm/--device cuda")
            if self.op != "average":
                raise ConfigError("--elastic trains with --op average: Adasum needs a "
                                  "power-of-2 number of workers, which a reset may change; "
                                  "drop --op adasum")
            if self.warmup_epochs not in (0, type(self).warmup_epochs):
                raise ConfigError("--elastic trains without warmup (the world size, and so "
                                  "the scaled rate, changes at every reset); drop "
                                  "--warmup-epochs")
        if self.data_dir:
            if self.dataset != "mnist":
                raise ConfigError("--data-dir is for --dataset mnist (IDX files or an .npz); "
                                  "drop it or use --dataset mnist")
            if not Path(self.data_dir).expanduser().exists():
                raise ConfigError(f"--data-dir {self.data_dir!r} does not exist; pass the "
                                  "directory with MNIST's four IDX files or an .npz file")
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise ConfigError(f"--log-every must be a whole number >= 1; got {self.log_every!r}")
        if not isinstance(self.commit_every, int) or self.commit_every < 1:
            raise ConfigError(f"--commit-every must be a whole number >= 1; got "
                              f"{self.commit_every!r}")
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
