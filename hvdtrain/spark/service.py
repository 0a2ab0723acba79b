"""The driver's side channel to the tasks of one ``hvdtrain.spark.run``: every task connects,
says which rank it runs where, rank 0 streams its output, and each says how its rank ended. A
connection that closes before that marks the task as lost (its executor or worker died), which
the driver reports at once and turns into the end of the job.

One JSON object per line: ``{"t": "hello", "token", "partition", "rank", "host", "pid"}``, then
``{"t": "out", "s": text}`` (rank 0), then ``{"t": "exit", "code", "tail", "failed_at"}``. The server binds to
the driver's address only and drops connections without the run's random token.
"""
from __future__ import annotations

import codecs
import json
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TaskState:
    """What the driver heard from one task."""
    partition: int
    rank: int
    host: str
    pid: int
    code: int | None = None  # the rank's exit status, once reported
    tail: str = ""
    lost_at: float | None = None  # time.monotonic() when the connection dropped before "exit"
    ended_at: float | None = None  # time.monotonic() when the rank's exit was reported
    failed_at: float | None = None  # time.time() on its host: raised, else process end
    started_at: float = field(default_factory=time.monotonic)

    def where(self) -> str:
        return f"rank {self.rank} (Spark task {self.partition} on {self.host})"


class DriverService:
    """Listens on ``host`` for the tasks of one run.

    Args:
        host: the driver's address as the executors reach it (``spark.driver.host``).
        out: where rank 0's output goes (default ``sys.stdout``).
        on_lost: called once with the :class:`TaskState` of the first task lost.
    """

    def __init__(self, host: str, out=None, on_lost: Callable[[TaskState], None] | None = None):
        self.token = secrets.token_hex(16)
        self.tasks: dict[int, TaskState] = {}
        self.first_lost: TaskState | None = None
        self._out = out if out is not None else sys.stdout
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="hvdtrain-spark-service").start()

    @property
    def address(self) -> tuple[str, int, str]:
        return self.host, self.port, self.token

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        state = None
        with conn, conn.makefile("r", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:
                    return
                if state is None:
                    if msg.get("t") != "hello" or msg.get("token") != self.token:
                        return
                    state = TaskState(msg["partition"], msg["rank"], msg["host"], msg["pid"])
                    with self._lock:
                        self.tasks[state.partition] = state
                elif msg["t"] == "out":
                    self._out.write(msg["s"])
                    self._out.flush()
                elif msg["t"] == "exit":
                    state.code, state.tail = msg["code"], msg.get("tail", "")
                    state.ended_at = time.monotonic()
                    state.failed_at = msg.get("failed_at") or time.time()
        if state is not None and state.code is None and not self._closed:
            state.lost_at = time.monotonic()
            with self._lock:
                first = self.first_lost is None
                if first:
                    self.first_lost = state
            if first and self._on_lost is not None:
                self._on_lost(state)

    def failed(self) -> list[TaskState]:
        """Tasks whose rank exited with a non-zero status, the one that caused the failure
        first (the others often fail only because it did;
        :func:`hvdtrain.launch.ranks.cause_first`)."""
        from hvdtrain.launch.ranks import cause_first
        by_rank = {t.rank: t for t in self.tasks.values() if t.code not in (None, 0)}
        order = cause_first([(t.rank, t.failed_at, t.tail) for t in by_rank.values()])
        return [by_rank[rank] for rank, _, _ in order]

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class TaskLink:
    """A task's connection to the :class:`DriverService` (``address`` from the driver)."""

    def __init__(self, address: tuple[str, int, str], partition: int, rank: int, host: str,
                 pid: int, timeout: float = 30.0):
        host_, port, token = address
        self._sock = socket.create_connection((host_, port), timeout=timeout)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._send({"t": "hello", "token": token, "partition": partition, "rank": rank,
                    "host": host, "pid": pid})

    def _send(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            self._sock.sendall(data)

    def output(self, chunk: bytes) -> None:
        """Forward a chunk of the rank's output (bytes; split characters are rejoined)."""
        text = self._decoder.decode(chunk)
        if text:
            self._send({"t": "out", "s": text})

    def exit(self, code: int, tail: str, failed_at: float | None = None) -> None:
        """Report the rank's exit status, last output and ``failed_at`` (seconds since the
        epoch: when its exception was raised, else when its process ended)."""
        self._send({"t": "exit", "code": code, "tail": tail, "failed_at": failed_at})

    def close(self) -> None:
        self._sock.close()
