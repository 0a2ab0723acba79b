"""Hostfiles: parse and validate them, and build the exact ``horovodrun`` / ``mpirun`` command
lines that launch a job on the hosts they name.

Formats (one host per line; ``#`` starts a comment; blank lines are ignored):

* Open MPI and ``horovodrun``: ``hostname slots=N`` (optionally ``max_slots=M``), e.g.
  ``node1 slots=4``.
* MPICH / Intel MPI: ``hostname:N``, e.g. ``node1:4``.

hvdtrain requires ``slots`` on every line (Open MPI would silently guess the host's core count)
and rejects duplicate hosts, unknown keys and names that are neither DNS names nor IP addresses.

Command lines are argv lists, never shell strings; the builders are pure functions returning
``(argv, env)`` so they are tested without launching anything. ``horovodrun --hostfile`` only
understands bare ``host slots=N`` lines (horovod 0.28.1 splits each line at its first ``=``: a
comment, a blank line or ``max_slots`` breaks it), and Open MPI's ``mpirun`` does not read MPICH's
``host:N``; for such files the builders pass the validated hosts as ``-H host:N,...`` instead,
which is what horovodrun turns a hostfile into itself.

The settings a launch adds for speed (``mpi_yield_when_idle``, Horovod's knobs) are decided in
:mod:`hvdtrain.launch.tuning`.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.launch.discovery import discover_hosts, elastic_network_interfaces

LAUNCHERS = ("horovodrun", "mpirun")
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_KNOWN_KEYS = ("slots", "max_slots")
# Variables `hvdtrain launch --launcher mpirun` forwards to every rank with `-x NAME` when they are
# set. Horovod's documentation runs `mpirun ... -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH`:
# PATH and LD_LIBRARY_PATH (the same Python, CUDA and NCCL libraries on every host), then the
# PyTorch/TensorFlow GPU memory settings and the Keras backend (KERAS_BACKEND,
# TF_USE_LEGACY_KERAS: every rank must run the same Keras) by name, and every variable starting
# with one of PASS_PREFIXES: HOROVOD_* (Horovod's settings), HVDTRAIN_*, PYTHON* (PYTHONPATH, ...),
# TF_CPP_* (TensorFlow's logging), OMP_NUM_THREADS, OMP_WAIT_POLICY and GOMP_* (the user's OpenMP
# wait, which hvdtrain train keeps: tuning.openmp_spin), NCCL_* (NCCL_DEBUG, NCCL_SOCKET_IFNAME,
# NCCL_IB_*, ...: read by NCCL inside each rank, so they must reach the ranks), CUDA_*
# (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, ...) and OMPI_MCA_* (Open MPI parameters). mpirun
# itself reads OMPI_MCA_* from the environment it is started in, and Open MPI 4.x also exports
# every OMPI_* variable to local and remote ranks on its own (mpirun(1), "Exported Environment
# Variables"); the `-x` makes that explicit in the printed command line and does not depend on it.
# horovodrun forwards the whole environment itself.
PASS_THROUGH = ("PATH", "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF", "TF_FORCE_GPU_ALLOW_GROWTH",
                "KERAS_BACKEND", "TF_USE_LEGACY_KERAS")
PASS_PREFIXES = ("HOROVOD_", "HVDTRAIN_", "PYTHON", "TF_CPP_", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                 "GOMP_", "NCCL_", "CUDA_", "OMPI_MCA_")


class HostfileError(ValueError):
    """A hostfile (or -np) that cannot work; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Hostfile:
    """A parsed, validated hostfile.

    Attributes:
        path: where it was read from.
        hosts: its hosts in file order.
        bare: every line is exactly ``host slots=N`` (no comments, blank lines, other keys):
            ``horovodrun --hostfile`` can read it.
        mpich: it uses MPICH's ``host:N`` form (Open MPI cannot read it).
        virtual: no file behind it (e.g. a Slurm allocation's hosts, :mod:`hvdtrain.launch.slurm`):
            ``path`` only names it, and launchers get the hosts as ``-H host:N,...``.
    """
    path: str
    hosts: list
    bare: bool
    mpich: bool
    virtual: bool = False

    @property
    def slots(self) -> int:
        """Total slots."""
        return sum(h.slots for h in self.hosts)

    def as_h(self) -> str:
        """The hosts as ``-H`` wants them: ``host1:2,host2:2``."""
        return ",".join(f"{h.name}:{h.slots}" for h in self.hosts)


@dataclass(frozen=True)
class Host:
    """One hostfile line.

    Attributes:
        name: hostname or IP address.
        slots: processes to start there, >= 1.
        line: 1-based line number in the file.
    """
    name: str
    slots: int
    line: int


def valid_hostname(name: str) -> bool:
    """True for an IPv4/IPv6 address or a DNS name (RFC 1123 labels, at most 253 characters)."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if len(name) > 253 or name.endswith("."):
        return False
    labels = name.split(".")
    if all(label.isdigit() for label in labels):  # looks like a broken IPv4 address
        return False
    return all(_LABEL.match(label) for label in labels)


def _whole(value: str, where: str, key: str) -> int:
    if not re.fullmatch(r"[0-9]+", value):
        raise HostfileError(f"{where}: '{key}={value}' is not a whole number; write e.g. {key}=2")
    number = int(value)
    if number < 1:
        raise HostfileError(f"{where}: '{key}={value}' must be at least 1")
    return number


def parse_hostfile(text: str, path: str = "hostfile") -> list[Host]:
    """Parse hostfile ``text`` (``path`` is only used in messages).

    Returns:
        The hosts in file order.

    Raises:
        HostfileError: no hosts; a line without slots; slots that are not a whole number >= 1;
            ``max_slots`` below ``slots``; an unknown key; an invalid hostname; a host named twice.
            The message reads ``hostfile <path> line <n>: <problem>; <what to write instead>``.
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path} line {number}"
        fields = line.split()
        name, rest = fields[0], fields[1:]
        slots = None
        if ":" in name and not _is_ipv6(name):  # MPICH style host:N
            name, _, count = name.rpartition(":")
            slots = _whole(count, where, "slots")
        options = {}
        for field in rest:
            key, eq, value = field.partition("=")
            if not eq:
                raise HostfileError(f"{where}: '{field}' is not key=value; write "
                                    f"'{name} slots=N'")
            if key not in _KNOWN_KEYS:
                raise HostfileError(f"{where}: unknown key '{key}'; the keys are "
                                    f"{', '.join(_KNOWN_KEYS)} (e.g. '{name} slots=2')")
            options[key] = _whole(value, where, key)
        if "slots" in options:
            if slots is not None:
                raise HostfileError(f"{where}: slots given twice ('{fields[0]}' and slots=); "
                                    "keep one")
            slots = options["slots"]
        if slots is None:
            raise HostfileError(f"{where}: '{name}' has no slots; write '{name} slots=N' with N "
                                "the processes to run there")
        if "max_slots" in options and options["max_slots"] < slots:
            raise HostfileError(f"{where}: max_slots={options['max_slots']} is below "
                                f"slots={slots}; raise max_slots or lower slots")
        if not valid_hostname(name):
            raise HostfileError(f"{where}: '{name}' is not a valid hostname or IP address "
                                "(letters, digits, '-' and '.', labels of 1-63 characters)")
        if name in seen:
            raise HostfileError(f"{where}: host '{name}' is already on line {seen[name]}; "
                                "merge them into one line with the total slots")
        seen[name] = number
        hosts.append(Host(name, slots, number))
    if not hosts:
        raise HostfileError(f"hostfile {path} names no hosts; add lines like 'node1 slots=2'")
    return hosts


def _is_ipv6(name: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address)
    except ValueError:
        return False


def read_hostfile(path: str | Path) -> Hostfile:
    """Read, parse and validate the hostfile at ``path``.

    Raises:
        HostfileError: the file cannot be read, or :func:`parse_hostfile`'s errors.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {path}: {exc.strerror or exc}") from None
    hosts = parse_hostfile(text, str(path))
    bare = all(re.fullmatch(r"\S+ slots=[0-9]+", line) for line in text.splitlines())
    mpich = any(":" in line.split("#", 1)[0].split()[0] and not _is_ipv6(line.split()[0])
                for line in text.splitlines() if line.split("#", 1)[0].strip())
    return Hostfile(str(path), hosts, bare, mpich)


def check_np(hostfile: Hostfile, np_: int) -> None:
    """Check that ``np_`` processes fit the hostfile's slots.

    Raises:
        HostfileError: ``np_`` < 1, or more than the total slots.
    """
    if np_ < 1:
        raise HostfileError(f"-np must be at least 1, got {np_}")
    if np_ > hostfile.slots:
        raise HostfileError(f"-np {np_} is more than the {hostfile.slots} slots in hostfile "
                            f"{hostfile.path} ({hostfile.as_h()}); lower -np or add slots")


def format_hostfile(hosts: list[Host], style: str = "openmpi") -> str:
    """Hostfile text for ``hosts``: ``name slots=N`` (``openmpi``) or ``name:N`` (``mpich``)."""
    if style not in ("openmpi", "mpich"):
        raise ValueError(f"style must be openmpi or mpich, got {style!r}")
    fmt = "{0} slots={1}" if style == "openmpi" else "{0}:{1}"
    return "".join(fmt.format(h.name, h.slots) + "\n" for h in hosts)


def passed_env_names(env: dict[str, str], names: tuple[str, ...] = PASS_THROUGH) -> list[str]:
    """Names of the variables in ``env`` that mpirun should forward (``-x NAME``), sorted."""
    chosen = {n for n in names if n in env}
    chosen |= {n for n in env if n.startswith(PASS_PREFIXES)}
    return sorted(chosen)


def _horovodrun_ssh_args(ssh_port: int | None, ssh_identity_file: str | None,
                         network_interfaces: str | None) -> list[str]:
    """horovodrun's options for reaching the hosts (both launch modes)."""
    args = []
    if ssh_port is not None:
        args += ["--ssh-port", str(ssh_port)]
    if ssh_identity_file:
        args += ["--ssh-identity-file", str(ssh_identity_file)]
    if network_interfaces:
        args += ["--network-interfaces", network_interfaces]
    return args


def horovodrun_argv(np_: int, hostfile: Hostfile, command: list[str], *,
                    ssh_port: int | None = None, ssh_identity_file: str | None = None,
                    network_interfaces: str | None = None, gloo: bool = False,
                    mca: dict[str, str] | None = None, knobs: dict[str, str] | None = None,
                    env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """``horovodrun -np N --hostfile F [options] <command>`` (``-H host:N,...`` in place of
    ``--hostfile F`` when the file is not bare ``host slots=N`` lines; see the module docstring).

    horovodrun forwards the whole environment itself. ``mca`` settings go in as
    ``--mpi-args="--mca KEY VALUE ..."`` (MPI controller only); ``knobs`` (from
    :func:`hvdtrain.launch.tuning.horovod_knobs`) as ``--fusion-threshold-mb``, ``--cycle-time-ms``,
    ``--autotune``.

    Returns:
        ``(argv, env)``: the argv list and the environment to run it with (a copy of ``env``).

    Raises:
        ValueError: an empty command.
        HostfileError: an IPv6 address among the hosts (:func:`check_horovodrun_hosts`).
    """
    if not command:
        raise ValueError("no command to launch; put it after '--'")
    check_horovodrun_hosts(hostfile)
    hosts = ["--hostfile", hostfile.path] if hostfile.bare else ["-H", hostfile.as_h()]
    argv = ["horovodrun", "-np", str(np_), *hosts]
    if gloo:
        argv.append("--gloo")
    argv += _horovodrun_ssh_args(ssh_port, ssh_identity_file, network_interfaces)
    if mca and not gloo:
        argv.append("--mpi-args=" + " ".join(f"--mca {k} {v}" for k, v in mca.items()))
    return argv + _knob_flags(knobs) + list(command), dict(env or {})


def check_horovodrun_hosts(hostfile: Hostfile) -> None:
    """horovodrun turns every host into ``host:slots`` and splits that at ':'
    (``horovod/runner/common/util/hosts.py``), so no IPv6 address reaches it whole.

    Raises:
        HostfileError: the first IPv6 address, with its line and what to write instead.
    """
    for host in hostfile.hosts:
        if _is_ipv6(host.name):
            raise HostfileError(f"hostfile {hostfile.path} line {host.line}: '{host.name}' is an "
                                "IPv6 address, which horovodrun cannot take (it splits host:slots "
                                "at ':'); give the host a name (e.g. in /etc/hosts) and write that")


def _knob_flags(knobs: dict[str, str] | None) -> list[str]:
    """horovodrun's flags for Horovod's settings (:func:`hvdtrain.launch.tuning.horovod_knobs`):
    ``--fusion-threshold-mb``, ``--cycle-time-ms``, ``--autotune`` (both launch modes)."""
    knobs = knobs or {}
    argv = []
    if "HOROVOD_FUSION_THRESHOLD" in knobs:
        argv += ["--fusion-threshold-mb", str(int(knobs["HOROVOD_FUSION_THRESHOLD"]) // 2**20)]
    if "HOROVOD_CYCLE_TIME" in knobs:
        argv += ["--cycle-time-ms", knobs["HOROVOD_CYCLE_TIME"]]
    if knobs.get("HOROVOD_AUTOTUNE") == "1":
        argv.append("--autotune")
    return argv


def horovodrun_elastic_argv(np_: int, command: list[str], *, min_np: int | None,
                            max_np: int | None, discovery_script: str | None,
                            ssh_port: int | None = None, ssh_identity_file: str | None = None,
                            network_interfaces: str | None = None,
                            knobs: dict[str, str] | None = None,
                            env: dict[str, str] | None = None,
                            discovered: list[str] | None = None
                            ) -> tuple[list[str], dict[str, str]]:
    """``horovodrun -np N --min-np A --max-np B --host-discovery-script S [...] <command>``
    (Horovod Elastic, Gloo controller), with Horovod's settings ``knobs`` as horovodrun flags,
    as :func:`horovodrun_argv` passes them.

    Without ``network_interfaces`` it adds the one
    :func:`~hvdtrain.launch.discovery.elastic_network_interfaces` decides
    from the hosts the discovery script prints (``--network-interfaces lo`` when every host is
    this machine): horovodrun would otherwise wait silently for a second host. Those hosts are
    ``discovered`` when given, else the script is run once here
    (:func:`~hvdtrain.launch.discovery.discover_hosts`), the one thing this builder runs.

    Raises:
        ValueError: a missing/non-executable discovery script, not ``1 <= A <= N <= B``, or
            (without ``network_interfaces``) a discovery script that fails or prints fewer than
            two hosts that are not all this machine.
    """
    if not command:
        raise ValueError("no command to launch; put it after '--'")
    if not discovery_script or not os.access(discovery_script, os.X_OK):
        raise ValueError(f"--host-discovery-script {discovery_script!r} is not an executable file;"
                         " give a script that prints one 'host:slots' line per available host")
    min_np = min_np or 1
    max_np = max_np or np_
    if not 1 <= min_np <= np_ <= max_np:
        raise ValueError(f"elastic sizes must satisfy 1 <= --min-np ({min_np}) <= -np ({np_}) "
                         f"<= --max-np ({max_np})")
    if not network_interfaces:
        if discovered is None:
            discovered = discover_hosts(discovery_script)
        network_interfaces = elastic_network_interfaces(discovered, discovery_script)
    argv = ["horovodrun", "-np", str(np_), "--min-np", str(min_np), "--max-np", str(max_np),
            "--host-discovery-script", discovery_script]
    argv += _horovodrun_ssh_args(ssh_port, ssh_identity_file, network_interfaces)
    return argv + _knob_flags(knobs) + list(command), dict(env or {})


def mpirun_argv(np_: int, hostfile: Hostfile, command: list[str], *,
                env: dict[str, str] | None = None, allow_run_as_root: bool = False,
                mca: dict[str, str] | None = None,
                knobs: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """``mpirun -np N --hostfile F -bind-to none -map-by slot -x PATH -x LD_LIBRARY_PATH ...
    -mca pml ob1 -mca btl ^openib <command>``, as Horovod's documentation recommends for Open MPI
    (no binding, so each rank's threads may use the cores hvdtrain gives it; ranks placed slot by
    slot; the TCP/shared-memory transports).

    Args:
        np_: processes.
        hostfile: a validated hostfile (an MPICH-style one goes in as ``-H host:N,...``).
        command: the program and its arguments.
        env: the environment to forward (``-x NAME`` for :func:`passed_env_names`).
        allow_run_as_root: add ``--allow-run-as-root`` (needed when running as root).
        mca: extra ``-mca key value`` pairs (e.g. ``{"btl_tcp_if_include": "lo"}``).
        knobs: Horovod settings (:func:`hvdtrain.launch.tuning.horovod_knobs`), added to the
            environment and forwarded.

    Returns:
        ``(argv, env)``.

    Raises:
        ValueError: an empty command.
    """
    if not command:
        raise ValueError("no command to launch; put it after '--'")
    env = {**(env or {}), **(knobs or {})}
    argv = ["mpirun"]
    if allow_run_as_root:
        argv.append("--allow-run-as-root")
    hosts = (["-H", hostfile.as_h()] if hostfile.mpich or hostfile.virtual
             else ["--hostfile", hostfile.path])
    argv += ["-np", str(np_), *hosts, "-bind-to", "none", "-map-by", "slot"]
    for name in passed_env_names(env):
        argv += ["-x", name]
    for key, value in {"pml": "ob1", "btl": "^openib", **(mca or {})}.items():
        argv += ["-mca", key, value]
    return argv + list(command), env
