"""Signals sent to ``hvdtrain launch`` reach every rank, whatever the launcher.

A scheduler ends a job with a signal to its top process (Slurm's ``scancel`` and time limit,
``sbatch --signal=B:USR1@T``, a container's PID 1, Kubernetes). Launchers do not pass it on
alike: ``horovodrun`` dies at once and leaves its ranks running, orphaned; Open MPI's ``mpirun``
hands SIGTERM to the ranks but SIGKILLs them about a second later (``odls_base_sigkill_timeout``),
so a rank whose step and checkpoint take longer loses them; ``srun`` hands signals to its tasks.

So ``hvdtrain launch`` does not signal ``horovodrun`` or ``mpirun`` with SIGTERM or SIGUSR1: it
gives the job's environment a fresh :data:`LAUNCH_ID_VAR` and, on a signal, sends that signal to
the job's rank processes themselves, on this host (found in ``/proc``) and on every other host of
the job (over ssh, running this module there). The ranks checkpoint and exit 75
(:mod:`hvdtrain.run.preempt`), and the launcher ends as it ends for any job whose ranks exit, with
their status. Under ``srun`` SIGUSR1 goes to srun, which hands it to the tasks; SIGTERM, which
srun would turn into killing them, goes to the ranks as above.

A rank is told apart by what its own launcher gave it: a rank variable (:data:`RANK_VARS`) that
the launch's own environment did not already hold with the same value (an sbatch shell's
``SLURM_PROCID=0`` is inherited by everything it starts, so it marks nothing).

A rank that has not yet installed its handler for the signal (``hvdtrain train`` installs them
first thing, before any framework is imported; see ``SigCgt`` in proc(5)) would die of the
default action and lose the request, so the signal is held for it until it has, for up to
:data:`HOLD_S` seconds; a rank that never catches it then gets it anyway (the default action is
what the sender asked for).

The launcher runs in its own session, so a signal to ``hvdtrain launch``'s process group does not
kill it before the ranks are done. SIGINT (Ctrl-C) stops the job: it goes to the launcher's whole
process group (``horovodrun`` over MPI is ``/bin/sh -c mpirun ...``, and a shell does not pass it
on) and to every rank; whatever still runs :data:`INTERRUPT_GRACE_S` seconds later is killed.

``mpirun`` (also under ``horovodrun`` over MPI) is started with SIGTERM blocked
(``RankSignals.blocks_sigterm``).

Run as ``python -m hvdtrain.launch.signals --signal TERM --launch-id ID`` it signals this host's
ranks of that launch and prints how many it signalled.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path

from hvdtrain.launch import procfs
from hvdtrain.launch import sigmask
from hvdtrain.launch.procfs import catches  # signals' own: tests hold a signal through it

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
# Seconds a SIGTERM/SIGUSR1 waits for a rank that has not installed its handler yet (Python and
# hvdtrain's imports take about a second before ``hvdtrain train`` catches signals), and for the
# ranks to exist at all when the signal comes while the launcher is still starting them.
HOLD_S = 10.0
# Seconds from Ctrl-C to killing whatever of the job still runs.
INTERRUPT_GRACE_S = 8.0


def new_launch_id() -> str:
    """A fresh id for one launch (32 hex digits)."""
    return uuid.uuid4().hex


def rank_pids(launch_id: str | None, proc: str | os.PathLike = "/proc",
              inherited: Mapping[str, str] | None = None,
              ancestor: int | None = None) -> list[int]:
    """This host's rank processes of the launch ``launch_id``.

    A rank is a process whose environment holds ``HVDTRAIN_LAUNCH_ID=launch_id`` (any or none
    when ``launch_id`` is None: a Kubernetes worker pod, where every rank is the one job's,
    :mod:`hvdtrain.launch.pod`) and one of
    :data:`RANK_VARS` with a value other than ``inherited``'s (the launch's own environment: a
    variable the launch already had was inherited, not given by the rank's launcher), that is
    not a shell or launcher daemon (:data:`NOT_RANKS`), and whose parent is not itself such a
    rank (a rank's own children, e.g. data-loader workers, are left to it).

    Args:
        launch_id: the launch's :data:`LAUNCH_ID_VAR`; None: ranks of any launch.
        proc: the proc file system (a folder of the same shape in tests).
        inherited: the rank variables of the launch's own environment (:func:`inherited_rank_vars`).
        ancestor: only processes below this one (:func:`hvdtrain.launch.procfs.descendants`);
            None: any.

    Returns:
        Process ids, ascending (empty when none runs here).
    """
    inherited = inherited or {}
    root = Path(proc)
    found: dict[int, int] = {}  # pid -> parent pid
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        env = procfs.environ(pid, root)
        if not env or launch_id is not None and env.get(LAUNCH_ID_VAR) != launch_id or not any(
                v in env and env[v] != inherited.get(v) for v in RANK_VARS):
            continue
        stat = procfs.stat(pid, root)
        if stat is None or stat[0] in NOT_RANKS:
            continue
        found[pid] = stat[1]
    if ancestor is not None and found:
        below = procfs.descendants(ancestor, root)
        found = {pid: parent for pid, parent in found.items() if pid in below}
    return sorted(pid for pid, parent in found.items() if parent not in found)


def inherited_rank_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The :data:`RANK_VARS` of ``env`` (a launch's own environment): they mark no rank."""
    return {name: env[name] for name in RANK_VARS if name in env}


def signal_local_ranks(sig: int, launch_id: str | None, proc: str | os.PathLike = "/proc",
                       inherited: Mapping[str, str] | None = None,
                       hold_s: float = 0.0, ancestor: int | None = None) -> int:
    """Send ``sig`` to this host's ranks of ``launch_id``.

    Args:
        sig: the signal number.
        launch_id, proc, inherited, ancestor: as for :func:`rank_pids`.
        hold_s: seconds to hold the signal for ranks that do not catch it yet (and, when no rank
            runs here yet, to wait for one to appear); 0 sends at once. A rank still not
            catching it after ``hold_s`` gets it anyway.

    Returns:
        How many ranks were signalled.
    """
    root = Path(proc)
    deadline = time.monotonic() + hold_s
    sent: set[int] = set()
    first_seen = None
    while True:
        found = [pid for pid in rank_pids(launch_id, root, inherited, ancestor)
                 if pid not in sent]
        late = time.monotonic() >= deadline
        for pid in found:
            if late or sig == signal.SIGINT or catches(pid, sig, root) is not False:
                try:
                    os.kill(pid, sig)
                    sent.add(pid)
                except (ProcessLookupError, PermissionError):
                    pass
        first_seen = time.monotonic() if found and first_seen is None else first_seen
        pending = [pid for pid in found if pid not in sent and procfs.alive(pid, root)]
        settled = first_seen is not None and time.monotonic() - first_seen >= 0.5
        if late or (sent and not pending and settled):
            return len(sent)
        time.sleep(0.05)


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (``localhost``, its loopback address, or its own
    hostname); other loopback addresses (``127.0.0.2``: the test hosts) count as other hosts."""
    return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def remote_command(sig: int, launch_id: str, inherited: Mapping[str, str] | None = None,
                   hold_s: float = 0.0) -> list[str]:
    """The command run on another host (over ssh) to signal its ranks: this module, with this
    Python (the hosts of a job share the installation's path)."""
    argv = [sys.executable, "-m", "hvdtrain.launch.signals", "--signal",
            signal.Signals(sig).name.removeprefix("SIG"), "--launch-id", launch_id]
    for name, value in sorted((inherited or {}).items()):
        argv += ["--inherited", f"{name}={value}"]
    if hold_s:
        argv += ["--hold", str(hold_s)]
    return argv


def ssh_argv(host: str, command: list[str], ssh_port: int | None = None,
             ssh_identity_file: str | None = None) -> list[str]:
    """``ssh`` to ``host`` as the launcher reaches it (same port and key), non-interactively."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "ConnectTimeout=10"]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file:
        argv += ["-i", str(ssh_identity_file)]
    return argv + [host, shlex.join(command)]


class RankSignals:
    """Runs a launcher and hands SIGTERM/SIGUSR1/SIGINT to its ranks (see the module docstring).

    Args:
        argv: the launcher's command line.
        env: its environment; a fresh :data:`LAUNCH_ID_VAR` is set in it (an inherited one, from
            another launch's environment, is replaced: it would make that job's ranks ours).
        launcher: ``horovodrun``, ``mpirun`` or ``srun`` (srun: SIGUSR1 goes to srun itself).
        hosts: the job's other hosts' names, reached over ssh with ``ssh_port`` and
            ``ssh_identity_file``; a callable is asked at the signal (elastic: the discovery
            script's hosts then).
        hold_s: :data:`HOLD_S`, seconds a signal waits for ranks that do not catch it yet.
        inherited_from: the environment the launch itself runs in (default ``os.environ``): its
            rank variables mark no rank (:func:`inherited_rank_vars`).
    """

    def __init__(self, argv: list[str], env: dict[str, str], launcher: str, hosts=(),
                 ssh_port: int | None = None, ssh_identity_file: str | None = None,
                 hold_s: float = HOLD_S, inherited_from: Mapping[str, str] | None = None):
        parent = os.environ if inherited_from is None else inherited_from
        given = env.get(LAUNCH_ID_VAR)
        self.launch_id = given if given and given != parent.get(LAUNCH_ID_VAR) else new_launch_id()
        self.argv, self.launcher, self.hold_s = argv, launcher, hold_s
        self.env = {**env, LAUNCH_ID_VAR: self.launch_id}
        self.inherited = inherited_rank_vars(parent)
        self.hosts, self.ssh_port, self.ssh_identity_file = hosts, ssh_port, ssh_identity_file
        self.proc: subprocess.Popen | None = None
        self.delivered: list[tuple[str, int]] = []  # (signal name, local ranks signalled)
        self.interrupted = False  # Ctrl-C came: the job never counts as a success
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        # mpirun answers SIGTERM by killing the ranks a second later, and scancel signals every
        # process of the job: where the ranks are mpirun's it starts with SIGTERM blocked
        # (hvdtrain.launch.sigmask says which launches, and how under horovodrun).
        self.blocks_sigterm = sigmask.blocks_sigterm(argv, launcher, self.env)

    def _remote_hosts(self) -> list[str]:
        hosts = self.hosts() if callable(self.hosts) else self.hosts
        return [h for h in dict.fromkeys(hosts) if not is_local(h)]

    def _to_ranks(self, sig: int, hold_s: float) -> tuple[int, int, int]:
        """``sig`` to every rank of the job: ``(ranks here, ranks on other hosts, other hosts)``."""
        remote = [subprocess.Popen(
            ssh_argv(host, remote_command(sig, self.launch_id, self.inherited, hold_s),
                     self.ssh_port, self.ssh_identity_file),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True) for host in self._remote_hosts()]
        local = signal_local_ranks(sig, self.launch_id, inherited=self.inherited, hold_s=hold_s)
        found = 0
        for ssh in remote:
            try:
                out, _ = ssh.communicate(timeout=30 + hold_s)
                if ssh.returncode == 0 and out.strip():
                    found += int(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError):
                ssh.kill()
        return local, found, len(remote)

    def deliver(self, sig: int) -> None:
        """Send ``sig`` (SIGTERM or SIGUSR1) to every rank of the job (or to srun), holding it
        up to ``hold_s`` for ranks that do not catch it yet; with no rank found anywhere by
        then, to the launcher."""
        while self.proc is None:  # came while the launcher was being started
            time.sleep(0.01)
        if self.launcher == "srun" and sig != signal.SIGTERM:
            # srun hands SIGUSR1 to its tasks (on every host), once this host's catch it; a
            # SIGTERM it would turn into killing them, so that one goes to the ranks as below
            # (on this host at least: one rank's signal stops every rank at the same step).
            self._wait_until_caught(sig)
            self._to_launcher(sig)
            return
        with self._lock:  # one delivery at a time (a second signal waits for the first)
            local, found, hosts = self._to_ranks(sig, self.hold_s)
            name = signal.Signals(sig).name
            self.delivered.append((name, local))
            where = f" and {found} on {hosts} other host(s)" if hosts else ""
            print(f"hvdtrain: {name}: handed to {local} rank(s) on this host{where}"
                  + ("" if local or found else "; none runs, so to the launcher"),
                  file=sys.stderr, flush=True)
            if not (local or found):  # (an mpirun with SIGTERM blocked acts on SIGINT)
                self._to_launcher(signal.SIGINT if self.blocks_sigterm and
                                  sig == signal.SIGTERM else sig)

    def _wait_until_caught(self, sig: int) -> None:
        """Up to ``hold_s``: until this host's ranks exist (3 s) and all catch ``sig``."""
        started = time.monotonic()
        while time.monotonic() - started < self.hold_s and self.proc.poll() is None:
            pids = rank_pids(self.launch_id, inherited=self.inherited)
            if pids and all(catches(pid, sig) is not False for pid in pids):
                return
            if not pids and time.monotonic() - started > 3:
                return
            time.sleep(0.05)

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the launcher's process group and to every rank; whatever of the
        job still runs :data:`INTERRUPT_GRACE_S` seconds later is killed (SIGKILL)."""
        while self.proc is None:  # came while the launcher was being started
            time.sleep(0.01)
        print("hvdtrain: SIGINT: stopping the job", file=sys.stderr, flush=True)
        self.interrupted = True
        self._to_group(signal.SIGINT)
        if self.launcher != "srun":
            self._to_ranks(signal.SIGINT, 0.0)
        try:
            self.proc.wait(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"hvdtrain: the job still runs {INTERRUPT_GRACE_S:g} s after SIGINT: killing "
                  "it", file=sys.stderr, flush=True)
            if self.launcher != "srun":
                self._to_ranks(signal.SIGKILL, 0.0)
            self._to_group(signal.SIGKILL)

    def _to_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the launcher leads its own session and group
            if sig == signal.SIGINT and self.launcher == "srun":
                time.sleep(0.2)  # srun aborts on a second SIGINT within a second
                os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _to_launcher(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def _in_thread(self, target, *args) -> None:
        self._threads.append(threading.Thread(target=target, args=args, daemon=True))
        self._threads[-1].start()

    def start(self) -> subprocess.Popen:
        """Start the launcher in its own session (an MPI one with SIGTERM blocked; under
        ``horovodrun``, its ``mpirun``: :func:`hvdtrain.launch.sigmask.launcher_start`)."""
        env, preexec, shim_dir = sigmask.launcher_start(self.launcher, self.blocks_sigterm,
                                                        self.env)
        if shim_dir is not None:  # removed with this object, or at exit
            weakref.finalize(self, shutil.rmtree, shim_dir, ignore_errors=True)
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                     preexec_fn=preexec)
        return self.proc

    def run(self) -> int:
        """Start the launcher, hand signals on until it exits, return its exit status."""
        previous = {sig: signal.signal(sig, lambda signum, frame: self._in_thread(
            self.deliver, signum)) for sig in FORWARDED}
        previous[signal.SIGINT] = signal.signal(
            signal.SIGINT, lambda signum, frame: self._in_thread(self.interrupt))
        try:
            self.start()  # a signal from here on is handed on (it waits for the start)
            code = self.proc.wait()
            for thread in self._threads:  # a delivery under way finishes (and says so)
                thread.join(timeout=self.hold_s + 35)
            # horovodrun --gloo may end with 0 at once on SIGINT, before its ranks report
            # (seen once in a clean-clone run): a job stopped by Ctrl-C did not succeed.
            return 130 if self.interrupted and code == 0 else code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m hvdtrain.launch.signals --signal TERM --launch-id ID``: signal this host's
    ranks of that launch; prints their count."""
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.launch.signals")
    parser.add_argument("--signal", required=True, choices=("TERM", "USR1", "INT", "KILL"))
    parser.add_argument("--launch-id", required=True)
    parser.add_argument("--inherited", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--hold", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    inherited = dict(item.split("=", 1) for item in args.inherited if "=" in item)
    print(signal_local_ranks(signal.Signals["SIG" + args.signal], args.launch_id,
                             inherited=inherited, hold_s=args.hold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
