"""Reading the process table (``/proc``, proc(5)): a process's environment, name and parent,
the processes below one or in one process group or session, whether one has exited or catches
a signal. Linux only; every function takes ``proc``, a folder of the same shape, for tests."""
from __future__ import annotations

import os
from pathlib import Path


def environ(pid: int, proc: Path) -> dict[str, str] | None:
    """The environment of process ``pid`` (``/proc/PID/environ``); None when it is gone or
    not ours to read (a zombie's reads empty: {})."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _stat_fields(pid: int, proc: Path) -> tuple[str, list[str]] | None:
    """``(comm, the fields after it)`` of ``/proc/PID/stat`` (state, ppid, pgrp, ...); None
    when it is gone. comm may hold spaces and parentheses: it ends at the last ``)``."""
    try:
        text = (Path(proc) / str(pid) / "stat").read_text(errors="replace")
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def stat(pid: int, proc: Path) -> tuple[str, int] | None:
    """``(comm, parent pid)`` of ``pid`` (``/proc/PID/stat``); None when it is gone."""
    found = _stat_fields(pid, proc)
    return None if found is None else (found[0], int(found[1][1]))


def _members(field: int, value: int, proc: str | os.PathLike) -> list[int]:
    """Process ids, the calling process and zombies left out, whose ``/proc/PID/stat`` field
    ``field`` (counted after comm: 0 state, 2 process group, 3 session) is ``value``."""
    found = []
    for entry in Path(proc).iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            fields = _stat_fields(int(entry.name), Path(proc))
            if fields is not None and fields[1][0] != "Z" and int(fields[1][field]) == value:
                found.append(int(entry.name))
    return found


def group_members(pgid: int, proc: str | os.PathLike = "/proc") -> list[int]:
    """Process ids in process group ``pgid`` (``/proc/PID/stat``), the calling process and
    zombies left out.

    Raises:
        OSError: ``proc`` cannot be listed.
    """
    return _members(2, pgid, proc)


def session_members(sid: int, proc: str | os.PathLike = "/proc") -> list[int]:
    """Process ids in session ``sid`` (``/proc/PID/stat``), the calling process and zombies left
    out. A session outlives its leader's exit, and the kernel gives no new process an id that
    still names a session, so this finds what a launcher started in a session of its own
    (``setsid``) started, with the launcher gone too.

    Raises:
        OSError: ``proc`` cannot be listed.
    """
    return _members(3, sid, proc)


def descendants(pid: int, proc: str | os.PathLike = "/proc") -> set[int]:
    """Process ids below ``pid``: its children, their children, and so on (``/proc/PID/stat``).

    Raises:
        OSError: ``proc`` cannot be listed.
    """
    root = Path(proc)
    children: dict[int, list[int]] = {}
    for entry in root.iterdir():
        if entry.name.isdigit():
            found_stat = stat(int(entry.name), root)
            if found_stat is not None:
                children.setdefault(found_stat[1], []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def catches(pid: int, sig: int, proc: str | os.PathLike = "/proc") -> bool | None:
    """Whether process ``pid`` has a handler installed for ``sig`` (the ``SigCgt`` mask of
    ``/proc/PID/status``, proc(5)); None when it is gone or unreadable."""
    try:
        text = (Path(proc) / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    return None


def alive(pid: int, proc: Path) -> bool:
    """Whether ``pid`` runs (a zombie has exited)."""
    try:  # a zombie has exited
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
