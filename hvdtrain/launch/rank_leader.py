"""The leader of one rank's process group: ``python -m hvdtrain.launch.rank_leader PPID -- CMD...``.

:class:`hvdtrain.launch.ranks.RankProcess` starts every engine rank (Spark tasks, the Spark
driver's local ranks, Ray Train workers) through this small program, so that whatever the rank
starts goes with it (#48 item 4: ``-- bash train.sh`` left ``python train.py`` running, and the
engine's ``wait()`` stalled for as long as that orphan held the output pipe):

- it makes a process group of its own (``setpgid``) and runs CMD in it, so the whole group can
  be ended at once (``killpg``; :meth:`hvdtrain.launch.ranks.RankProcess.kill`);
- it asks the kernel for SIGTERM when PPID, the process that started it, dies
  (``PR_SET_PDEATHSIG``), and then ends the whole group with SIGKILL: an executor or a Ray
  worker that dies leaves nothing behind. This runs here, after ``exec``, not in a
  ``preexec_fn`` between fork and exec (where CPython warns that a multi-threaded parent, as a
  Spark or Ray worker is, can deadlock);
- SIGINT, SIGTERM, SIGUSR1 and SIGHUP sent to it go on to CMD (as ``horovodrun`` hands them to
  its ranks), so ``hvdtrain train`` still writes its stop checkpoint;
- when CMD ends, whatever CMD left in the group gets SIGKILL, and this process ends as CMD did:
  the same exit status, or the same signal;
- a guard process in the group (:func:`guard`) ends the group when this one is killed outright
  (Ray SIGKILLs its exiting worker's children, this process among them).

Linux only (``prctl``); elsewhere :class:`hvdtrain.launch.ranks.RankProcess` runs CMD directly.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from hvdtrain.launch import procfs

PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def term_on_parent_death() -> None:
    """Ask the kernel for SIGTERM when this process's parent dies (``PR_SET_PDEATHSIG``)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def end_group() -> None:
    """SIGKILL to every other process in this process's group."""
    for pid in procfs.group_members(os.getpgrp()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def guard(leader: int) -> None:
    """A second process in the group that ends it when the leader is killed outright: Ray, as
    its worker exits, SIGKILLs that worker's children (the leaders), which then cannot act.
    It asks for SIGTERM when ``leader`` dies, ignores every other signal sent to the group, and
    never returns (the leader's :func:`end_group` ends it with the rest)."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)

    def on_term(signum, frame):
        if os.getppid() != leader:
            os.killpg(0, signal.SIGKILL)  # the group, this process last

    signal.signal(signal.SIGTERM, on_term)
    term_on_parent_death()
    if os.getppid() != leader:
        os.killpg(0, signal.SIGKILL)
    while True:
        signal.pause()


def main(argv: list[str] | None = None) -> int:
    """Lead one rank: ``argv`` is ``[PPID, "--", CMD, ARGS...]`` (default ``sys.argv[1:]``).

    Returns:
        CMD's exit status (when CMD was killed by a signal this process kills itself with that
        signal instead of returning); 2 on a bad command line; 127 when CMD cannot be started;
        1 when PPID had already died.
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m hvdtrain.launch.rank_leader PPID -- CMD [ARGS...]",
              file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    os.setpgid(0, 0)
    term_on_parent_death()
    if os.getppid() != parent:  # the parent died before the request above took effect
        return 1
    if os.fork() == 0:  # the guard (this process is single-threaded here: fork is safe)
        guard(os.getppid())
    child: subprocess.Popen | None = None

    def on_signal(signum, frame):
        if os.getppid() != parent:  # PR_SET_PDEATHSIG: the engine's process is gone
            end_group()
            os._exit(128 + signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, on_signal)
    try:
        child = subprocess.Popen(command)  # stdin, stdout, stderr: this process's
    except OSError as exc:
        print(f"hvdtrain: cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127
    code = child.wait()  # (a forwarded signal's handler runs, then the wait goes on: PEP 475)
    end_group()
    if code < 0:  # end as CMD did: killed by the same signal
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
