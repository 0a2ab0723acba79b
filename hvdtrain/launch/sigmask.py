"""Which launcher of ``hvdtrain launch`` starts with SIGTERM blocked, and how the block reaches
the ``mpirun`` that ``horovodrun`` runs (:class:`hvdtrain.launch.signals.RankSignals` uses both).

Open MPI's ``mpirun`` answers a SIGTERM by killing the ranks a second later
(``odls_base_sigkill_timeout``), and ``scancel`` signals every process of the job; started with
SIGTERM blocked, ``mpirun`` never acts on it, and Open MPI unblocks every signal in the ranks it
starts. Other launchers hand a blocked mask on to the ranks through a shell that passes it on
(bash; dash, Debian's ``/bin/sh``, clears it), so they are left as they are.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
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
    import tempfile
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
    with MPI (``built_with_mpi``, default :func:`hvdtrain.launch.tuning.horovod_built_with_mpi`;
    unknown counts as built with it), unless this is an LSF job (``LSB_JOBID``) with ``jsrun``
    on ``PATH``, where it uses jsrun. A Horovod built without MPI falls back to Gloo."""
    flags = set(argv)
    if {"--gloo", "--jsrun", "--host-discovery-script"} & flags:
        return False
    if "--mpi" in flags:
        return True
    if built_with_mpi is None:
        from hvdtrain.launch.tuning import horovod_built_with_mpi
        built_with_mpi = horovod_built_with_mpi()
    if built_with_mpi is False:
        return False
    return not ("LSB_JOBID" in env and shutil.which("jsrun", path=env.get("PATH")))
