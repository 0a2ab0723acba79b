"""Which launcher of ``hvdtrain launch`` starts with SIGTERM blocked, and how the block reaches
the ``mpirun`` that ``horovodrun`` runs (:func:`blocks_sigterm` and :func:`launcher_start`, used
by :class:`hvdtrain.launch.signals.RankSignals`).

Open MPI's ``mpirun`` answers a SIGTERM by killing the ranks a second later
(``odls_base_sigkill_timeout``), and ``scancel`` signals every process of the job; started with
SIGTERM blocked, ``mpirun`` never acts on it, and Open MPI unblocks every signal in the ranks it
starts. Other launchers hand a blocked mask on to the ranks through a shell that passes it on
(bash; dash, Debian's ``/bin/sh``, clears it), so they are left as they are.
"""
from __future__ import annotations

import glob
import importlib.util
import mmap
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path


def mpirun_keeping_sigterm_blocked(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """``env`` with a folder first on ``PATH`` whose ``mpirun`` blocks SIGTERM, then runs the
    real one (found on ``env``'s ``PATH``) as ``mpirun`` with the same arguments; and that
    folder (None, ``env`` unchanged, where no ``mpirun`` is found).

    ``horovodrun`` runs ``/bin/sh -c "mpirun ..."``, and a POSIX shell (dash) clears the blocked
    signal mask it inherits, so a mask set on ``horovodrun`` never reached its ``mpirun``: that
    ``mpirun`` answered a ``scancel``'s SIGTERM by killing the ranks a second later
    (``odls_base_sigkill_timeout``). Open MPI unblocks every signal in the ranks it starts.
    The folder is also on the ranks' ``PATH`` (``horovodrun`` exports it), where it does
    nothing but run the same ``mpirun``."""
    real = shutil.which("mpirun", path=env.get("PATH"))
    if real is None:
        return dict(env), None
    folder = tempfile.mkdtemp(prefix="hvdtrain-mpirun-")
    shim = Path(folder) / "mpirun"
    shim.write_text(f"#!{sys.executable} -S\n"
                    "# hvdtrain launch: mpirun with SIGTERM blocked (hvdtrain.launch.sigmask)\n"
                    "import os, signal, sys\n"
                    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
                    f"os.execv({real!r}, ['mpirun'] + sys.argv[1:])\n")
    shim.chmod(0o755)
    path = env.get("PATH", "")
    return {**env, "PATH": f"{folder}{os.pathsep}{path}" if path else folder}, folder


def horovodrun_runs_mpirun(argv: list[str], env: Mapping[str, str],
                           built_with_mpi: bool | None = None) -> bool:
    """Whether ``horovodrun`` with ``argv`` starts its ranks with ``mpirun``, as Horovod 0.28.1
    decides (``horovod.runner.launch.run_controller``): not with ``--gloo``, ``--jsrun`` or an
    elastic job (``--host-discovery-script``); with ``--mpi``; otherwise when Horovod was built
    with MPI (``built_with_mpi``, default :func:`horovod_built_with_mpi`;
    unknown counts as built with it), unless this is an LSF job (``LSB_JOBID``) with ``jsrun``
    on ``PATH``, where it uses jsrun. A Horovod built without MPI falls back to Gloo."""
    flags = set(argv)
    if {"--gloo", "--jsrun", "--host-discovery-script"} & flags:
        return False
    if "--mpi" in flags:
        return True
    if built_with_mpi is None:
        built_with_mpi = horovod_built_with_mpi()
    if built_with_mpi is False:
        return False
    return not ("LSB_JOBID" in env and shutil.which("jsrun", path=env.get("PATH")))


def horovod_built_with_mpi() -> bool | None:
    """Whether the installed Horovod was built with MPI, read from its framework extensions'
    files without loading them (loading one imports its framework: ``horovod.common.util
    .mpi_built()`` takes about 1 s in a new process): an extension built with MPI links
    ``libmpi.so`` (Open MPI's or MPICH's), a Gloo-only build (``pip install horovod`` where no
    MPI was found) does not. None where Horovod or its extensions are missing. Imports no
    framework."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = None
    for location in spec.submodule_search_locations:
        for path in sorted(glob.glob(os.path.join(location, "*", "mpi_lib*.so"))):
            try:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if m.find(b"libmpi.so") >= 0:  # a DT_NEEDED entry, near the start
                        return True
                found = False
            except (OSError, ValueError):
                continue
    return found


def blocks_sigterm(argv: list[str], launcher: str, env: Mapping[str, str]) -> bool:
    """Whether ``hvdtrain launch`` starts ``launcher`` (``argv``) with SIGTERM blocked: ``mpirun``
    always; ``horovodrun`` where it runs ``mpirun`` (:func:`horovodrun_runs_mpirun`); never
    ``srun`` (which hands signals to its tasks) or a Gloo or jsrun launch."""
    return launcher == "mpirun" or (launcher == "horovodrun" and horovodrun_runs_mpirun(argv, env))


def launcher_start(launcher: str, blocked: bool, env: Mapping[str, str]
                   ) -> tuple[dict[str, str], Callable[[], None] | None, str | None]:
    """How to start ``launcher``: its environment, the ``preexec_fn`` that blocks SIGTERM (None
    where nothing is blocked) and a folder to remove once it has ended (or None).

    ``horovodrun`` becomes ``/bin/sh -c 'mpirun ...'``: it gets SIGTERM ignored as well, which
    the shell keeps (POSIX: ignored on entry), so the shell outlives a ``scancel``'s SIGTERM and
    reports ``mpirun``'s status, and its ``mpirun`` gets the block from
    :func:`mpirun_keeping_sigterm_blocked`, since the shell may clear the mask."""
    if not blocked:
        return dict(env), None, None
    folder = None
    ignore = launcher == "horovodrun"
    if ignore:
        env, folder = mpirun_keeping_sigterm_blocked(env)

    def child() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        if ignore:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    return dict(env), child, folder
