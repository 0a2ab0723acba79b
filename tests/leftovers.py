"""Processes a job may have left behind, found by a marker in their command line (the engine
suites, tests/spark and tests/ray; tests/ is on sys.path through tests/conftest.py)."""
import time

import psutil


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``: their pids."""
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if marker in " ".join(p.info["cmdline"] or [])
            and p.info["status"] != psutil.STATUS_ZOMBIE]


def left_after(marker: str, timeout: float = 30.0) -> list[int]:
    """Wait until no process holds ``marker`` (a killed process may take a moment to end, and an
    engine may cancel a task after its driver returned); those still there after ``timeout``
    seconds, or []."""
    deadline = time.monotonic() + timeout
    while (found := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
