"""Horovod on Spark: run a training function, or the ``hvdtrain train`` job, as one Horovod rank per
Spark task, scheduled by Spark itself (a barrier stage, as Spark's ``TorchDistributor`` runs
torchrun), with Horovod's Gloo rendezvous hosted by task 0::

    import hvdtrain.spark

    def main(lr):
        import horovod.torch as hvd
        hvd.init()
        ...
        return model_state

    state = hvdtrain.spark.run(main, num_proc=2, kwargs={"lr": 0.01})   # rank 0's return value

    from hvdtrain.spark import HorovodRunner          # Databricks' signature
    HorovodRunner(np=2).run(main, lr=0.01)

    python -m hvdtrain.spark --master spark://HOST:7077 -np 2 -- hvdtrain train --dataset mnist

A DataFrame as the ranks' training data (in place of Horovod's Spark Estimators and their Store)::

    data = hvdtrain.spark.save_dataframe(df, "/shared/train", columns=["features", "label"])
    hvdtrain.spark.run(main, 2, args=(data,))   # in main: data.shard(hvd.rank(), hvd.size())

Needs ``pip install hvdtrain[spark]`` (pyspark) on the driver and the executors, hvdtrain and
Horovod on the executors, and a classic SparkContext (not Spark Connect). Importing this module
does not import pyspark; ``import hvdtrain`` does not import this module. docs/engines/spark.md
has the cluster set-up, the fault behaviour and the migration from ``horovod.spark.run``.
"""
from __future__ import annotations

from hvdtrain.spark.data import SavedDataFrame, save_dataframe
from hvdtrain.spark.driver import NotEnoughSlotsError, SparkJobError

__all__ = ["run", "run_command", "HorovodRunner", "SparkJobError", "NotEnoughSlotsError",
           "save_dataframe", "SavedDataFrame"]


def run(main, num_proc: int, args: tuple = (), kwargs: dict | None = None, *, spark=None,
        env: dict | None = None, stdout=None, start_timeout: float = 10.0,
        nics: list[str] | None = None, return_all: bool = False, verbose: bool = True):
    """Run ``main(*args, **kwargs)`` as ``num_proc`` Horovod ranks on Spark tasks and return rank
    0's return value.

    Each rank is a child process of its Spark task, in a process group of its own that ends
    whole (so a rank's crash, a task Spark kills, or a process the rank started leaves nothing
    behind: :class:`hvdtrain.launch.ranks.RankProcess`) with the variables ``horovodrun``'s
    Gloo launcher sets;
    ``hvd.init()`` inside ``main`` joins them. Rank 0's stdout and stderr are streamed to
    ``stdout`` on the driver; every rank's output is also in its executor's stderr log.

    Args:
        main: the function, pickled with cloudpickle (a closure or a function of ``__main__``
            is fine); it must import its framework itself.
        num_proc: ranks (one Spark task slot each, all at once). ``num_proc < 0`` runs
            ``-num_proc`` ranks as processes on the driver, without Spark (HorovodRunner's
            ``np < 0``).
        args, kwargs: passed to ``main``.
        spark: a SparkSession or SparkContext; default: the active one, else a new session
            (master from ``spark-submit`` or ``spark-defaults.conf``).
        env: extra environment variables for every rank.
        stdout: a text stream for rank 0's output (default ``sys.stdout``).
        start_timeout: seconds to wait for the cluster to offer ``num_proc`` task slots.
        nics: the network interface for Gloo, e.g. ``["eth0"]`` (of several, the first, as
            Horovod's Gloo launcher takes); default: the interface holding each executor's
            address.
        return_all: return every rank's value as a list by rank (``horovod.spark.run``'s
            return), not only rank 0's.
        verbose: print one line when the stage starts and when a task is lost (stderr).

    Returns:
        Rank 0's return value (a list by rank with ``return_all``).

    Raises:
        NotEnoughSlotsError: the cluster has fewer than ``num_proc`` task slots (raised after
            at most ``start_timeout`` s; the message says how many it has).
        SparkJobError: a rank raised or exited non-zero (the message quotes its last output),
            or a task was lost with its executor (the message names the rank and task); before
            any task, pyspark missing, ``spark`` neither a SparkSession nor a SparkContext, or a
            Spark Connect session (given, or made under ``SPARK_REMOTE``), which has no
            SparkContext for barrier mode.
        ValueError: ``num_proc`` is 0.
    """
    import cloudpickle
    payload = cloudpickle.dumps((main, tuple(args), dict(kwargs or {})))
    rows = _run(num_proc, dict(payload=payload, command=None), spark, env, stdout,
                start_timeout, nics, return_all, verbose)
    values = [cloudpickle.loads(result) for _, result in rows]
    return values if return_all else values[0]


def run_command(command: list[str], num_proc: int, *, spark=None, env: dict | None = None,
                stdout=None, start_timeout: float = 10.0, nics: list[str] | None = None,
                verbose: bool = True) -> int:
    """Run ``command`` (argv, e.g. ``["hvdtrain", "train", "--dataset", "mnist"]``) as
    ``num_proc`` Horovod ranks on Spark tasks, as ``horovodrun -np N command`` would on hosts;
    the executors' Python environment's ``bin`` comes first on each rank's ``PATH``.

    Returns:
        0 when every rank exited with 0.

    Raises:
        NotEnoughSlotsError: as :func:`run`.
        SparkJobError: as :func:`run`; its ``exit_codes`` holds the ranks' non-zero statuses.
        ValueError: ``command`` is empty, ``num_proc`` is 0, or ``command`` is ``hvdtrain train
            --elastic`` (before Spark starts anything:
            :func:`hvdtrain.launch.engine_args.engine_refusal`).
    """
    if not command:
        raise ValueError("no command to run: give it after --, e.g. -- hvdtrain train")
    from hvdtrain.launch.engine_args import engine_refusal
    problem = engine_refusal(list(command), "Spark")
    if problem:
        raise ValueError(problem)
    _run(num_proc, dict(payload=None, command=list(command)), spark, env, stdout,
         start_timeout, nics, False, verbose)
    return 0


def _run(num_proc, job, spark, env, stdout, start_timeout, nics, return_all, verbose) -> list:
    if not isinstance(num_proc, int) or num_proc == 0:
        raise ValueError(f"num_proc must be a non-zero whole number (ranks on Spark tasks; "
                         f"negative: processes on the driver), not {num_proc!r}")
    env = {str(k): str(v) for k, v in (env or {}).items()}
    if num_proc < 0:
        from hvdtrain.spark.local import run_local
        return run_local(-num_proc, payload=job["payload"], command=job["command"], env=env,
                         stdout=stdout, return_all=return_all)
    from hvdtrain.spark import driver
    sc, _ = driver.active_context(spark)
    job = dict(job, env=env, nics=list(nics) if nics else None, return_all=return_all)
    return driver.run_stage(sc, num_proc, job, stdout=stdout, start_timeout=start_timeout,
                            verbose=verbose)


class HorovodRunner:
    """Databricks' ``sparkdl.HorovodRunner`` on hvdtrain: a notebook written for it runs after
    ``from hvdtrain.spark import HorovodRunner`` replaces ``from sparkdl import HorovodRunner``.

    Args:
        np: ranks on Spark tasks; ``np < 0``: ``-np`` processes on the driver (for a quick
            check, as in Databricks' runner).
        driver_log_verbosity: ``"all"`` (default here) streams rank 0's output to the driver;
            ``"log_callback_only"`` (Databricks' default) keeps it in the executors' logs.

    Raises:
        ValueError: another ``driver_log_verbosity``.
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all"):
        if driver_log_verbosity not in ("all", "log_callback_only"):
            raise ValueError("driver_log_verbosity must be 'all' or 'log_callback_only', not "
                             f"{driver_log_verbosity!r}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main, **kwargs):
        """Run ``main(**kwargs)`` on the ranks and return rank 0's return value."""
        import io
        quiet = self.driver_log_verbosity == "log_callback_only"
        return run(main, self.num_processor, kwargs=kwargs, stdout=io.StringIO() if quiet
                   else None)
