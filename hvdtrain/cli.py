"""The ``hvdtrain`` command: ``train``, ``launch``, ``doctor`` and ``report``
(:func:`build_parser`; ``hvdtrain --help`` shows :data:`DESCRIPTION`).

Launch training the way Horovod users do::

    horovodrun -np 2 hvdtrain train --framework torch --dataset digits
    mpirun -np 2 -bind-to none -map-by slot -x PATH hvdtrain train --framework torch

    hvdtrain launch --hostfile hostfiles/two-hosts.txt -np 4 -- hvdtrain train --framework keras

Options are validated before any framework is imported or Horovod starts, so bad input fails in
a second with a message that names the option (exit status 2).
"""
from __future__ import annotations

import argparse
import os
import sys

from hvdtrain import __version__, guard, runtime
from hvdtrain.config import ConfigError, TrainConfig
from hvdtrain.config_args import add_arguments


# What ``hvdtrain --help`` and the sub-commands' help say (plain text: argparse prints it as is).
DESCRIPTION = """\
Data-parallel training with Horovod: one process (rank) per GPU or per share of the CPU
cores, each training on its part of every batch, the gradients averaged over the ranks at
each step. Each command has its own --help."""
EPILOG = """\
examples:
  hvdtrain launch -np 2 -- hvdtrain train --framework torch --dataset mnist
  horovodrun -np 2 -H localhost:2 hvdtrain train --framework keras --dataset digits
  hvdtrain report runs/latest"""
TRAIN_DESCRIPTION = """\
Train a model with Horovod, one process per rank. Start it with a launcher: hvdtrain
launch, horovodrun, mpirun or srun (alone, it trains as one rank). Options the command
line leaves out take the --dataset's recipe, then the defaults shown."""
TRAIN_EPILOG = """\
examples:
  hvdtrain launch -np 2 -- hvdtrain train --framework torch --dataset mnist
  horovodrun -np 2 -H localhost:2 hvdtrain train --framework keras --keras-backend torch
  mpirun -np 2 -bind-to none -map-by slot -x PATH hvdtrain train --precision bf16 -k 4
  srun --mpi=pmix hvdtrain train --dataset mnist --resume auto

exit status: 0 done; 1 the run diverged or --on-nonfinite stop stopped it; 2 a bad option
(checked before Horovod starts); 75 SIGTERM or SIGUSR1 stopped it after a checkpoint."""
LAUNCH_DESCRIPTION = """\
Start COMMAND as -np ranks with horovodrun (default), mpirun or srun. The hosts: --hostfile,
-H, the Slurm allocation, else this host. It prints the command line it runs before running
it (--dry-run: prints it and stops), and what it chose and why on stderr."""
LAUNCH_EPILOG = """\
examples:
  hvdtrain launch -np 2 -- hvdtrain train                     # 2 ranks on this host
  hvdtrain launch -H node1:2,node2:2 -- hvdtrain train        # 4 ranks on two hosts
  hvdtrain launch --hostfile hostfiles/two-hosts.txt -np 4 --check -- hvdtrain train
  hvdtrain launch --launcher mpirun --dry-run -np 2 -- hvdtrain train
  hvdtrain launch --emit mpijob --image IMAGE -np 4 --slots-per-worker 2 -- hvdtrain train

what it runs, e.g. (on a host without GPUs, whose ranks share its cores):
  $ hvdtrain launch --dry-run --hostfile hostfiles/two-hosts.txt -np 4 -- hvdtrain train
  horovodrun -np 4 --hostfile hostfiles/two-hosts.txt '--mpi-args=--mca mpi_yield_when_idle 1' hvdtrain train"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (examples keep their lines); option help wrapped
    between words, never inside an option's name (``--lr-schedule``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _fail(message: str, code: int = 2) -> int:
    """Print ``message`` once per job (on rank 0) and return ``code``."""
    if runtime.launcher_rank() == 0:
        print(f"hvdtrain: error: {message}", file=sys.stderr)
    return code


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdtrain train``, as :class:`TrainConfig` declares them
    (:func:`hvdtrain.config_args.add_arguments`)."""
    add_arguments(parser)


def cmd_train(args: argparse.Namespace) -> int:
    """Validate the options, then run the framework's trainer; 0 on success, 2 on bad input, 1
    when ``--on-nonfinite stop`` or the divergence check (:mod:`hvdtrain.guard`) stopped the
    run, 75 (:data:`hvdtrain.run.preempt.EXIT_PREEMPTED`)
    when SIGTERM/SIGUSR1 stopped it after a checkpoint."""
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    try:
        cfg = TrainConfig.from_options(fields).validate()
        runtime.omp_num_threads()  # a bad OMP_NUM_THREADS, named before any work
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc))
    if not cfg.elastic:  # before any framework import (seconds): a SIGTERM/SIGUSR1 from now
        from hvdtrain.run import preempt  # on stops the run at its first step, checkpointed
        preempt.install_early()
    if cfg.framework == "keras":  # before Keras is imported: it reads the backend once
        os.environ["KERAS_BACKEND"] = cfg.keras_backend
        if cfg.keras_backend == "torch":  # elastic Keras runs on the CPU (keras/elastic.py)
            runtime.use_keras_torch_device("cpu" if cfg.elastic else cfg.device)
    from hvdtrain.launch import tuning
    tuning.openmp_spin()  # before the framework loads OpenMP, which reads it once
    module = f"hvdtrain.{cfg.framework}.{'elastic' if cfg.elastic else 'trainer'}"
    # A torch.optim optimizer imports torch._dynamo when it is made (about 0.8 s): here instead.
    extra = ("torch._dynamo",) if cfg.framework == "torch" else ()
    trainer = runtime.import_frozen(module, *extra)[0]
    fit = trainer.fit_elastic if cfg.elastic else trainer.fit
    try:
        fit(cfg)
    except guard.DivergenceError as exc:  # every rank; rank 0 printed it before they stopped
        return 1 if exc.reported else _fail(str(exc), code=1)
    except runtime.NonFiniteLossError as exc:  # every rank stops at the same step
        return 1 if exc.reported else _fail(str(exc), code=1)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print what Horovod supports here; with ``--hostfile`` also run the multi-host pre-flight
    (:mod:`hvdtrain.launch.preflight`). 1 when the build lacks something hvdtrain needs or a pre-flight
    check failed; 2 on a bad hostfile."""
    from hvdtrain.launch import doctor
    try:
        info = doctor.check_build()
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    print(doctor.report(info))
    issues = doctor.problems(info)
    for note in doctor.notes(info):
        print(f"hvdtrain: note: {note}", file=sys.stderr)
    for issue in issues:
        print(f"hvdtrain: error: {issue}", file=sys.stderr)
    print("status:             " + ("NOT usable" if issues else "ok"))
    if issues:
        return 1
    if args.hostfile:
        return _preflight(args)
    return 0


def _preflight(args: argparse.Namespace) -> int:
    """The pre-flight of ``doctor --hostfile`` and ``launch --check``: 0 when every check
    passed, 1 otherwise (each failure printed with its host, cause and fix), 2 on a bad
    hostfile or -np."""
    from hvdtrain.launch import hostfile as hf
    from hvdtrain.launch import preflight
    try:
        hosts = hf.read_hostfile(args.hostfile)
        np_ = hosts.slots if args.np is None else args.np
        hf.check_np(hosts, np_)
    except hf.HostfileError as exc:
        return _fail(str(exc))
    print(f"pre-flight of {args.hostfile} ({hosts.as_h()}, {np_} ranks):", flush=True)
    checks = preflight.run_checks(hosts, np_, ssh_port=args.ssh_port,
                                  ssh_identity_file=args.ssh_identity_file,
                                  network_interfaces=args.network_interfaces,
                                  timeout_s=args.timeout)
    print(preflight.format_checks(checks), flush=True)
    failed = [c for c in checks if not c.ok]
    if failed:
        return _fail(f"pre-flight failed: {len(failed)} check(s) (see 'fix:' above)", 1)
    return 0


WORKER_DESCRIPTION = (
    "The main process of a worker pod of Kubeflow's MPI Operator (what hvdtrain launch --emit "
    "mpijob writes): runs COMMAND (sshd -De), and on SIGTERM (a node drain, a preemption) sends "
    "it to the ranks running in the pod and waits for them to write the stop checkpoint and "
    "exit 75, then ends COMMAND; without it sshd exits at once and the ranks are killed with "
    "the pod. Exit status: 0 after a SIGTERM or SIGINT; else COMMAND's own (128 + N for a signal "
    "N); 127 when COMMAND cannot be started; 2 without a COMMAND.")


def cmd_worker(args: argparse.Namespace) -> int:
    """``hvdtrain worker -- COMMAND``: :func:`hvdtrain.launch.pod.main`."""
    from hvdtrain.launch.pod import main as worker_main
    return worker_main(args.command)


def cmd_report(args: argparse.Namespace) -> int:
    """Print one line per run directory from its ``metrics.json`` (either framework); with
    ``--json-out`` also write those rows as a JSON list (atomically). 1 when a file is unreadable,
    before anything is printed."""
    import json
    from pathlib import Path

    from hvdtrain.files import write_json
    from hvdtrain.run.report import METRICS_FILE
    rows = []
    for run_dir in args.run_dirs:
        path = Path(run_dir) / METRICS_FILE
        try:
            m = json.loads(path.read_text())
            rows.append({"run": run_dir, "framework": m["framework"],
                         "keras_backend": m.get("versions", {}).get("keras_backend"),
                         "size": m["size"],
                         "global_batch": m["global_batch"], "epochs": len(m["epochs"]),
                         "test_accuracy": m["final_test_accuracy"],
                         "samples_per_sec": m["samples_per_sec"]})
        except (OSError, ValueError, KeyError) as exc:
            return _fail(f"cannot read {path}: {exc!r}", 1)
    print(f"{'run':<28} {'framework':<16} {'size':>4} {'global batch':>12} {'epochs':>6} "
          f"{'test acc':>8} {'samples/s':>10}")
    for r in rows:
        framework = "/".join(filter(None, (r["framework"], r["keras_backend"])))
        # None: the run stopped before its first epoch ended (a non-finite loss, a preemption).
        acc, rate = ("-" if r[k] is None else format(r[k], f) for k, f in
                     (("test_accuracy", ".4f"), ("samples_per_sec", ".0f")))
        print(f"{r['run']:<28} {framework:<16} {r['size']:>4} {r['global_batch']:>12} "
              f"{r['epochs']:>6} {acc:>8} {rate:>10}")
    if args.json_out:
        write_json(args.json_out, rows)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Plan the launch (:func:`hvdtrain.launch.plan.plan`: hostfile, -np, tuning, every launcher
    and mode alike), print its notes and command line, run its checks, then run it (unless
    ``--dry-run``) handing SIGTERM/SIGUSR1 to the ranks (:mod:`hvdtrain.launch.signals`), and
    return its exit status; 2 on bad input, before anything starts."""
    import shutil

    from hvdtrain.launch import slurm
    from hvdtrain.launch.hostfile import HostfileError
    from hvdtrain.launch.plan import PlanError, plan
    from hvdtrain.launch.signals import RankSignals
    if args.emit:  # a Kubeflow manifest on stdout; nothing runs (hvdtrain.launch.kubernetes)
        from hvdtrain.launch.kubernetes import print_manifest
        return print_manifest(args, _fail)
    try:
        runtime.omp_num_threads()  # it goes to every rank: check it here first
        launch = plan(args)
    except (PlanError, ValueError) as exc:
        return _fail(str(exc))
    for note in launch.notes:
        print(f"hvdtrain: {note}", file=sys.stderr)
    if "srun" in launch.checks:
        try:
            slurm.check_srun(launch.env)
        except HostfileError as exc:
            if not args.dry_run:
                return _fail(str(exc))
            print(f"hvdtrain: warning: {exc}", file=sys.stderr)
    if "preflight" in launch.checks and not args.dry_run:
        code = _preflight(args)
        if code:
            return code
    print(launch.shown, flush=True)
    if args.dry_run:
        return 0
    if shutil.which(launch.argv[0], path=launch.env.get("PATH")) is None:
        return _fail(f"{launch.argv[0]} not found on PATH; run 'make setup' (Open MPI and "
                     "Horovod) or use another --launcher")
    return RankSignals(launch.argv, launch.env, launch.launcher, hosts=launch.host_names,
                       ssh_port=launch.ssh_port,
                       ssh_identity_file=launch.ssh_identity_file).run()


def _train_usage() -> str:
    """``hvdtrain train``'s usage line: the two choices every run makes, then the rest."""
    from hvdtrain.config import DATASETS, FRAMEWORKS
    return (f"%(prog)s [--framework {{{','.join(FRAMEWORKS)}}}] "
            f"[--dataset {{{','.join(DATASETS)}}}] [OPTION ...]")


def build_parser() -> argparse.ArgumentParser:
    """The ``hvdtrain`` argument parser with one sub-command per task. It imports neither
    Horovod nor a framework (the documentation renders it with sphinx-argparse)."""
    parser = argparse.ArgumentParser(prog="hvdtrain", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"hvdtrain {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", required=True,
                                metavar="COMMAND")
    train = sub.add_parser("train", help="train a model; run it under a launcher, one process "
                           "per rank", description=TRAIN_DESCRIPTION, epilog=TRAIN_EPILOG,
                           usage=_train_usage(), formatter_class=_Formatter)
    add_train_args(train)
    train.set_defaults(func=cmd_train)
    doctor = sub.add_parser("doctor", help="show what Horovod supports on this machine; with "
                            "--hostfile, check the hosts before a multi-host job",
                            description="Show what this machine's Horovod supports (frameworks, "
                            "MPI, Gloo, NCCL); exit status 1 when hvdtrain cannot use it. With "
                            "--hostfile, then check each host of a multi-host job: ssh, "
                            "versions, a shared network interface, a small all-reduce.",
                            formatter_class=_Formatter)
    doctor.add_argument("--hostfile", help="pre-flight the hosts of this hostfile: ssh, "
                        "versions, a shared network interface, a small all-reduce")
    doctor.add_argument("-np", "--num-proc", dest="np", type=int,
                        help="ranks for the all-reduce (default: all slots)")
    doctor.add_argument("--ssh-port", type=int, help="ssh port of the hosts")
    doctor.add_argument("--ssh-identity-file", help="ssh private key")
    doctor.add_argument("--network-interfaces", help="interfaces the job will use, e.g. eth0")
    doctor.add_argument("--timeout", type=float, default=120.0,
                        help="seconds the all-reduce may take, start included (default 120)")
    doctor.set_defaults(func=cmd_doctor)
    launch = sub.add_parser("launch", help="start a command as N ranks with horovodrun, "
                            "mpirun or srun (this host by default); prints the command it runs",
                            description=LAUNCH_DESCRIPTION, epilog=LAUNCH_EPILOG,
                            usage="%(prog)s [OPTION ...] -- COMMAND [ARG ...]",
                            formatter_class=_Formatter)
    launch.add_argument("--hostfile", help="'host slots=N' lines (or host:N); inside a Slurm "
                        "allocation the allocation's hosts are used when this is left out")
    launch.add_argument("-H", "--hosts", dest="hosts_spec", default=None,
                        metavar="HOST:SLOTS,...",
                        help="the hosts as horovodrun's -H takes them, e.g. node1:2,node2:2 "
                             "(instead of --hostfile; default, with neither and no Slurm "
                             "allocation: this host, localhost:NP)")
    launch.add_argument("-np", "--num-proc", dest="np", type=int,
                        help="processes in all (default: the slots of --hostfile or -H; in a "
                             "Slurm allocation $SLURM_NTASKS)")
    launch.add_argument("--launcher", choices=("horovodrun", "mpirun", "srun"),
                        default="horovodrun",
                        help="srun: Slurm's, as 'srun --mpi=pmix' (default: horovodrun)")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the command line it would run, and run nothing")
    launch.add_argument("--check", action="store_true",
                        help="run the pre-flight of 'hvdtrain doctor --hostfile' first and "
                             "launch only when it passes")
    launch.add_argument("--timeout", type=float, default=120.0,
                        help="--check: seconds the pre-flight all-reduce may take")
    launch.add_argument("--ssh-port", type=int, help="horovodrun: ssh port of the hosts")
    launch.add_argument("--ssh-identity-file", help="horovodrun: ssh private key")
    launch.add_argument("--network-interfaces", help="horovodrun: interfaces to use, e.g. eth0")
    launch.add_argument("--gloo", action="store_true", help="horovodrun: Gloo instead of MPI")
    launch.add_argument("--mca", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Open MPI parameter '-mca KEY VALUE' (repeatable)")
    launch.add_argument("--fusion-threshold-mb", type=int,
                        help="Horovod tensor fusion buffer size (HOROVOD_FUSION_THRESHOLD)")
    launch.add_argument("--cycle-time-ms", type=float,
                        help="Horovod background cycle time (HOROVOD_CYCLE_TIME)")
    launch.add_argument("--autotune", action="store_true",
                        help="let Horovod tune fusion and cycle time while training")
    launch.add_argument("--elastic", action="store_true",
                        help="Horovod Elastic: workers may leave and join (horovodrun, Gloo)")
    launch.add_argument("--min-np", type=int, help="elastic: fewest workers to go on with")
    launch.add_argument("--max-np", type=int, help="elastic: most workers to use")
    launch.add_argument("--host-discovery-script",
                        help="elastic: executable printing the available 'host:slots' lines")
    launch.add_argument("--yield-when-idle", choices=("auto", "on", "off"), default="auto",
                        help="Open MPI's mpi_yield_when_idle=1 (idle ranks give up their core): "
                             "auto = on when no GPU is visible on this host (a CPU job, whose "
                             "ranks fill the cores), off when there is one (default: auto)")
    launch.add_argument("--no-tuning", dest="yield_when_idle", action="store_const", const="off",
                        help="same as --yield-when-idle off")
    from hvdtrain.launch.kubernetes import add_emit_arguments  # --emit mpijob|trainjob (#51)
    add_emit_arguments(launch)
    launch.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the command each rank runs, after --")
    launch.set_defaults(func=cmd_launch)
    worker = sub.add_parser("worker", help="a Kubernetes worker pod's main process: runs "
                            "sshd; on SIGTERM the ranks in the pod checkpoint and exit first",
                            description=WORKER_DESCRIPTION,
                            usage="%(prog)s -- COMMAND [ARG ...]", formatter_class=_Formatter)
    worker.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="what the pod runs, e.g. -- /usr/sbin/sshd -De")
    worker.set_defaults(func=cmd_worker)
    report = sub.add_parser("report", help="compare runs: one line per run directory",
                            description="One line per run directory of hvdtrain train, from its "
                            "metrics.json: framework, ranks, global batch, epochs, test "
                            "accuracy, samples/s.", formatter_class=_Formatter)
    report.add_argument("run_dirs", nargs="+", help="output directories of hvdtrain train")
    report.add_argument("--json-out", help="also write the rows as JSON to this file")
    report.set_defaults(func=cmd_report)
    from hvdtrain.scaling.cli import add_parser as add_plan_parser  # hvdtrain plan (#40)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hvdtrain`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C (hvdtrain launch hands it to every rank): no traceback
        if runtime.launcher_rank() == 0:
            print("hvdtrain: interrupted (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
