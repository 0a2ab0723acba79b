"""Reads Horovod timelines (Chrome-trace JSON written by rank 0 with ``hvd.start_timeline``, which
needs ``HOROVOD_TIMELINE=DYNAMIC`` in the environment before ``hvd.init()``), to count the
collective operations Horovod really executed.

Each collective Horovod executes on a tensor appears as a begin event (``"ph": "B"``) named after
the operation (``ALLREDUCE``, ``BROADCAST``, ...) on a track (``pid``) named after the tensor.
"""
from __future__ import annotations

import json
import time
from pathlib import Path


def load_events(path: str | Path, wait_seconds: float = 10.0) -> list[dict]:
    """The timeline's events. The file is written by a background thread and may lack its
    closing bracket; waits up to ``wait_seconds`` for it to appear and parse."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            text = Path(path).read_text().strip().rstrip(",")
            if not text.endswith("]"):
                text += "]"
            return json.loads(text)
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def count_ops(events: list[dict], op: str = "ALLREDUCE", skip_prefix: str = "hvdtrain.") -> int:
    """Executions of ``op`` on tensors whose names do not start with ``skip_prefix`` (hvdtrain's
    own metric all-reduces)."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    return sum(1 for e in events if e.get("ph") == "B" and e.get("name") == op
               and not names.get(e.get("pid"), "").startswith(skip_prefix))
