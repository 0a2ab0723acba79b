"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never half of one;
and checkpoint generations (write the new one, keep the previous, read back the newest good one).

The data goes to a temporary file in the same directory, is flushed and fsync'ed, and then
``os.replace`` renames it over the target (atomic on POSIX within one file system); the directory
is fsync'ed so the rename itself survives a power cut.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator, TypeVar

T = TypeVar("T")
log = logging.getLogger("hvdtrain")


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that wants a file name (e.g. Keras's
    ``save_weights``); on a clean exit the file is fsync'ed and renamed over ``path``.

    If the block raises, the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it replaces ``path``.

    If the block raises, the temporary file is removed and ``path`` is left as it was.

    Raises:
        ValueError: ``mode`` is not a write mode (``"wb"`` or ``"w"``).
        OSError: the directory cannot be written.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes whole files; mode must be 'wb' or 'w', got {mode!r}")
    with atomic_path(path) as tmp:
        with open(tmp, mode) as handle:
            yield handle


def write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    with atomic_open(path, "w") as handle:
        json.dump(obj, handle, indent=2, sort_keys=True)
        handle.write("\n")


class CheckpointError(RuntimeError):
    """No usable checkpoint; the message lists what was tried and why each failed."""


def save_rotating(current: str | os.PathLike, previous: str | os.PathLike,
                  write: Callable[[IO], None]) -> Path:
    """Write a new ``current`` file with ``write(handle)``, keeping the old one as ``previous``.

    The old ``current`` is first renamed to ``previous``; the new one is written to a temporary
    file, fsync'ed and renamed into place (:func:`atomic_open`). At every moment one complete
    file exists, and a crash mid-write loses nothing.

    Returns:
        The path written.
    """
    current, previous = Path(current), Path(previous)
    if current.exists():
        os.replace(current, previous)
    with atomic_open(current, "wb") as handle:
        write(handle)
    return current


def load_newest(paths: list[Path], read: Callable[[Path], T]) -> tuple[Path, T]:
    """The first of ``paths`` that ``read`` accepts: the newest checkpoint, or an older one when
    the newer ones are missing, truncated or corrupt (each failure is logged).

    Args:
        paths: candidate files, newest first.
        read: loads one file; any exception it raises marks the file unusable.

    Returns:
        ``(path, what read returned)``.

    Raises:
        CheckpointError: no file could be read; the message says what each failure was.
    """
    problems = []
    for path in paths:
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        try:
            payload = read(path)
        except Exception as exc:  # loaders raise many types for truncated/corrupt files
            problems.append(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:200]})")
            log.error("checkpoint %s is unreadable (%s); trying the previous one", path,
                      type(exc).__name__)
            continue
        if problems:
            log.warning("using %s because %s", path, "; ".join(problems))
        return path, payload
    raise CheckpointError("no usable checkpoint: " + "; ".join(problems) +
                          ". Start without --resume, or point --output-dir at a run's directory")
