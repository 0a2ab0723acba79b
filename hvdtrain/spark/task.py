"""What each Spark task of ``hvdtrain.spark.run`` does on its executor (barrier mode, one task per
rank, as Spark's ``TorchDistributor`` starts torchrun):

1. learn every task's host from ``BarrierTaskContext.getTaskInfos()`` and lay the ranks out as
   ``horovodrun`` would (:func:`hvdtrain.launch.ranks.slot_plan`; task 0 is rank 0);
2. task 0 starts Horovod's Gloo rendezvous on its own address and shares the port with
   ``allGather``, which also shares the GPUs Spark gave each task: every rank on a host sees that
   host's tasks' GPUs in local-rank order (:func:`hvdtrain.launch.ranks.shared_visible_devices`),
   so the one it picks by local rank is its own task's;
3. each task runs its rank as a child process with ``horovodrun``'s ``HOROVOD_*`` variables,
   rank 0's output streamed to the driver, every rank's written to the executor's stderr log;
4. all tasks meet at a barrier before task 0 stops the rendezvous; a rank that failed fails its
   task (Spark then ends the stage) with its exit status and last lines of output.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from hvdtrain.launch import ranks

ENGINE = "spark"


class RankFailed(RuntimeError):
    """A rank's process ended with a non-zero status (message: where, how, its last output)."""


def make_task(job: dict):
    """The function Spark runs on each partition of the barrier stage.

    Args:
        job: ``payload`` (cloudpickled ``(fn, args, kwargs)``) or ``command`` (argv), ``driver``
            (the :class:`~hvdtrain.spark.service.DriverService` address), ``env`` (extra
            variables), ``nics`` (interface names or None), ``return_all`` (every rank's result
            back, not only rank 0's).

    Returns:
        A function of a partition's iterator yielding ``(rank, result)``: the function's
        return value (cloudpickled bytes) or the command's exit status; from rank 0 only unless
        ``return_all``.
    """
    def task(_rows):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        partition = ctx.partitionId()
        hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
        plan = ranks.slot_plan(hosts)
        slot = plan[partition]
        server = None
        try:
            if partition == 0:
                server = ranks.Rendezvous(hosts[0], plan)
            # Task 0's rendezvous port, and the GPUs Spark gave each task.
            shared = [json.loads(m) for m in ctx.allGather(json.dumps(
                {"port": server.port if server else None, "gpus": _task_gpus(ctx)}))]
            port = int(shared[0]["port"])
            visible = ranks.shared_visible_devices(plan, [m["gpus"] for m in shared])[partition]
            code, result = _run_rank(job, slot, hosts, partition, port, visible)
            ctx.barrier()  # every rank done before task 0 drops the rendezvous
        finally:
            if server is not None:
                server.stop()
        if job["return_all"] or slot.rank == 0:
            yield slot.rank, result
    return task


def _task_gpus(ctx) -> list[str]:
    """The GPU addresses Spark's resource scheduling gave this task (``spark.task.resource.gpu
    .amount``), ``[]`` without."""
    gpu = ctx.resources().get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def _run_rank(job: dict, slot, hosts: list[str], partition: int, port: int,
              visible: str | None = None):
    from hvdtrain.spark.service import TaskLink
    host = hosts[partition]
    iface = job["nics"][0] if job["nics"] else ranks.iface_of(host)
    env = ranks.rank_env(slot, hosts[0], port, iface, ENGINE, job["env"])
    if visible is not None:  # the GPUs Spark assigned, not the executor's or local-rank guesses
        env["CUDA_VISIBLE_DEVICES"] = visible
    link = TaskLink(job["driver"], partition, slot.rank, host, os.getpid())
    log = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None

    def sink(chunk: bytes) -> None:
        if log is not None:  # the executor's stderr log keeps every rank's output
            log.write(chunk)
            log.flush()
        if slot.rank == 0:
            link.output(chunk)

    with tempfile.TemporaryDirectory(prefix=f"hvdtrain-rank{slot.rank}-") as tmp:
        result_file = Path(tmp) / "result.pkl"
        if job.get("payload") is not None:
            payload = Path(tmp) / "payload.pkl"
            payload.write_bytes(job["payload"])
            argv = ranks.function_argv(payload, result_file)
        else:
            argv = list(job["command"])
        # The driver's working directory where the executor has it too (a shared file
        # system), as horovodrun does on its hosts; else the task's own.
        cwd = job.get("cwd") if job.get("cwd") and os.path.isdir(job["cwd"]) else None
        try:
            rank = ranks.RankProcess(argv, env, sink, cwd=cwd)
        except OSError as exc:  # the program is not there on this executor (the driver has it)
            message = f"rank {slot.rank} (Spark task {partition} on {host}) cannot start: {exc}"
            link.exit(127, message, time.time())
            link.close()
            raise RankFailed(message) from exc
        try:
            code = rank.wait()
        finally:
            rank.kill()
        failed_at = ranks.raised_at(result_file) or time.time()
        link.exit(code, rank.tail_text(), failed_at)
        link.close()
        if code != 0:
            raise RankFailed(f"rank {slot.rank} (Spark task {partition} on {host}) "
                             f"{ranks.describe_exit(code)}; its last output:\n"
                             f"{rank.tail_text()[-2000:]}")
        if job.get("payload") is not None:
            return code, result_file.read_bytes()
        return code, code
