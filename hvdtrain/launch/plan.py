"""One plan per ``hvdtrain launch``: every launcher (horovodrun, mpirun, srun) and mode (static,
elastic) goes through :func:`plan`, so each gets the same validation, Open MPI tuning and Horovod
settings, and the same signal handling (:mod:`hvdtrain.launch.signals`). The CLI only parses,
prints the plan's notes and command line, runs its checks and runs it.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from hvdtrain.launch import hostfile as hf
from hvdtrain.launch import slurm
from hvdtrain.launch.signals import LAUNCH_ID_VAR, new_launch_id
from hvdtrain.launch.tuning import YIELD_MCA, horovod_knobs, launch_tuning, visible_gpus


class PlanError(ValueError):
    """A launch that cannot start as asked; the message says what to change (exit 2)."""


@dataclass
class LaunchPlan:
    """What ``hvdtrain launch`` runs.

    Attributes:
        launcher: ``horovodrun``, ``mpirun`` or ``srun``.
        argv: the launcher's command line.
        env: its environment (the launch's own :data:`~hvdtrain.launch.signals.LAUNCH_ID_VAR`,
            Horovod settings, and for srun Open MPI's ``OMPI_MCA_*``).
        shown: the exact shell command line printed for the user (srun: with the variables it
            sets in front).
        notes: lines for stderr saying what was chosen and why, printed before the command.
        checks: checks to run before starting: ``"preflight"`` (the hostfile's hosts, as
            ``hvdtrain doctor --hostfile``) and ``"srun"`` (Slurm's PMIx plugin).
        np: processes to start.
        hosts: the hostfile or allocation (None: srun's own allocation, or elastic).
        elastic: Horovod Elastic (hosts from the discovery script).
        discovery_script: elastic's host discovery script.
        ssh_port, ssh_identity_file: how the hosts are reached (signals to other hosts' ranks).
    """
    launcher: str
    argv: list[str]
    env: dict[str, str]
    shown: str
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    np: int = 0
    hosts: hf.Hostfile | None = None
    elastic: bool = False
    discovery_script: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None

    def host_names(self) -> list[str]:
        """The job's host names now: the hostfile's, or (elastic) what the discovery script
        prints at this moment (empty when it fails)."""
        if self.hosts is not None:
            return [h.name for h in self.hosts.hosts]
        if self.discovery_script:
            import subprocess
            try:
                out = subprocess.run([self.discovery_script], capture_output=True, text=True,
                                     timeout=30, check=True).stdout
            except (OSError, subprocess.SubprocessError):
                return []
            return [line.split(":")[0].strip() for line in out.splitlines() if line.strip()]
        return []


def _mca(args) -> dict[str, str]:
    bad = [kv for kv in args.mca if "=" not in kv or not kv.split("=", 1)[0]]
    if bad:
        raise PlanError(f"--mca {bad[0]!r} is not KEY=VALUE; write e.g. "
                        "--mca btl_tcp_if_include=eth0")
    return dict(kv.split("=", 1) for kv in args.mca)


def _elastic_refusals(args) -> None:
    """Options that ``--elastic`` cannot honour, refused rather than dropped."""
    if args.launcher != "horovodrun":
        raise PlanError("--elastic needs --launcher horovodrun (mpirun and srun cannot add or "
                        "lose workers)")
    if args.np is None:
        raise PlanError("-np is required with --elastic (the workers to start with)")
    if args.hostfile:
        raise PlanError("--elastic takes its hosts from --host-discovery-script, not --hostfile")
    if args.check:
        raise PlanError("--check needs --hostfile, which --elastic does not take; run "
                        "'hvdtrain doctor --hostfile H' for the hosts your discovery script "
                        "prints")
    if args.mca:
        raise PlanError("--mca does not apply to --elastic: Horovod Elastic runs on Gloo, "
                        "without MPI")


def plan(args, env: dict[str, str] | None = None, gpus: int | None = None) -> LaunchPlan:
    """The launch ``args`` (``hvdtrain launch``'s parsed options) ask for.

    Args:
        args: the parsed options; ``args.command`` is the command after ``--``.
        env: the launch environment (default ``os.environ``).
        gpus: GPUs visible on this host, for ``--yield-when-idle auto`` (default: asks
            ``nvidia-smi`` when needed, :func:`~hvdtrain.launch.tuning.visible_gpus`).

    Returns:
        The plan; nothing has been started.

    Raises:
        PlanError: bad input (hostfile, -np, --mca, options the mode cannot honour, a command
            missing), with what to change.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault(LAUNCH_ID_VAR, new_launch_id())
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise PlanError("no command to launch; write it after '--', e.g. "
                        "hvdtrain launch --hostfile hosts -np 2 -- hvdtrain train")
    try:
        knobs = horovod_knobs(args.fusion_threshold_mb, args.cycle_time_ms, args.autotune)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    notes: list[str] = []
    ssh = {"ssh_port": args.ssh_port, "ssh_identity_file": args.ssh_identity_file}
    if args.elastic:
        _elastic_refusals(args)
        notes.append(f"--elastic: Gloo, no MPI, so no {YIELD_MCA}")
        try:
            argv, env = hf.horovodrun_elastic_argv(
                args.np, command, min_np=args.min_np, max_np=args.max_np,
                discovery_script=args.host_discovery_script,
                network_interfaces=args.network_interfaces, knobs=knobs, env=env, **ssh)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        return LaunchPlan("horovodrun", argv, env, shlex.join(argv), notes, [], args.np, None,
                          True, args.host_discovery_script, **ssh)
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        raise PlanError("--min-np, --max-np and --host-discovery-script need --elastic")
    try:
        if args.hostfile:
            hosts = hf.read_hostfile(args.hostfile)
            np_ = hosts.slots if args.np is None else args.np
        elif slurm.in_allocation(env):  # the allocation's hosts, -np its task count
            hosts = slurm.allocation_hosts(env)
            np_ = slurm.allocation_np(env, hosts) if args.np is None else args.np
            notes.append(f"hosts from {hosts.path}: {hosts.as_h()}")
        elif args.launcher == "srun":  # srun makes its own allocation of -np tasks
            hosts, np_ = None, args.np
            if np_ is None:
                raise PlanError("-np is required with --launcher srun outside an allocation")
        else:
            raise PlanError("--hostfile is required outside a Slurm allocation (or --elastic "
                            "with --host-discovery-script, or --launcher srun)")
        if hosts is not None:
            hf.check_np(hosts, np_)
        elif np_ < 1:
            raise hf.HostfileError(f"-np must be at least 1, got {np_}")
    except hf.HostfileError as exc:
        raise PlanError(str(exc)) from None
    checks = []
    if args.check:
        if not args.hostfile:
            raise PlanError("--check needs --hostfile (inside Slurm the scheduler placed the "
                            "job)")
        checks.append("preflight")
    if args.launcher == "srun":
        checks.append("srun")
    user_mca = _mca(args)
    if args.launcher == "horovodrun" and args.gloo:
        tuning = {}  # no MPI in the job; horovodrun_argv drops -mca settings anyway
        notes.append(f"--gloo: no MPI, so no {YIELD_MCA}")
    else:  # nvidia-smi is only run for auto
        if gpus is None:
            gpus = visible_gpus() if args.yield_when_idle == "auto" else 0
        tuning, reason = launch_tuning(args.yield_when_idle, gpus, env=env)
        if YIELD_MCA in user_mca:
            reason += f"; --mca {YIELD_MCA}={user_mca[YIELD_MCA]} overrides this"
        notes.append(reason)
    mca = {**tuning, **user_mca}
    if args.launcher == "horovodrun":
        argv, env = hf.horovodrun_argv(np_, hosts, command, network_interfaces=args.network_interfaces,
                                       gloo=args.gloo, mca=mca, knobs=knobs, env=env, **ssh)
        shown = shlex.join(argv)
    elif args.launcher == "mpirun":
        argv, env = hf.mpirun_argv(np_, hosts, command, env=env,
                                   allow_run_as_root=os.geteuid() == 0, mca=mca, knobs=knobs)
        shown = shlex.join(argv)
    else:
        before = dict(env)
        argv, env = slurm.srun_argv(np_, command, env=env, mca=mca, knobs=knobs)
        changed = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
                   if before.get(k) != v]
        shown = " ".join(changed + [shlex.join(argv)])  # exact, as a shell command line
    return LaunchPlan(args.launcher, argv, env, shown, notes, checks, np_, hosts, **ssh)
