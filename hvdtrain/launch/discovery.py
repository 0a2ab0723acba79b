"""Horovod Elastic's hosts at launch time: run the host discovery script once, tell whether the
hosts it prints are this machine, and choose the ``--network-interfaces`` an elastic launch needs
(:func:`hvdtrain.launch.hostfile.horovodrun_elastic_argv`)."""
from __future__ import annotations

import ipaddress
import socket
import subprocess


def discover_hosts(script: str, timeout: float = 30.0) -> list[str]:
    """Run a Horovod Elastic host discovery script once and return the hosts it prints.

    The script prints one line per available host, ``host:slots`` or ``host`` (horovodrun's
    format; blank lines are skipped).

    Args:
        script: path of the executable script.
        timeout: seconds it may take.

    Returns:
        The host names, in the order printed.

    Raises:
        ValueError: the script cannot be run, exits non-zero, takes longer than ``timeout``, or
            prints a line whose slots are not a whole number.
    """
    try:
        proc = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ValueError(f"--host-discovery-script {script} did not finish within {timeout:g} s; "
                         "it must print the available hosts and exit") from None
    except OSError as exc:
        raise ValueError(f"--host-discovery-script {script} cannot be run: "
                         f"{exc.strerror or exc}") from None
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines()[-1:] or ["no error output"]
        raise ValueError(f"--host-discovery-script {script} exited with status "
                         f"{proc.returncode} ({said[0]}); it must print one 'host:slots' line per "
                         "available host and exit 0")
    hosts = []
    for line in proc.stdout.splitlines():
        name, colon, slots = line.strip().partition(":")
        if not name:
            continue
        if colon and not slots.isdigit():
            raise ValueError(f"--host-discovery-script {script} printed {line!r}, which is not "
                             "'host:slots' with slots a whole number (e.g. 'node1:2')")
        hosts.append(name)
    return hosts


def _local_addresses() -> set[str]:
    """This machine's IPv4 addresses: its interfaces' (psutil, which horovodrun uses too), else
    what its own host name resolves to."""
    try:
        import psutil  # a dependency of Horovod, so present wherever horovodrun is
        return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family == socket.AF_INET}
    except ImportError:
        try:
            return set(socket.gethostbyname_ex(socket.gethostname())[2])
        except OSError:
            return set()


def is_local_host(name: str) -> bool:
    """True when host ``name`` is this machine: it resolves to a loopback address (all of
    127.0.0.0/8 and ::1 are this machine) or to an address of one of its network interfaces (the
    test horovodrun uses to decide which hosts are remote). A name that does not resolve is not
    local."""
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return False
    return ipaddress.ip_address(address).is_loopback or address in _local_addresses()


def loopback_interface() -> str:
    """The network interface that holds 127.0.0.1 (found as horovodrun finds it; ``lo`` on
    Linux, also when psutil is missing)."""
    try:
        import psutil
    except ImportError:
        return "lo"
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return "lo"


def elastic_network_interfaces(hosts: list[str], script: str) -> str | None:
    """What ``--network-interfaces`` an elastic launch needs when the user gave none, from the
    hosts its discovery script printed at launch.

    horovodrun (0.28.1) without ``--network-interfaces`` waits until two hosts are available to
    compare their network interfaces (``gloo_run._get_min_start_hosts``), silently, for up to
    ``--elastic-timeout`` (600 s): with one host it never starts. So:

    * every host is this machine (:func:`is_local_host`): the loopback interface
      (:func:`loopback_interface`), which is what horovodrun uses for local hosts anyway;
    * two or more hosts, not all local: None (horovodrun compares their interfaces itself);
    * one remote host, or none: an error saying what to add.

    Raises:
        ValueError: fewer than two hosts and not all of them local.
    """
    if hosts and all(is_local_host(h) for h in hosts):
        return loopback_interface()
    if len(hosts) >= 2:
        return None
    printed = f"only {hosts[0]}" if hosts else "no hosts"
    raise ValueError(
        f"--host-discovery-script {script} printed {printed} now, and Horovod Elastic without "
        "--network-interfaces waits (without a word, up to its 600 s --elastic-timeout) for two "
        "hosts to compare their network interfaces; add --network-interfaces IFACE, the "
        "interface the hosts reach each other on (e.g. eth0)")
