"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never half of one.

The data goes to a temporary file in the same directory, is flushed and fsync'ed, and then
``os.replace`` renames it over the target (atomic on POSIX within one file system); the directory
is fsync'ed so the rename itself survives a power cut.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


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
