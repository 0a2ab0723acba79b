"""``num_proc < 0``: run ``-num_proc`` ranks as processes on the driver itself, as Databricks'
HorovodRunner did for ``np < 0`` (a quick check before using the cluster). No Spark involved: a
Gloo rendezvous on 127.0.0.1 and the same rank processes as on the executors."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hvdtrain.launch import ranks

ENGINE = "spark-driver"
LOOPBACK = "127.0.0.1"


def run_local(n: int, payload: bytes | None = None, command: list[str] | None = None,
              env: dict | None = None, stdout=None, return_all: bool = False) -> list:
    """Run ``n`` ranks on this machine and return ``[(rank, result), ...]`` (rank 0's only
    unless ``return_all``): pickled return values for ``payload``, exit statuses for
    ``command``.

    Raises:
        hvdtrain.spark.SparkJobError: a rank failed (the others are killed; the message names
            it and quotes its last output).
    """
    from hvdtrain.spark.driver import SparkJobError
    out = stdout if stdout is not None else sys.stdout
    plan = ranks.slot_plan([LOOPBACK] * n)
    server = ranks.Rendezvous(LOOPBACK, plan)

    def sink(chunk: bytes) -> None:
        out.write(chunk.decode("utf-8", "replace"))
        out.flush()

    procs, rows = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="hvdtrain-local-") as tmp:
            argvs = []
            for slot in plan:
                if payload is not None:
                    src = Path(tmp) / "payload.pkl"
                    src.write_bytes(payload)
                    argvs.append(ranks.function_argv(src, Path(tmp) / f"result{slot.rank}.pkl"))
                else:
                    argvs.append(list(command))
            for slot, argv in zip(plan, argvs):
                e = ranks.rank_env(slot, LOOPBACK, server.port, "lo", ENGINE, env)
                try:
                    procs.append(ranks.RankProcess(argv, e, sink if slot.rank == 0 else None))
                except OSError as exc:
                    raise SparkJobError(f"rank {slot.rank} (a process on the driver) cannot "
                                        f"start: {exc}", exit_codes={slot.rank: 127}) from exc
            with ranks.signals_to(procs):  # Ctrl-C: the ranks have process groups of their own
                failed = _wait_all(procs, [Path(tmp) / f"result{slot.rank}.pkl" for slot in plan]
                                   if payload is not None else None)
            if failed:
                rank, code = failed
                raise SparkJobError(
                    f"rank {rank} (a process on the driver) {ranks.describe_exit(code)}; its "
                    f"last output:\n{procs[rank].tail_text()[-1500:].rstrip()}",
                    exit_codes={rank: code})
            for slot in plan:
                if return_all or slot.rank == 0:
                    result = (Path(tmp) / f"result{slot.rank}.pkl").read_bytes() \
                        if payload is not None else 0
                    rows.append((slot.rank, result))
    finally:
        for proc in procs:
            proc.kill()
        server.stop()
    return rows


def _wait_all(procs: list, results: list[Path] | None = None) -> tuple[int, int] | None:
    """Wait for every rank; after the first non-zero exit, give the others a second to fail
    too (they usually do, because it did), kill the rest, and return ``(rank, status)`` of the
    rank that caused it (:func:`hvdtrain.launch.ranks.cause_first`)."""
    import time
    pending = dict(enumerate(procs))
    failures, deadline = {}, None
    while pending:
        for rank, proc in list(pending.items()):
            code = proc.proc.poll()
            if code is None:
                continue
            proc.wait()
            del pending[rank]
            if code != 0:
                stamp = ranks.raised_at(results[rank]) if results else None
                failures[rank] = (code, stamp or time.time())
                deadline = deadline or time.monotonic() + 1.0
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not failures:
        return None
    for other in pending.values():
        other.kill()
    for other in pending.values():
        other.wait()
    first = ranks.cause_first([(r, at, procs[r].tail_text()) for r, (_, at) in failures.items()])
    return first[0][0], failures[first[0][0]][0]
