"""The driver side of ``hvdtrain.spark``: check the cluster's slots, start the barrier stage, stream
rank 0's output, and turn the stage's end into a result or an error that names the rank."""
from __future__ import annotations

import os
import socket
import sys
import time
import uuid

from hvdtrain.spark import task as spark_task
from hvdtrain.spark.service import DriverService, TaskState

# Spark checks that a barrier stage fits before it starts, and by default retries that check
# 40 times 15 s apart (~10 minutes) before failing. With these, a session hvdtrain makes fails in
# a few seconds; for a session it is given, the check up front (wait_for_slots) does that.
SESSION_CONF = {
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
    # Spark's console progress bar would cut into rank 0's streamed lines.
    "spark.ui.showConsoleProgress": "false",
}


class SparkJobError(RuntimeError):
    """The barrier stage of ``hvdtrain.spark.run`` failed.

    Attributes:
        lost: ``"rank R (Spark task P on HOST)"`` of the first task whose executor vanished
            before its rank ended, or None.
        exit_codes: ``{rank: status}`` of the ranks that ended with a non-zero status, the
            rank that caused the failure first (:func:`hvdtrain.launch.ranks.cause_first`; the
            others often failed only because it did).
        cause: that first rank, the one the message names first; None when no rank exited
            non-zero.
    """

    def __init__(self, message: str, lost: str | None = None,
                 exit_codes: dict[int, int] | None = None):
        super().__init__(message)
        self.lost, self.exit_codes = lost, dict(exit_codes or {})

    @property
    def cause(self) -> int | None:
        return next(iter(self.exit_codes), None)


class NotEnoughSlotsError(SparkJobError):
    """The cluster has fewer task slots than ranks asked for (barrier mode needs one per rank,
    all at once)."""


def active_context(spark=None, master: str | None = None, app_name: str = "hvdtrain",
                   conf: dict[str, str] | None = None):
    """The SparkContext to run on: ``spark`` (a SparkSession or SparkContext), else the active
    one (when neither ``master`` nor ``conf`` is given), else a new session (``master`` or what
    ``spark-submit``/``spark-defaults.conf`` say, with :data:`SESSION_CONF` and ``conf``, which
    wins).

    Returns:
        ``(context, created)``: ``created`` is True when this call made the session.

    Raises:
        SparkJobError: ``spark`` is a Spark Connect session, or the session this call would use
            is one (``SPARK_REMOTE`` set): Spark Connect has no SparkContext, which barrier mode
            and the slot count need; or ``spark`` is neither a SparkSession nor a SparkContext.
    """
    try:
        from pyspark import SparkContext
    except ImportError as exc:
        raise SparkJobError("hvdtrain.spark needs pyspark: pip install 'hvdtrain[spark]' (or "
                            "bash scripts/setup_engines.sh in a checkout)") from exc
    if spark is not None:
        if is_connect_session(spark):
            raise SparkJobError(_CONNECT_MESSAGE)
        if isinstance(spark, SparkContext):
            return spark, False
        from pyspark.sql import SparkSession
        if isinstance(spark, SparkSession):
            return spark.sparkContext, False
        raise SparkJobError(f"spark= takes a SparkSession or a SparkContext, not "
                            f"{type(spark).__name__} {spark!r:.80}; leave it out to use the "
                            f"active session (or a new one from spark-submit's settings)")
    active = SparkContext._active_spark_context
    if active is not None and not master and not conf:
        return active, False
    # SPARK_REMOTE makes getOrCreate() return a Connect session, or (with a master given) raise
    # pyspark's CANNOT_CONFIGURE_SPARK_CONNECT_MASTER before any session exists
    if os.environ.get("SPARK_REMOTE") or (conf or {}).get("spark.api.mode") == "connect":
        raise SparkJobError(_CONNECT_MESSAGE + " (SPARK_REMOTE or spark.api.mode=connect is set)")
    from pyspark.sql import SparkSession
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in {**SESSION_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if is_connect_session(session):  # SPARK_REMOTE (or spark.api.mode=connect) chose Connect
        raise SparkJobError(_CONNECT_MESSAGE)
    return session.sparkContext, True


def is_connect_session(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (``pyspark.sql.connect``): a client of a
    remote driver, with no SparkContext. Told by its class, as asking it for ``sparkContext``
    raises ``PySparkAttributeError`` (an AttributeError) there."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


_CONNECT_MESSAGE = ("hvdtrain.spark needs classic Spark (a SparkContext: barrier mode, the task "
                    "slot count); this is a Spark Connect session. Run the driver on the "
                    "cluster (spark-submit, a notebook attached to a classic cluster)")


def task_slots(sc) -> tuple[int | None, str]:
    """How many tasks the cluster can run at once (what Spark's barrier check counts) and a
    description of where they come from; ``(None, why)`` where Spark does not say."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        slots = int(jsc.maxNumConcurrentTasks(profile))
        executors = max(len(jsc.statusTracker().getExecutorInfos()) - 1, 0)  # minus the driver
    except Exception as exc:  # not a JVM-backed context, or a Spark without these calls
        return None, f"unknown ({type(exc).__name__})"
    cpus = sc.getConf().get("spark.task.cpus", "1")
    if sc.master.startswith("local"):
        return slots, f"master {sc.master}"
    gpus = sc.getConf().get("spark.task.resource.gpu.amount", None)
    per_task = f"spark.task.cpus={cpus}" + (f", spark.task.resource.gpu.amount={gpus}"
                                             if gpus else "")
    return slots, f"{executors} executor(s), {per_task}"


def wait_for_slots(sc, num_proc: int, timeout: float) -> None:
    """Return once the cluster has ``num_proc`` task slots; executors register with a new
    application over a few seconds, so wait up to ``timeout`` seconds for them.

    Raises:
        NotEnoughSlotsError: still fewer slots after ``timeout`` s (the message says how many).
    """
    deadline = time.monotonic() + timeout
    while True:
        slots, where = task_slots(sc)
        if slots is None or slots >= num_proc:
            return
        if time.monotonic() >= deadline:
            raise NotEnoughSlotsError(
                f"{num_proc} ranks need {num_proc} Spark task slots at once (barrier mode: one "
                f"task per rank), but the cluster at {sc.master} has {slots} ({where}) after "
                f"waiting {timeout:g} s. Add workers or cores, or ask for at most {slots} "
                f"ranks (num_proc / -np)")
        time.sleep(0.5)


def driver_host(sc) -> str:
    """The address executors reach the driver by (``spark.driver.host``, as an IP)."""
    host = sc.getConf().get("spark.driver.host", None) or os.environ.get("SPARK_LOCAL_IP") \
        or socket.gethostname()
    return socket.gethostbyname(host)


def run_stage(sc, num_proc: int, job: dict, stdout=None, start_timeout: float = 10.0,
              verbose: bool = True) -> list:
    """Run ``job`` (:func:`hvdtrain.spark.task.make_task`) on ``num_proc`` barrier tasks and
    return what they yielded, ``[(rank, result), ...]`` by rank.

    Raises:
        NotEnoughSlotsError: too few task slots (within ``start_timeout`` s).
        SparkJobError: a rank failed or a task was lost (the message names it).
    """
    wait_for_slots(sc, num_proc, start_timeout)
    group = f"hvdtrain-{uuid.uuid4().hex[:12]}"
    note = (lambda msg: print(f"hvdtrain.spark: {msg}", file=sys.stderr, flush=True)) \
        if verbose else (lambda msg: None)

    def on_lost(state: TaskState) -> None:
        note(f"{state.where()} was lost (its connection dropped before the rank ended): "
             "ending the job")
        sc.cancelJobGroup(group)

    service = DriverService(driver_host(sc), out=stdout, on_lost=on_lost)
    job = dict(job, driver=service.address, cwd=os.getcwd())
    started = time.monotonic()
    note(f"starting {num_proc} ranks on {sc.master} (barrier stage, Gloo)")
    try:
        sc.setJobGroup(group, f"hvdtrain: {num_proc} Horovod ranks", interruptOnCancel=True)
        rdd = sc.parallelize(range(num_proc), num_proc)
        rows = rdd.barrier().mapPartitions(spark_task.make_task(job)).collect()
    except Exception as exc:
        raise _job_error(exc, service, num_proc, time.monotonic() - started) from None
    finally:
        service.close()
        _clear_job_group(sc)
    return sorted(rows, key=lambda row: row[0])


def _clear_job_group(sc) -> None:
    try:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    except Exception:
        pass


def _job_error(exc: Exception, service: DriverService, num_proc: int,
               seconds: float) -> SparkJobError:
    """The error the driver raises for a failed stage: lost tasks first, then failed ranks
    (with their last output), then Spark's own first line."""
    time.sleep(0.5)  # the tasks' last messages may still be on their way
    spark_line = _spark_reason(exc)
    failed = service.failed()
    codes = {t.rank: t.code for t in failed}
    lost = service.first_lost
    if "BarrierJobSlotsNumberCheckFailed" in str(exc):
        return NotEnoughSlotsError(f"{num_proc} ranks need {num_proc} Spark task slots at once "
                                   f"(barrier mode) and the cluster has fewer: {spark_line}")
    parts = []
    if lost is not None:
        parts.append(f"{lost.where()} was lost after {lost.lost_at - lost.started_at:.1f} s: its "
                     "executor or worker went away before the rank ended. Rerun the job "
                     "(hvdtrain train: --resume auto continues from the last checkpoint)")
    for i, t in enumerate(failed):
        first = " first" if i == 0 and len(failed) > 1 else ""
        parts.append(f"{t.where()}{first} exited with {t.code}; its last output:\n"
                     f"{t.tail[-1500:].rstrip()}")
    if not parts:
        parts.append(f"the Spark stage failed after {seconds:.1f} s")
    parts.append(f"Spark: {spark_line}")
    return SparkJobError("\n".join(parts), lost=lost.where() if lost else None,
                         exit_codes=codes)


def _spark_reason(exc: Exception) -> str:
    text = str(exc)
    for marker in ("Lost task", "BarrierJobSlotsNumberCheckFailed", "cancelled", "Job aborted"):
        for line in text.splitlines():
            if marker in line:
                return line.strip(" :")[:500]
    return (text.strip().splitlines() or [type(exc).__name__])[0][:500]
