"""Helpers that launch real multi-process jobs (horovodrun / mpirun) for the parallel tests.

Each test script in this folder has a ``main()`` and is launched here as a real job; nothing is
mocked. The scripts write their results as JSON/NPZ from rank 0 and the tests compare them with a
single-process reference run of the same script.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TIMEOUT = 600  # seconds; a hung collective fails the test instead of the CI run


def job_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # Ranks >= cores here: let idle MPI ranks yield instead of busy-polling (docs/stack.md, section 3).
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def horovodrun(np_: int, *command: str, extra: tuple[str, ...] = ()) -> list[str]:
    """argv of ``horovodrun -np N -H localhost:N <command>``."""
    return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", *extra, *command]


def mpirun(np_: int, *command: str) -> list[str]:
    """argv of ``mpirun`` as Horovod's docs recommend (no hostfile: this host)."""
    return ["mpirun", "--allow-run-as-root", "-np", str(np_), "-bind-to", "none", "-map-by", "slot",
            "-x", "PATH", "-x", "OMPI_MCA_mpi_yield_when_idle", *command]


def run(argv: list[str], timeout: int = TIMEOUT, check: bool = True,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a job (``env``: variables to set on top of :func:`job_env`); on failure show its
    output (so CI logs say why)."""
    proc = subprocess.run(argv, env={**job_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


# Keras 3 backends the Keras adapter's tests run on (KERAS_BACKEND of the launched job): those
# hvdtrain supports (hvdtrain.config.KERAS_BACKENDS).
from hvdtrain.config import KERAS_BACKENDS  # noqa: E402


def keras_env(backend: str) -> dict:
    """The variables that make a launched job's Keras run on ``backend``."""
    return {"KERAS_BACKEND": backend}


def script(name: str) -> list[str]:
    """``python tests/parallel/<name>`` with this interpreter."""
    return [sys.executable, str(HERE / name)]


def rank_script(name: str) -> str:
    """The path of ``tests/parallel/<name>``, for a rank pool's request."""
    return str(HERE / name)


TRAIN = "hvdtrain.cli:main"  # `hvdtrain train ...` inside a rank pool's ranks

# Epochs of the digits main jobs that test_torch_parallel and test_keras_parallel launch, instead
# of the default 15, which added nothing those tests assert (#47). Last-epoch test accuracy seen
# at np=2: torch 0.978, Keras 0.986 (TF) / 0.978 (torch); with batch 8 and k=2 (which climbs more
# slowly, so one epoch more): torch 0.972, Keras 0.983.
MAIN_EPOCHS = "5"
MAIN_EPOCHS_K2 = "6"


def train_in(pools, out, *args: str, framework: str = "torch", backend: str = "tensorflow",
             **kw):
    """``hvdtrain train --framework F --output-dir OUT ARGS`` inside the ranks of the pool for
    ``framework`` (Keras: the pool whose backend is ``backend``, ``--keras-backend`` given);
    ``kw`` as :meth:`rankpool.RankPool.run`. Returns its :class:`rankpool.Done`."""
    if framework == "keras":
        pool, args = pools.keras(backend), ("--keras-backend", backend, *args)
    else:
        pool = pools.get()
    return pool.run(TRAIN, "train", "--framework", framework, "--output-dir", str(out), *args,
                    **kw)


# The tag Open MPI (``[jobid,rank]<stdout>:``, horovodrun's MPI mode) and horovodrun's Gloo mode
# (``[rank]<stdout>:``) put before each chunk of a rank's output that they forward. A chunk can
# end anywhere in a line, so a tag can sit in the middle of one.
_TAG = re.compile(r"\[(\d+)(?:,(\d+))?\]<(stdout|stderr)>:")


class Console:
    """What a person saw on a launched job's console, with the launcher's chunking undone.

    Each rank's stdout and stderr are rebuilt from their tagged chunks, in order, so a line cut
    by a chunk boundary is whole again. Only for checking words a person would read; numbers and
    structures come from files the job writes, never from here.

    Attributes:
        launcher: the untagged text (the launcher's own messages, or a job run without tags).
        streams: ``{(rank, "stdout" | "stderr"): text}`` of each rank's rebuilt streams.
    """

    def __init__(self, *texts: str):
        self.launcher = ""
        self.streams: dict[tuple[int, str], str] = {}
        for text in texts:
            pieces = _TAG.split(text or "")
            self.launcher += pieces[0]
            for i in range(1, len(pieces), 4):
                first, second, stream, chunk = pieces[i:i + 4]
                rank = int(second if second is not None else first)
                key = (rank, stream)
                self.streams[key] = self.streams.get(key, "") + chunk

    @classmethod
    def of(cls, proc: subprocess.CompletedProcess) -> "Console":
        return cls(proc.stdout, proc.stderr)

    def rank(self, rank: int) -> str:
        """Rank ``rank``'s stdout, then its stderr (each whole)."""
        return "\n".join(self.streams.get((rank, s), "") for s in ("stdout", "stderr"))

    def ranks(self) -> list[int]:
        """Ranks that printed anything."""
        return sorted({r for r, _ in self.streams})

    @property
    def text(self) -> str:
        """The launcher's text and every rank's rebuilt streams, one block after another."""
        return "\n".join([self.launcher, *(self.streams[k] for k in sorted(self.streams))])
