"""Run a command as Horovod ranks on Spark tasks: ``horovodrun`` for a Spark cluster.

    python -m hvdtrain.spark --master spark://HOST:7077 -np 2 -- \\
        hvdtrain train --framework torch --dataset mnist --output-dir /shared/runs/mnist

    spark-submit --master spark://HOST:7077 \\
        "$(python -c 'import hvdtrain.spark.__main__ as m; print(m.__file__)')" -np 2 -- \\
        hvdtrain train --framework torch --dataset mnist --output-dir /shared/runs/mnist

    python -m hvdtrain.spark -np -2 -- hvdtrain train ...   # 2 processes on this machine

Each rank is a child of one task of a barrier stage; rank 0's output comes back here. The
``--output-dir`` must be a path every executor reaches (rank 0 writes ``metrics.json``,
TensorBoard and checkpoints there). ``hvdtrain train`` options are checked here before Spark
starts. Exit status: 0 when every rank succeeded; when ranks failed, the status of the one
that caused it (named first in the message; the others often failed only because it did); 1
when a task was lost; 2 on bad input (a command that is not found included) or too few task
slots.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hvdtrain.spark",
        description="Run a command as Horovod ranks, one per Spark task (barrier mode, Gloo).")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="ranks, one Spark task slot each; negative: that many processes on "
                        "this machine, without Spark")
    p.add_argument("--master", help="Spark master URL (default: spark-submit's --master, "
                                    "spark-defaults.conf, or an active session)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="Spark setting for the session (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for every rank (repeatable)")
    p.add_argument("--nics", help="network interface for Gloo (of a comma-separated list, the "
                                  "first; default: the one holding each executor's address)")
    p.add_argument("--start-timeout", type=float, default=10.0,
                   help="seconds to wait for enough task slots (default 10)")
    p.add_argument("--log-level", default="WARN", help="Spark's log level (default WARN)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hvdtrain.launch.engine_args import (check_train_command, engine_command,
                                              key_value_pairs)
    conf = key_value_pairs(args.conf, "--conf", parser)
    env = key_value_pairs(args.env, "--env", parser)
    command = engine_command(parser, args.command, env)
    if args.np == 0:
        parser.error("-np must not be 0")
    problem = check_train_command(command, engine="Spark")
    if problem:
        print(f"hvdtrain: error: {problem}", file=sys.stderr)
        return 2
    import hvdtrain.spark as hs
    from hvdtrain.spark.driver import active_context
    nics = args.nics.split(",") if args.nics else None
    sc = None
    created = False
    try:
        if args.np > 0:
            # a Spark Connect session (SPARK_REMOTE) is refused there with SparkJobError
            sc, created = active_context(master=args.master, conf=conf)
            sc.setLogLevel(args.log_level)
        return hs.run_command(command, args.np, spark=sc, env=env, nics=nics,
                              start_timeout=args.start_timeout)
    except hs.NotEnoughSlotsError as exc:
        print(f"hvdtrain.spark: error: {exc}", file=sys.stderr)
        return 2
    except hs.SparkJobError as exc:
        print(f"hvdtrain.spark: error: {exc}", file=sys.stderr)
        codes = exc.exit_codes
        code = codes.get(exc.cause, 1) if codes and not exc.lost else 1
        return code if 0 < code < 256 else 1
    finally:
        if created:
            sc.stop()


if __name__ == "__main__":
    sys.exit(main())
