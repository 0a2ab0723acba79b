"""A worker pod's main process under Kubeflow's MPI Operator: ``hvdtrain worker -- /usr/sbin/sshd -De``.

Kubernetes ends a pod (a node drain, a preemption, ``kubectl delete``) with SIGTERM to each of
its containers' main process, then, ``terminationGracePeriodSeconds`` later, SIGKILL to whatever
still runs. The operator's worker pods run ``sshd -De`` as that process. sshd exits on SIGTERM at
once, and a container ends with its main process: every rank that the launcher's ``mpirun``
started in the pod over ssh is killed without having seen the SIGTERM, and nothing is
checkpointed.

``hvdtrain worker -- COMMAND`` runs COMMAND (sshd) as its child. On SIGTERM (or SIGINT) it sends
SIGTERM to the ranks running in this container, holding it for a rank that does not catch it yet
(:func:`hvdtrain.launch.signals.signal_local_ranks`), and waits until they have exited: the ranks
agree to stop after the same optimizer step, rank 0 writes the stop checkpoint, and every rank
exits 75 (:mod:`hvdtrain.run.preempt`), on this pod and on the others. Then it ends COMMAND and
exits 0. When COMMAND ends by itself, ``hvdtrain worker`` exits with its status. As a container's
PID 1 it also reaps the orphaned processes that are left to it.

A rank here is what :func:`hvdtrain.launch.signals.rank_pids` calls one, of any launch, below
this process: a process started under COMMAND (or left to this process, which is made the
subreaper of its descendants, ``PR_SET_CHILD_SUBREAPER``, when it is not PID 1) whose environment
has a rank variable its launcher gave it (``OMPI_COMM_WORLD_RANK``, ...) that this process's own
environment does not have. In a pod that is every rank of the job on that pod.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from hvdtrain.launch import signals as rank_signals

PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
STOPPING = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.1  # seconds between looks at the child and the ranks


def _say(message: str) -> None:
    print(f"hvdtrain worker: {message}", file=sys.stderr, flush=True)


def _reap(child: int) -> int | None:
    """Reap every exited child (this process may be PID 1: orphans become its children);
    the exit status of ``child`` when it was among them (128 + N for a signal N), else None."""
    status = None
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == child:
            status = os.waitstatus_to_exitcode(raw)
            status = 128 - status if status < 0 else status


def run_worker(command: list[str], proc: str = "/proc") -> int:
    """Run ``command`` as a worker pod's main process (see the module's docstring).

    After a SIGTERM/SIGINT it waits for the ranks it signalled without a limit of its own (the
    kubelet's SIGKILL at the end of the grace period is the limit: the pod then exits 137).
    Processes that look like ranks and appear later (a rank started after the signal, a rank's
    helper left to this process when the rank exited) get SIGTERM too; once the first ranks have
    exited, they are waited for :data:`hvdtrain.launch.signals.HOLD_S` seconds at most, then
    left to the container's end. A SIGTERM that comes before this function has installed its
    handlers (Python's start, about half a second) is lost to a container's PID 1, which has no
    default action: the pod then waits for the kubelet's SIGKILL.

    Args:
        command: the program and its arguments, e.g. ``["/usr/sbin/sshd", "-De"]``.
        proc: the proc file system (a folder of the same shape in tests).

    Returns:
        0 after a SIGTERM/SIGINT once the ranks and ``command`` have ended; otherwise
        ``command``'s exit status (128 + N when a signal N ended it), 127 when it cannot be
        started.
    """
    stop: list[int] = []
    for sig in STOPPING:
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    libc = ctypes.CDLL(None, use_errno=True)
    if os.getpid() != 1 and libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1)) != 0:
        _say(f"cannot become the subreaper of what runs below (prctl: "
             f"{os.strerror(ctypes.get_errno())}): a rank whose parent ends is no longer found")
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        _say(f"cannot start {command[0]!r}: {exc}")
        return 127
    # This process alone reaps the child (waitpid(-1), also for orphans), so Popen's own
    # poll/wait/send_signal are never used: the pid stays the child's until reaped here.
    pid, ended = child.pid, []

    def reap() -> bool:
        """Reap what has exited; whether the child has ended."""
        if not ended and (status := _reap(pid)) is not None:
            ended.append(status)
        return bool(ended)

    inherited = rank_signals.inherited_rank_vars(os.environ)
    while not stop:
        if reap():
            return ended[0]
        time.sleep(POLL_S)

    name = signal.Signals(stop[0]).name
    me = os.getpid()
    first = rank_signals.rank_pids(None, proc, inherited, ancestor=me)
    if first:
        sent = rank_signals.signal_local_ranks(signal.SIGTERM, None, proc, inherited,
                                               hold_s=rank_signals.HOLD_S, ancestor=me)
        _say(f"{name}: SIGTERM sent to {sent} rank(s) in this pod (pids {first}); waiting for "
             "them to checkpoint and exit")
        t0, signalled, first_done = time.monotonic(), set(first), None
        while True:
            reap()
            now = rank_signals.rank_pids(None, proc, inherited, ancestor=me)
            for late in set(now) - signalled:  # started after the signal, or left to us
                signalled.add(late)
                try:
                    os.kill(late, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            if not now:
                break
            if not set(first) & set(now):
                first_done = first_done or time.monotonic()
                if time.monotonic() - first_done > rank_signals.HOLD_S:
                    _say(f"still running {rank_signals.HOLD_S:.0f} s after the ranks: pids "
                         f"{now}, left to the pod's end")
                    break
            time.sleep(POLL_S)
        _say(f"the ranks exited after {time.monotonic() - t0:.1f} s")
    else:
        _say(f"{name}: no rank runs in this pod")
    if not reap():
        os.kill(pid, signal.SIGTERM)  # not reaped yet, so still the child's pid
        while not reap():
            time.sleep(POLL_S)
    return 0


def main(argv: list[str]) -> int:
    """``hvdtrain worker -- COMMAND [ARG ...]``; exit status 2 without a command."""
    command = argv[1:] if argv[:1] == ["--"] else list(argv)
    if not command:
        _say("give the command to run, e.g. hvdtrain worker -- /usr/sbin/sshd -De")
        return 2
    return run_worker(command)
