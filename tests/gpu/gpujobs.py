"""Helpers for tests/gpu: the launch helpers of tests/parallel/jobs.py, and argv builders for
``hvdtrain train`` and this folder's scripts. Numbers come from the files the jobs write
(metrics.json, checkpoint.pt, JSON), never from their console."""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "parallel"))

from jobs import BIN, horovodrun, run  # noqa: E402

__all__ = ["BIN", "horovodrun", "run", "script", "train", "metrics", "environ"]


def script(name: str) -> list[str]:
    """``python tests/gpu/<name>`` with this interpreter."""
    return [sys.executable, str(HERE / name)]


def train(out_dir: Path, *options: str, epochs: int = 3, framework: str = "torch") -> list[str]:
    """``horovodrun -np 1 hvdtrain train --framework torch`` (or ``framework``) on digits into
    ``out_dir``."""
    return horovodrun(1, str(BIN / "hvdtrain"), "train", "--framework", framework, "--dataset",
                      "digits", "--epochs", str(epochs), "--output-dir", str(out_dir),
                      "--no-progress", *options)


def metrics(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "metrics.json").read_text())


@contextmanager
def environ(**values: str):
    """Set environment variables for the jobs started inside (jobs.run copies os.environ)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
