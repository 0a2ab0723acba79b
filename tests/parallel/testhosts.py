"""Test hosts on this machine: one sshd per loopback address (127.0.0.2, 127.0.0.3, ...), each
accepting only a generated key for root. Open MPI and horovodrun treat every address as a
separate host (they launch through ssh, and Horovod reports local_size 1, cross_size N), while all
traffic stays on the loopback interface.

Used as a context manager; everything it starts is stopped on exit, even on failure::

    with SshTestHosts(2) as hosts:
        hosts.hostfile  # "127.0.0.2 slots=1\\n127.0.0.3 slots=1\\n"
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
# Host key kept between runs so that ~/.ssh/known_hosts (horovodrun's ssh check writes to it)
# stays valid for these addresses.
KEY_DIR = Path(os.environ.get("HVDTRAIN_CACHE", Path.home() / ".cache" / "hvdtrain")) / "testhosts"


# The test hosts share this machine's cores, which a rank cannot see (each host reports
# local_size 1, so each rank would take every core): jobs across them set one thread per rank,
# as a user sets OMP_NUM_THREADS for hosts that share cores (hvdtrain.runtime.thread_budget).
# Three ranks with two threads each on two cores made the elastic test four times slower.
SHARED_CORES_ENV = {"OMP_NUM_THREADS": "1"}


class HostsError(RuntimeError):
    """The machine cannot provide test hosts; the message says why and what to install."""


def _free_port(addresses: list[str]) -> int:
    for port in range(2222, 2300):
        try:
            for address in addresses:
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((address, port))
            return port
        except OSError:
            continue
    raise HostsError("no free port in 2222-2299 on the test addresses")


def _keygen(path: Path) -> None:
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                       check=True)


class SshTestHosts:
    """``count`` sshd test hosts with ``slots`` slots each."""

    def __init__(self, count: int = 2, slots: int = 1,
                 session_env: dict[str, dict[str, str]] | None = None):
        """``session_env``: address -> variables sshd sets in that host's sessions (its
        ``SetEnv``), to give one host a different environment (e.g. other package versions)."""
        self.addresses = [f"127.0.0.{i + 2}" for i in range(count)]
        self.slots = slots
        self.session_env = session_env or {}
        self.procs: list[subprocess.Popen] = []
        self.dir: Path | None = None

    # --- what the tests use ---------------------------------------------------------------
    @property
    def hostfile_text(self) -> str:
        return "".join(f"{a} slots={self.slots}\n" for a in self.addresses)

    @property
    def ssh_options(self) -> list[str]:
        """Options for plain ssh / Open MPI's plm_rsh_args."""
        return ["-p", str(self.port), "-i", str(self.identity), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR"]

    # --- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "SshTestHosts":
        if not os.path.exists(SSHD):
            raise HostsError(f"{SSHD} is missing: install openssh-server ('make setup' does)")
        if os.geteuid() != 0:
            raise HostsError("test hosts need root (sshd on extra loopback addresses)")
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hvdtrain-testhosts-"))
        KEY_DIR.mkdir(parents=True, exist_ok=True)
        host_key = KEY_DIR / "ssh_host_ed25519_key"
        _keygen(host_key)
        self.identity = self.dir / "id_ed25519"
        _keygen(self.identity)
        authorized = self.dir / "authorized_keys"
        shutil.copy(f"{self.identity}.pub", authorized)
        authorized.chmod(0o600)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir
        self.port = _free_port(self.addresses)
        for address in self.addresses:
            # A stale key for this address:port from another run would make ssh refuse.
            subprocess.run(["ssh-keygen", "-R", f"[{address}]:{self.port}"],
                           capture_output=True)
            config = self.dir / f"sshd_{address}.conf"
            config.write_text("\n".join([
                f"ListenAddress {address}", f"Port {self.port}", f"HostKey {host_key}",
                f"AuthorizedKeysFile {authorized}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                "StrictModes no", f"PidFile {self.dir}/sshd_{address}.pid",
                *[f"SetEnv {k}={v}" for k, v in self.session_env.get(address, {}).items()],
                ""]))
            with open(self.dir / f"sshd_{address}.log", "w") as log:
                self.procs.append(subprocess.Popen(
                    [SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                    stderr=log, start_new_session=True))
        deadline = time.monotonic() + 20
        for address in self.addresses:
            while True:
                probe = subprocess.run(["ssh", *self.ssh_options, address, "true"],
                                       capture_output=True, text=True, timeout=30)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    logs = "".join(p.read_text() for p in self.dir.glob("sshd_*.log"))
                    raise HostsError(f"cannot ssh into test host {address}:{self.port}: "
                                         f"{probe.stderr.strip()}\n{logs}")
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        # Orphans of the ssh sessions (orted, ranks) die with their session; kill leftovers.
        subprocess.run(["pkill", "-f", "hvdtrain-testhosts-"], capture_output=True)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
