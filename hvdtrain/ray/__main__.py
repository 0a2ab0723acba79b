"""Run a command as Horovod ranks on a Ray cluster, one Ray Train worker each: ``horovodrun``
for Ray.

    python -m hvdtrain.ray -np 2 --address 127.0.0.1:6379 -- \\
        hvdtrain train --framework torch --dataset mnist --output-dir /shared/runs/mnist

Each rank is a child process of its Ray Train worker, with the ``HOROVOD_*`` variables
:class:`hvdtrain.ray.HorovodConfig` sets; rank 0's output comes back here. With
``--max-failures N`` Ray restarts the whole group after a failure, up to N times, and a
restarted ``hvdtrain train`` resumes from the last checkpoint in its ``--output-dir`` (which
must be a path every node reaches). ``hvdtrain train`` options and the cluster's CPUs are
checked before the group starts. Exit status: 0 when every rank succeeded; 1 when the ranks
failed and Ray gave up; 2 on bad input, too few CPUs, or a cluster that cannot be reached.

Ray's token authentication works as for ``ray.init``: connecting to a local cluster found
without ``--address`` turns it on when a token exists (``~/.ray/auth_token``,
``RAY_AUTH_TOKEN_PATH`` or ``RAY_AUTH_TOKEN``); with ``--address`` (or ``RAY_ADDRESS``) Ray
sends the token only under ``RAY_AUTH_MODE=token``, and a refusal says so.
"""
from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hvdtrain.ray",
        description="Run a command as Horovod ranks, one per Ray Train worker (Gloo).")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="ranks, one Ray Train worker (and --cpus-per-rank CPUs) each")
    p.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else a running "
                                     "local cluster, else a new local Ray)")
    p.add_argument("--max-failures", type=int, default=0,
                   help="restarts of the group Ray may make after a failure (default 0)")
    p.add_argument("--storage-path", help="Ray Train's storage for the run (default: Ray's, "
                                          "~/ray_results)")
    p.add_argument("--name", help="the run's name in that storage (default: Ray's)")
    p.add_argument("--cpus-per-rank", type=float, default=1.0,
                   help="CPUs Ray reserves for each rank (default 1)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for every rank (repeatable)")
    p.add_argument("--nics", help="network interface for Gloo (of a comma-separated list, the "
                                  "first; default: the one holding each node's address)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    return p


def connect_error(exc: BaseException, address: str | None) -> str:
    """What to say when ``ray.init(address=address)`` raised ``exc``: the cluster and Ray's
    reason, and, when the cluster refused this driver's token (Ray's ``AuthenticationError`` or
    its ``InvalidAuthToken`` anywhere in the chain of causes: Ray passes the GCS client's error
    on as text), how to give it one."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    where = f"the Ray cluster at {address}" if address else "a Ray cluster"
    if not any(type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e)
               for e in chain):
        reasons = [(str(e).strip().splitlines() or [repr(e)])[0] for e in chain]
        return f"cannot connect to {where}: " + "; ".join(dict.fromkeys(reasons))
    token = ("the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN "
             "(`ray get-auth-token` on its head prints it)")
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return f"{where} refused this driver's token: run with {token}"
    return (f"{where} runs with token authentication (`ray start --head` turns it on where "
            "~/.ray/auth_token exists) and refused this driver, which sent no token: given an "
            "address (--address or RAY_ADDRESS), Ray sends one only with RAY_AUTH_MODE=token. "
            f"Run with RAY_AUTH_MODE=token and {token}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hvdtrain.launch.engine_args import (check_train_command, engine_command,
                                              key_value_pairs)
    env = key_value_pairs(args.env, "--env", parser)
    command = engine_command(parser, args.command, env)
    if args.np < 1:
        parser.error("-np must be >= 1")
    if args.max_failures < 0:
        parser.error("--max-failures must be >= 0")
    problem = check_train_command(command, engine="Ray")
    if problem:
        print(f"hvdtrain: error: {problem}", file=sys.stderr)
        return 2
    try:
        import ray
    except ImportError:
        print("hvdtrain.ray: error: ray is not installed: pip install 'hvdtrain[ray]' (or "
              "HVDTRAIN_ENGINES=ray bash scripts/setup_engines.sh in a checkout)",
              file=sys.stderr)
        return 2
    from hvdtrain.ray.job import NotEnoughResourcesError, RayJobError, run_command
    try:
        ray.init(address=args.address, logging_level="WARNING", log_to_driver=True)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        print(f"hvdtrain.ray: error: {connect_error(exc, args.address)}", file=sys.stderr)
        return 2
    try:
        result = run_command(command, args.np, max_failures=args.max_failures,
                             storage_path=args.storage_path, name=args.name, env=env,
                             nics=args.nics.split(",") if args.nics else None,
                             cpus_per_worker=args.cpus_per_rank)
    except NotEnoughResourcesError as exc:
        print(f"hvdtrain.ray: error: {exc}", file=sys.stderr)
        return 2
    except RayJobError as exc:
        print(f"hvdtrain.ray: error: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"hvdtrain.ray: done; Ray Train's run: {result.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
