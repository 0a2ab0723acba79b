"""Preemption: stop at an optimizer-step boundary when the scheduler asks, checkpoint, exit with a
documented code, and (under Slurm) requeue the job. Framework-free: both trainers use it.

Schedulers announce the end of a job with a signal: Slurm sends ``SIGTERM`` on ``scancel``,
preemption and at the time limit (then ``SIGKILL`` after ``KillWait``, 30 s by default), and
``SIGUSR1`` ``T`` seconds before the time limit when the job asks for it (``sbatch
--signal=USR1@T``); Kubernetes sends ``SIGTERM`` and kills after the pod's grace period.
:class:`Preemption` catches both signals (so the process is not killed at once) and records
which came. Ranks may get the signal at different moments, so they agree through the training
step's own collectives: every optimizer step each rank contributes ``[SIGTERM seen, SIGUSR1
seen]`` to an all-reduce (PyTorch: a 2-element tensor submitted asynchronously with the step's
gradients; Keras: two more numbers in the step's grouped gradient all-reduce), and all ranks stop
after the step in which any rank saw a signal. No rank waits for an extra collective.

After the mid-epoch checkpoint, every rank exits with :data:`EXIT_PREEMPTED` (75,
``EX_TEMPFAIL`` of sysexits.h: "try again later"), not 0 (what the launcher then returns: 75
from mpirun and horovodrun over MPI; horovodrun with Gloo turns any rank failure into 1; srun
with ``--kill-on-bad-exit`` may report the signal it ended the last ranks with; ``metrics.json``'s
``preempted`` is the record to trust), so that Kubernetes' ``OnFailure``
restart policy and wrapper scripts restart it; ``--resume auto`` then continues from the
checkpoint. On ``SIGUSR1`` inside a Slurm batch job rank 0 also runs ``scontrol requeue
$SLURM_JOB_ID`` (as PyTorch Lightning's ``SLURMEnvironment`` does), unless ``--no-requeue``;
``SIGTERM`` does not requeue (a ``scancel`` means stop; Slurm's own preemption requeues by its
configuration).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

log = logging.getLogger("hvdtrain")

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: stopped on a signal after a checkpoint; rerun
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # the order of the flags in flags()


# The options that fix which samples each micro-batch holds: a mid-epoch checkpoint continues at
# its micro-batch only when they (and the world size) are what they were.
POSITION_FIELDS = ("dataset", "synthetic_samples", "test_fraction", "seed", "batch_size",
                   "backward_passes_per_step")


def mid_epoch_mismatch(saved_config: dict | None, saved_size: int, cfg, size: int) -> str | None:
    """Why a mid-epoch checkpoint cannot continue at its micro-batch in this run (the shards or
    the data order would differ), or None when it can.

    Args:
        saved_config: the checkpoint's ``TrainConfig.to_dict()``.
        saved_size: the world size it was made with.
        cfg: this run's ``TrainConfig``; size: this run's world size.
    """
    if saved_size != size:
        return f"it was made with {saved_size} ranks and this run has {size}"
    saved = saved_config or {}
    diffs = [f"--{name.replace('_', '-')} {saved.get(name)!r} -> {getattr(cfg, name)!r}"
             for name in POSITION_FIELDS if saved.get(name) != getattr(cfg, name)]
    return "options that fix the data order changed: " + ", ".join(diffs) if diffs else None


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written; its exit code is
    :data:`EXIT_PREEMPTED`.

    Attributes:
        signal_name: ``"SIGTERM"`` or ``"SIGUSR1"`` (the first that any rank saw; SIGUSR1 wins
            when both were seen).
        seconds: seconds from the earliest signal any rank saw to the end of the checkpoint
            (the largest of the ranks' own measurements).
    """

    def __init__(self, signal_name: str, seconds: float | None):
        super().__init__(EXIT_PREEMPTED)
        self.signal_name, self.seconds = signal_name, seconds


class Preemption:
    """Catches ``SIGTERM`` and ``SIGUSR1`` while training and keeps what came.

    Use as a context manager: the previous handlers come back on exit. The handler only records
    the signal (Python runs it between bytecodes in the main thread); the trainer reads
    :meth:`flags` at each optimizer step.

    Attributes:
        seen: signal number -> ``time.monotonic()`` when it first arrived.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seen: dict[int, float] = {}
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.seen.setdefault(signum, time.monotonic())

    def __enter__(self) -> "Preemption":
        """Install the handlers (once: entering again, e.g. after an early install, is a
        no-op)."""
        if self.enabled and not self._previous:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # A launcher that blocks SIGTERM for itself (hvdtrain launch's mpirun) and starts
            # ranks without unblocking it would otherwise leave it pending here for good.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def flags(self) -> list[float]:
        """``[1.0 if SIGTERM seen, 1.0 if SIGUSR1 seen]``: this rank's share of the all-reduce."""
        return [float(sig in self.seen) for sig in SIGNALS]

    def seconds_since_signal(self) -> float | None:
        """Seconds since this rank saw its first signal; None when it saw none."""
        return time.monotonic() - min(self.seen.values()) if self.seen else None


# The process's Preemption, installed by install_early() before any framework is imported.
_EARLY: Preemption | None = None


def install_early() -> Preemption:
    """Catch SIGTERM/SIGUSR1 from now on in this process and keep what comes, for the run to
    act on at its first optimizer step (:func:`taken`). ``hvdtrain train`` calls it first thing,
    before TensorFlow or PyTorch is imported (seconds to tens of seconds during which the default
    action would kill the rank and lose the request, and under Slurm its requeue). Idempotent.

    Returns:
        The process's :class:`Preemption`, entered.
    """
    global _EARLY
    if _EARLY is None:
        _EARLY = Preemption().__enter__()
    return _EARLY


def taken(enabled: bool = True) -> Preemption:
    """The entered :class:`Preemption` a run uses: the one :func:`install_early` installed (with
    any signal that came while the run started), else a new one."""
    global _EARLY
    signals, _EARLY = _EARLY, None
    if signals is None or not enabled:
        if signals is not None:
            signals.__exit__()
        signals = Preemption(enabled)
    return signals.__enter__()


def agreed_signal(summed: list[float]) -> str | None:
    """The signal all ranks act on, from the all-reduced (summed) :meth:`Preemption.flags`:
    ``"SIGUSR1"`` when any rank saw it, else ``"SIGTERM"`` when any rank saw that, else None."""
    if summed[1] > 0.5:
        return "SIGUSR1"
    if summed[0] > 0.5:
        return "SIGTERM"
    return None


def record_stop(report, signal_name: str, epoch: int, batch: int, step: int,
                seconds: float | None, requeue_enabled: bool, is_root: bool) -> None:
    """What both trainers do once the mid-epoch checkpoint is written: put ``preempted`` into
    ``metrics.json`` (``report``, a :class:`~hvdtrain.run.report.RunReport`), and on rank 0 write it,
    requeue under Slurm (:func:`requeue`) and log one line. ``epoch`` is 1-based, ``batch`` the
    micro-batches of it trained, ``seconds`` from the earliest signal to the checkpoint."""
    report.header["preempted"] = {"signal": signal_name, "epoch": epoch, "batch": batch,
                                  "step": step, "seconds_to_checkpoint": seconds}
    report.board.close()  # the TensorBoard points so far reach the disk before the exit
    if is_root:
        report.write()
        log.warning("%s: stopped after optimizer step %d (epoch %d, micro-batch %d) and saved "
                    "the checkpoint %.2f s after the signal; %s; exit %d, continue with "
                    "--resume auto", signal_name, step, epoch, batch, seconds or 0.0,
                    requeue(signal_name, requeue_enabled), EXIT_PREEMPTED)


def requeue(signal_name: str, enabled: bool, env: dict[str, str] | None = None) -> str:
    """After the preemption checkpoint, on rank 0: requeue a Slurm batch job that got
    ``SIGUSR1`` (``scontrol requeue $SLURM_JOB_ID``). Never raises.

    Returns:
        One line for the log saying what was done and why.
    """
    env = dict(os.environ if env is None else env)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "not a Slurm job: not requeued (rerun with --resume auto)"
    if signal_name != "SIGUSR1":
        return f"{signal_name}: Slurm job {job} not requeued (only SIGUSR1 requeues)"
    if not enabled:
        return f"Slurm job {job} not requeued (--no-requeue)"
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              timeout=60, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"scontrol requeue {job} failed: {exc}"
    if proc.returncode != 0:
        return (f"scontrol requeue {job} failed (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()} (an salloc job cannot be requeued; "
                "submit with sbatch --requeue)")
    return f"Slurm job {job} requeued (scontrol requeue {job})"
