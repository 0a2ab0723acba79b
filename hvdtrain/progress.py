"""Rank 0's progress output: a bar where it writes to a terminal, a line at a fixed interval
where it writes to a file or a pipe.

Under ``horovodrun``, ``mpirun`` and ``srun`` a rank's stderr is a pipe to the launcher, even
when the launcher itself writes to a terminal (Open MPI gives the ranks' stdout a pseudo-terminal,
whatever the launcher's own stdout is: a file, a pipe); a carriage-return bar (tqdm's, Keras's
``verbose=1``) then reaches the log as one line of tens of kilobytes. So the bar is shown only
where stderr is a terminal (``isatty()``), for both frameworks, and elsewhere a plain line every
``HVDTRAIN_PROGRESS_SECONDS`` (default 30) and Keras's ``verbose=2`` line per epoch.

Environment (read on rank 0 when training starts; checked by
:meth:`hvdtrain.config.TrainConfig.validate` before any work):

* ``HVDTRAIN_PROGRESS``: ``bar``, ``lines``, ``off`` or ``auto`` (default: ``bar`` on a
  terminal, else ``lines``).
* ``HVDTRAIN_PROGRESS_SECONDS``: seconds between two progress lines, > 0 (default 30).

Nothing here imports a framework: the PyTorch trainer gets a tqdm bar or a :class:`Lines`, the
Keras trainer a ``verbose`` value and a callback (:func:`keras_callbacks`).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, TextIO

MODE_VAR = "HVDTRAIN_PROGRESS"
SECONDS_VAR = "HVDTRAIN_PROGRESS_SECONDS"
MODES = ("auto", "bar", "lines", "off")
DEFAULT_SECONDS = 30.0


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def mode(enabled: bool = True, stream: TextIO | None = None,
         env: dict[str, str] | None = None) -> str:
    """How rank 0 shows progress: ``"bar"``, ``"lines"`` or ``"off"``.

    Args:
        enabled: False (not rank 0, or ``--no-progress``): ``"off"`` whatever the environment.
        stream: where the progress goes (default ``sys.stderr``); ``auto`` gives ``"bar"`` when
            it is a terminal, else ``"lines"``.
        env: the environment (default ``os.environ``).

    Raises:
        ValueError: ``HVDTRAIN_PROGRESS`` is none of ``auto``, ``bar``, ``lines``, ``off``.
    """
    env = os.environ if env is None else env
    value = env.get(MODE_VAR, "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_VAR}={env[MODE_VAR]!r} is not one of {', '.join(MODES)}; "
                         f"unset it, or set e.g. {MODE_VAR}=lines")
    if not enabled or value == "off":
        return "off"
    if value != "auto":
        return value
    return "bar" if _is_terminal(sys.stderr if stream is None else stream) else "lines"


def interval(env: dict[str, str] | None = None) -> float:
    """Seconds between two progress lines (``HVDTRAIN_PROGRESS_SECONDS``, default 30).

    Raises:
        ValueError: not a number > 0.
    """
    env = os.environ if env is None else env
    text = env.get(SECONDS_VAR, "").strip()
    if not text:
        return DEFAULT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{SECONDS_VAR}={text!r} must be a number of seconds > 0, e.g. 30")
    return seconds


def check_env(env: dict[str, str] | None = None) -> None:
    """Check both variables (before any work starts).

    Raises:
        ValueError: the first one that is not valid, named with what to set.
    """
    mode(True, env=env)
    interval(env)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return (f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600
            else f"{seconds // 60}:{seconds % 60:02d}")


class Lines:
    """A progress line every ``seconds``, e.g.
    ``epoch 2/15: 120/469 batches (26%), 35.1 batches/s, 0:10 left``, each ending in a newline
    (readable in a log file). The same ``update``/``close`` calls as a tqdm bar.

    Args:
        total: steps in the epoch (the count shown as done of total).
        initial: steps already done (a resumed epoch).
        desc: what the line starts with, e.g. ``epoch 2/15``.
        seconds: the interval; the first line comes ``seconds`` after the start.
        stream: where the lines go (default ``sys.stderr``, read at each line).
        unit: what a step is called (``batch``: ``batches``).
        clock: seconds, monotonic (for tests).
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "",
                 seconds: float = DEFAULT_SECONDS, stream: TextIO | None = None,
                 unit: str = "batch", clock: Callable[[], float] = time.monotonic):
        self.total, self.n, self.desc, self.seconds = total, initial, desc, seconds
        self.stream, self.unit, self.clock = stream, unit, clock
        self.start = self.last = clock()
        self.first = initial
        self.lines = 0

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps; print a line when ``seconds`` have passed since the last."""
        self.n += n
        now = self.clock()
        if now - self.last >= self.seconds:
            self.last = now
            self.lines += 1
            print(self.line(now), file=self.stream or sys.stderr, flush=True)

    def line(self, now: float) -> str:
        """The progress line at time ``now``."""
        units = self.unit + ("es" if self.unit.endswith(("s", "ch", "sh", "x")) else "s")
        rate = (self.n - self.first) / max(now - self.start, 1e-9)
        text = f"{self.desc + ': ' if self.desc else ''}{self.n}/{self.total} {units}"
        if self.total:
            text += f" ({100 * self.n / self.total:.0f}%)"
        text += f", {rate:.3g} {units}/s"
        if self.total and rate > 0 and self.n < self.total:
            text += f", {_clock((self.total - self.n) / rate)} left"
        return text

    def close(self) -> None:
        """Nothing to clear: each line is already complete (the epoch's own line follows)."""


class _Off:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, initial: int = 0, desc: str = "", enabled: bool = True,
        unit: str = "batch"):
    """What the PyTorch trainer counts its steps on, by :func:`mode` on ``sys.stderr``: a tqdm
    bar (``leave=False``), a :class:`Lines` every :func:`interval` seconds, or nothing.
    Each has ``update(n=1)`` and ``close()``."""
    how = mode(enabled, sys.stderr)
    if how == "bar":
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, unit=unit, desc=desc, leave=False)
    if how == "lines":
        return Lines(total, initial, desc, interval(), unit=unit)
    return _Off()


def keras_verbose(enabled: bool = True) -> int:
    """``model.fit``'s ``verbose`` by :func:`mode` on ``sys.stderr`` (not the stdout Keras
    prints to: under mpirun that is a pseudo-terminal even when the job writes to a file):
    1 (its bar), 2 (one line per epoch, for a log) or 0."""
    return {"bar": 1, "lines": 2, "off": 0}[mode(enabled, sys.stderr)]


def keras_callbacks(enabled: bool, steps: int, epochs: int, done: int = 0) -> list:
    """Keras callbacks that print a :class:`Lines` progress line every :func:`interval`
    seconds within each epoch (with :func:`keras_verbose`'s 2, whose line comes at the epoch's
    end), on stdout as Keras's own lines; none unless :func:`mode` on ``sys.stderr`` says
    ``"lines"``.

    Args:
        steps: micro-batches per epoch of this ``fit`` (``steps_per_epoch``).
        epochs: the run's epochs (the ``N`` of ``epoch n/N``).
        done: micro-batches already done of the first epoch (a resumed epoch); its total is
            ``done + steps``.
    """
    if mode(enabled, sys.stderr) != "lines":
        return []
    import keras

    seconds = interval()

    class ProgressLines(keras.callbacks.Callback):
        """A progress line every ``seconds`` within an epoch (:class:`Lines`)."""

        def __init__(self):
            super().__init__()
            self.lines: Lines | None = None
            self.first = True

        def on_epoch_begin(self, epoch, logs=None):
            initial = done if self.first else 0
            self.first = False
            self.lines = Lines(initial + steps, initial, f"epoch {epoch + 1}/{epochs}", seconds,
                               stream=sys.stdout)

        def on_train_batch_end(self, batch, logs=None):
            if self.lines is not None:
                self.lines.update()

    return [ProgressLines()]
