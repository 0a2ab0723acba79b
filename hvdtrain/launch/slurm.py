"""Slurm: the allocation a job runs in, read from the variables Slurm sets, and the ``srun`` command
line that launches hvdtrain's ranks in it.

Inside an allocation (``salloc``, ``sbatch``, ``srun``) Slurm sets ``SLURM_JOB_ID``,
``SLURM_JOB_NODELIST`` (hosts in its compressed form, ``node[01-03,07]``), ``SLURM_TASKS_PER_NODE``
(tasks per host, compressed too: ``2(x3),1`` is 2, 2, 2, 1) and ``SLURM_NTASKS``. The parsers here
expand those forms the way ``scontrol show hostnames`` does (Slurm's hostlist syntax, slurm.conf(5)
"NodeName"), without running anything, so ``hvdtrain launch`` builds its hosts from them and they
are unit-tested.

Launching with ``srun`` needs Slurm's PMIx plugin: Open MPI (Debian's 4.1 included) is built with
PMIx and without PMI-1/2, and ranks started by ``srun --mpi=pmi2`` or plain ``srun`` fail in
``MPI_Init`` (seen on a one-node cluster, docs/stack.md section 5).
"""
from __future__ import annotations

import re
import shutil
import subprocess

from hvdtrain.launch.hostfile import Host, Hostfile, HostfileError

SRUN_MPI = "pmix"  # the --mpi plugin Open MPI's ranks need under srun


def in_allocation(env: dict[str, str]) -> bool:
    """True inside a Slurm allocation (``SLURM_JOB_ID`` is set)."""
    return bool(env.get("SLURM_JOB_ID"))


def _split_top(text: str) -> list[str]:
    """Split at the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Slurm node list {text!r} has nested brackets")
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names in a Slurm host list, in order: ``node[01-03,07]`` -> node01, node02, node03,
    node07; ``a1,b[2-3]`` -> a1, b2, b3; ``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2. Zero padding
    of a range is kept (``[08-10]`` -> 08, 09, 10).

    Raises:
        ValueError: an empty list, unbalanced or nested brackets, or a range that is not
            ``lo-hi`` with ``lo <= hi``; the message quotes the list.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("empty Slurm node list (SLURM_JOB_NODELIST)")
    if text.count("[") != text.count("]"):
        raise ValueError(f"Slurm node list {nodelist!r} has unbalanced brackets")
    hosts: list[str] = []
    for part in (p.strip() for p in _split_top(text)):
        if not part:
            raise ValueError(f"Slurm node list {nodelist!r} has an empty entry")
        hosts += _expand_one(part, nodelist)
    return hosts


def _expand_one(pattern: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if not match:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"Slurm node list {whole!r} has unbalanced brackets")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    names = []
    for item in match.group(1).split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"Slurm node list {whole!r}: {item!r} is not a number or a range "
                             "lo-hi")
        hi = hi if dash else lo
        if int(lo) > int(hi):
            raise ValueError(f"Slurm node list {whole!r}: range {item!r} runs backwards")
        width = len(lo)
        names += [f"{head}{n:0{width}d}" for n in range(int(lo), int(hi) + 1)]
    return [name for stem in names for name in _expand_one(stem + tail, whole)]


def expand_tasks_per_node(tasks: str) -> list[int]:
    """Tasks per host from Slurm's compressed form: ``2(x3),1`` -> [2, 2, 2, 1]; ``4`` -> [4].

    Raises:
        ValueError: an entry that is not ``N`` or ``N(xR)`` with N >= 1, R >= 1.
    """
    counts: list[int] = []
    for item in tasks.strip().split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", item)
        if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise ValueError(f"Slurm tasks per node {tasks!r}: {item!r} is not N or N(xR)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def allocation_hosts(env: dict[str, str]) -> Hostfile:
    """The allocation's hosts and slots (tasks per host) as a :class:`~hvdtrain.launch.hostfile.Hostfile`
    whose ``path`` names the job (launchers get it as ``-H host:N,...``).

    Reads ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) and ``SLURM_TASKS_PER_NODE``; without
    the latter (an allocation made with ``-N`` and no task count) each host gets
    ``SLURM_NTASKS_PER_NODE`` slots, else 1.

    Raises:
        HostfileError: not in an allocation, a variable missing or malformed, or the host and
            tasks-per-node lists of different lengths.
    """
    if not in_allocation(env):
        raise HostfileError("not inside a Slurm allocation (SLURM_JOB_ID is not set); pass "
                            "--hostfile, or run under salloc/sbatch")
    job = env["SLURM_JOB_ID"]
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise HostfileError(f"Slurm job {job}: SLURM_JOB_NODELIST is not set; pass --hostfile")
    try:
        names = expand_nodelist(nodelist)
        per_node = env.get("SLURM_TASKS_PER_NODE")
        if per_node:
            slots = expand_tasks_per_node(per_node)
        else:
            slots = [int(env.get("SLURM_NTASKS_PER_NODE") or 1)] * len(names)
    except ValueError as exc:
        raise HostfileError(f"Slurm job {job}: {exc}; pass --hostfile instead") from None
    if len(slots) != len(names):
        raise HostfileError(f"Slurm job {job}: {len(names)} hosts in SLURM_JOB_NODELIST="
                            f"{nodelist} but {len(slots)} entries in SLURM_TASKS_PER_NODE="
                            f"{env.get('SLURM_TASKS_PER_NODE')}; pass --hostfile instead")
    hosts = [Host(name, n, i + 1) for i, (name, n) in enumerate(zip(names, slots))]
    return Hostfile(f"slurm-job-{job}", hosts, bare=False, mpich=False, virtual=True)


def allocation_np(env: dict[str, str], hosts: Hostfile) -> int:
    """Processes to start by default: ``SLURM_NTASKS`` (``sbatch/salloc -n``), else the slots."""
    value = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    return int(value) if value and value.isdigit() else hosts.slots


def srun_mpi_plugins(env: dict[str, str] | None = None, timeout_s: float = 30.0) -> list[str]:
    """The MPI plugin types ``srun --mpi=list`` offers (e.g. ``["none", "pmi2", "pmix"]``).

    Raises:
        FileNotFoundError: no ``srun`` on ``env["PATH"]``.
        RuntimeError: ``srun --mpi=list`` failed or timed out (the message holds its output).
    """
    srun = shutil.which("srun", path=(env or {}).get("PATH"))
    if srun is None:
        raise FileNotFoundError("srun not found on PATH; run inside a Slurm cluster (or add "
                                "Slurm's client commands to PATH), or use --launcher mpirun")
    try:
        proc = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True,
                              timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"'srun --mpi=list' did not answer in {timeout_s:.0f} s") from None
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"'srun --mpi=list' failed (exit {proc.returncode}): {text.strip()}")
    return parse_mpi_list(text)


def parse_mpi_list(text: str) -> list[str]:
    """The plugin names in ``srun --mpi=list`` output: Slurm 22.05 prints ``MPI plugin types
    are...`` then one name per line (``srun:`` prefixes allowed); later versions print them on
    one line separated by commas. Lines about plugin versions (``pmix_v4``) are left out."""
    names = []
    for line in text.splitlines():
        line = re.sub(r"^srun:\s*", "", line.strip())
        if not line or "plugin" in line.lower() or ":" in line:
            continue
        names += [n.strip() for n in line.split(",") if re.fullmatch(r"[A-Za-z0-9_]+", n.strip())]
    return names


def check_srun(env: dict[str, str]) -> None:
    """Make sure ``srun --mpi=pmix`` can start Open MPI ranks here.

    Raises:
        HostfileError: no srun, or its ``--mpi=list`` has no ``pmix``; the message says what to
            install or which launcher to use instead.
    """
    try:
        plugins = srun_mpi_plugins(env)
    except (FileNotFoundError, RuntimeError) as exc:
        raise HostfileError(str(exc)) from None
    if SRUN_MPI not in plugins:
        raise HostfileError(f"srun --mpi=list offers {', '.join(plugins) or 'nothing'} but not "
                            f"{SRUN_MPI}: Open MPI's ranks need Slurm's PMIx plugin under srun "
                            "(other PMI flavours fail in MPI_Init). Install it (Debian: "
                            "slurm-wlm-basic-plugins built with PMIx; ask your admins), or use "
                            "--launcher mpirun inside the allocation")


def srun_argv(np_: int, command: list[str], *, env: dict[str, str] | None = None,
              mca: dict[str, str] | None = None,
              knobs: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """``srun --mpi=pmix -n N --cpu-bind=none --kill-on-bad-exit=1 <command>``.

    srun forwards the whole environment to the tasks (``--export=ALL``, its default), so the
    launch tuning the mpirun path passes as ``-mca key value`` goes into the environment as
    ``OMPI_MCA_key=value`` (Open MPI reads its parameters from there), and Horovod's ``knobs``
    (:func:`hvdtrain.launch.tuning.horovod_knobs`) as they are. ``--cpu-bind=none`` matches mpirun's
    ``-bind-to none`` (each rank's threads may use the cores hvdtrain gives it, inside whatever
    the allocation grants); ``--kill-on-bad-exit=1`` ends the other ranks when one fails, as
    mpirun does, instead of leaving them waiting in a collective.

    Returns:
        ``(argv, env)``: the argv list and the environment to run it with.

    Raises:
        ValueError: an empty command or ``np_`` < 1.
    """
    if not command:
        raise ValueError("no command to launch; put it after '--'")
    if np_ < 1:
        raise ValueError(f"-np must be at least 1, got {np_}")
    env = {**(env or {}), **(knobs or {})}
    for key, value in {"pml": "ob1", "btl": "^openib", **(mca or {})}.items():
        env["OMPI_MCA_" + key] = value
    argv = ["srun", f"--mpi={SRUN_MPI}", "-n", str(np_), "--cpu-bind=none",
            "--kill-on-bad-exit=1"]
    return argv + list(command), env
