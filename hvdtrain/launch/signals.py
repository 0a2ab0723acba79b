"""SIGTERM and SIGUSR1 sent to ``hvdtrain launch`` reach every rank, whatever the launcher.

A scheduler ends a job with a signal to its top process (Slurm's ``scancel`` and time limit,
``sbatch --signal=B:USR1@T``, a container's PID 1, Kubernetes). Launchers do not pass it on
alike: ``horovodrun`` dies at once and leaves its ranks running, orphaned; Open MPI's ``mpirun``
hands SIGTERM to the ranks but SIGKILLs them about a second later (``odls_base_sigkill_timeout``),
so a rank whose step and checkpoint take longer loses them; ``srun`` hands signals to its tasks.

So ``hvdtrain launch`` does not signal ``horovodrun`` or ``mpirun``: it marks the job's
environment with :data:`LAUNCH_ID_VAR` and, on a signal, sends that signal to the job's rank
processes themselves, on this host (found in ``/proc``) and on every other host of the job
(over ssh, running this module there). The ranks checkpoint and exit 75
(:mod:`hvdtrain.run.preempt`), and the launcher ends as it ends for any job whose ranks exit, with
their status. Under ``srun`` the signal goes to srun, which hands it to the tasks. The launcher
runs in its own session, so a signal to ``hvdtrain launch``'s process group does not kill it
before the ranks are done; SIGINT (Ctrl-C) still goes to the launcher, which stops the job.

Run as ``python -m hvdtrain.launch.signals --signal TERM --launch-id ID`` it signals this host's
ranks of that launch and prints how many it found.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

LAUNCH_ID_VAR = "HVDTRAIN_LAUNCH_ID"
# A process of the job is a rank when its environment has one of these (what Horovod's, Open
# MPI's, PMIx's and Slurm's launchers give each rank).
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
# Processes that carry a rank's environment without being the rank: the shells and helpers a
# launcher starts it through, and the launchers' own daemons.
NOT_RANKS = frozenset({"sh", "bash", "dash", "zsh", "ssh", "env", "timeout", "orted", "prted",
                       "mpirun", "mpiexec", "orterun", "prterun", "horovodrun", "srun"})
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def new_launch_id() -> str:
    """A fresh id for one launch (32 hex digits)."""
    return uuid.uuid4().hex


def _environ(pid: int, proc: Path) -> dict[str, str] | None:
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _stat(pid: int, proc: Path) -> tuple[str, int] | None:
    """``(comm, parent pid)`` of ``pid``."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    return comm, int(text[text.rindex(")") + 2:].split()[1])


def rank_pids(launch_id: str, proc: str | os.PathLike = "/proc") -> list[int]:
    """This host's rank processes of the launch ``launch_id``.

    A rank is a process whose environment holds ``HVDTRAIN_LAUNCH_ID=launch_id`` and one of
    :data:`RANK_VARS`, that is not a shell or launcher daemon (:data:`NOT_RANKS`), and whose
    parent is not itself such a rank (a rank's own children, e.g. data-loader workers, are left
    to it).

    Returns:
        Process ids, ascending (empty when none runs here).
    """
    root = Path(proc)
    found: dict[int, int] = {}  # pid -> parent pid
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        env = _environ(pid, root)
        if not env or env.get(LAUNCH_ID_VAR) != launch_id or not any(v in env for v in RANK_VARS):
            continue
        stat = _stat(pid, root)
        if stat is None or stat[0] in NOT_RANKS:
            continue
        found[pid] = stat[1]
    return sorted(pid for pid, parent in found.items() if parent not in found)


def signal_local_ranks(sig: int, launch_id: str, proc: str | os.PathLike = "/proc") -> int:
    """Send ``sig`` to this host's ranks of ``launch_id``; returns how many were signalled."""
    sent = 0
    for pid in rank_pids(launch_id, proc):
        try:
            os.kill(pid, sig)
            sent += 1
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (``localhost``, its loopback address, or its own
    hostname); other loopback addresses (``127.0.0.2``: the test hosts) count as other hosts."""
    return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def remote_command(sig: int, launch_id: str) -> list[str]:
    """The command run on another host (over ssh) to signal its ranks: this module, with this
    Python (the hosts of a job share the installation's path)."""
    return [sys.executable, "-m", "hvdtrain.launch.signals", "--signal",
            signal.Signals(sig).name.removeprefix("SIG"), "--launch-id", launch_id]


def ssh_argv(host: str, command: list[str], ssh_port: int | None = None,
             ssh_identity_file: str | None = None) -> list[str]:
    """``ssh`` to ``host`` as the launcher reaches it (same port and key), non-interactively."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "ConnectTimeout=10"]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file:
        argv += ["-i", str(ssh_identity_file)]
    return argv + [host, " ".join(command)]


class RankSignals:
    """Runs a launcher and hands SIGTERM/SIGUSR1 to its ranks (see the module docstring).

    Args:
        argv: the launcher's command line.
        env: its environment; :data:`LAUNCH_ID_VAR` is added.
        launcher: ``horovodrun``, ``mpirun`` or ``srun`` (srun: signals go to srun itself).
        hosts: the job's other hosts' names, reached over ssh with ``ssh_port`` and
            ``ssh_identity_file``; a callable is asked at the signal (elastic: the discovery
            script's hosts then).
    """

    def __init__(self, argv: list[str], env: dict[str, str], launcher: str, hosts=(),
                 ssh_port: int | None = None, ssh_identity_file: str | None = None):
        self.launch_id = env.get(LAUNCH_ID_VAR) or new_launch_id()
        self.argv, self.launcher = argv, launcher
        self.env = {**env, LAUNCH_ID_VAR: self.launch_id}
        self.hosts, self.ssh_port, self.ssh_identity_file = hosts, ssh_port, ssh_identity_file
        self.proc: subprocess.Popen | None = None
        self.delivered: list[tuple[str, int]] = []  # (signal name, local ranks signalled)

    def _remote_hosts(self) -> list[str]:
        hosts = self.hosts() if callable(self.hosts) else self.hosts
        return [h for h in dict.fromkeys(hosts) if not is_local(h)]

    def deliver(self, sig: int) -> None:
        """Send ``sig`` to every rank of the job (or to srun); with no rank found anywhere yet
        (the job is still starting), to the launcher."""
        if self.proc is None:
            return
        if self.launcher == "srun":
            self._to_launcher(sig)
            return
        local = signal_local_ranks(sig, self.launch_id)
        remote = []
        for host in self._remote_hosts():
            remote.append(subprocess.Popen(
                ssh_argv(host, remote_command(sig, self.launch_id), self.ssh_port,
                         self.ssh_identity_file),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True))
        found = 0
        for ssh in remote:
            try:
                out, _ = ssh.communicate(timeout=30)
                if ssh.returncode == 0 and out.strip():
                    found += int(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError):
                ssh.kill()
        name = signal.Signals(sig).name
        self.delivered.append((name, local))
        where = f" and {found} on {len(remote)} other host(s)" if remote else ""
        print(f"hvdtrain: {name}: handed to {local} rank(s) on this host{where}"
              + ("" if local or found else "; none runs yet, so to the launcher"),
              file=sys.stderr, flush=True)
        if not (local or found):
            self._to_launcher(sig)

    def _to_launcher(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def run(self) -> int:
        """Start the launcher, hand signals on until it exits, return its exit status."""
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        previous = {sig: signal.signal(sig, lambda signum, frame: self.deliver(signum))
                    for sig in FORWARDED}
        previous[signal.SIGINT] = signal.signal(
            signal.SIGINT, lambda signum, frame: self._to_launcher(signal.SIGINT))
        try:
            return self.proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m hvdtrain.launch.signals --signal TERM --launch-id ID``: signal this host's
    ranks of that launch; prints their count."""
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.launch.signals")
    parser.add_argument("--signal", required=True, choices=("TERM", "USR1", "INT"))
    parser.add_argument("--launch-id", required=True)
    args = parser.parse_args(argv)
    print(signal_local_ranks(signal.Signals["SIG" + args.signal], args.launch_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
