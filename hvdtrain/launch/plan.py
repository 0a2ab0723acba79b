"""One plan per ``hvdtrain launch``: every launcher (horovodrun, mpirun, srun) and mode (static,
elastic) goes through :func:`plan`, so each gets the same validation, Open MPI tuning and Horovod
settings, and the same signal handling (:mod:`hvdtrain.launch.signals`). The CLI only parses,
prints the plan's notes and command line, runs its checks and runs it.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field

from hvdtrain.launch import hostfile as hf
from hvdtrain.launch import slurm
from hvdtrain.launch.signals import LAUNCH_ID_VAR, new_launch_id
from hvdtrain.launch.tuning import (LAUNCH_CHOICES_VAR, YIELD_MCA, horovod_knobs, launch_tuning,
                                    visible_gpus)

# `hvdtrain launch` options that set a Horovod variable, for the ranks' record of who chose it.
_KNOB_OPTIONS = {"HOROVOD_FUSION_THRESHOLD": "--fusion-threshold-mb",
                 "HOROVOD_CYCLE_TIME": "--cycle-time-ms", "HOROVOD_AUTOTUNE": "--autotune"}


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


def hosts_from_h(spec: str) -> hf.Hostfile:
    """horovodrun's ``-H host1:2,host2:2`` as a (virtual) hostfile; a host without ``:N`` has
    one slot, as in horovodrun.

    Raises:
        hf.HostfileError: an empty list, bad slots or host names (named as in a hostfile), a
            host named twice, an IPv6 address (horovodrun's ``-H`` cannot carry one).
    """
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise hf.HostfileError(f"-H {spec!r} names no hosts; write e.g. -H node1:2,node2:2")
    for number, item in enumerate(items, start=1):
        if item.count(":") > 1 or item.startswith("["):
            raise hf.HostfileError(
                f"-H {spec!r} host {number}: {item!r} looks like an IPv6 address, which -H cannot "
                "carry (horovodrun and mpirun split its host:slots at ':'); name the host "
                "instead (e.g. an /etc/hosts entry)")
    lines = [item if ":" in item else f"{item}:1" for item in items]
    try:
        hosts = hf.parse_hostfile("\n".join(lines), "-H")
    except hf.HostfileError as exc:  # "hostfile -H line 2: ..." -> "-H 'a:1,b:x' host 2: ..."
        message = str(exc).replace("hostfile -H line ", f"-H {spec!r} host ", 1).replace(
            "merge them into one line", "name it once").replace("is already on line ",
                                                                "is already host ")
        # -H writes slots as host:N, not slots=N
        message = re.sub(r"'slots=(.*)' is not a whole number; write e\.g\. slots=2$",
                         r"':\1' is not a whole number of slots; write e.g. -H node1:2,node2:2",
                         message)
        message = re.sub(r"'slots=(.*)' must be at least 1$",
                         r"':\1': a host needs at least 1 slot", message)
        raise hf.HostfileError(message) from None
    return hf.Hostfile(f"-H {spec}", hosts, bare=False, mpich=False, virtual=True)


def this_host(np_: int | None) -> hf.Hostfile:
    """``localhost`` with ``np_`` slots: where a launch with no hostfile, ``-H`` or allocation
    runs (as ``horovodrun -np N`` does).

    Raises:
        hf.HostfileError: no ``-np``.
    """
    if np_ is None:
        raise hf.HostfileError("-np is required without --hostfile or -H (the ranks to start "
                               "on this host), e.g. hvdtrain launch -np 2 -- hvdtrain train")
    return hf.Hostfile("this host", [hf.Host("localhost", max(np_, 1), 0)], bare=False,
                       mpich=False, virtual=True)


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
    env[LAUNCH_ID_VAR] = new_launch_id()  # each launch its own, never an inherited one
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
        if not args.network_interfaces and "--network-interfaces" in argv:
            chosen = argv[argv.index("--network-interfaces") + 1]
            notes.append(f"--elastic: every host the discovery script printed is this machine, "
                         f"so --network-interfaces {chosen}; hosts of other machines it prints "
                         f"later cannot reach {chosen}: to let the job grow onto them, launch "
                         f"with --network-interfaces IFACE (the interface they share, e.g. eth0)")
        env[LAUNCH_CHOICES_VAR] = json.dumps(
            {k: f"hvdtrain launch {_KNOB_OPTIONS.get(k, k)}" for k in knobs})
        return LaunchPlan("horovodrun", argv, env, shlex.join(argv), notes, [], args.np, None,
                          True, args.host_discovery_script, **ssh)
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        raise PlanError("--min-np, --max-np and --host-discovery-script need --elastic")
    hosts_spec = getattr(args, "hosts_spec", None)
    try:
        if args.hostfile and hosts_spec:
            raise PlanError("give --hostfile or -H, not both")
        if args.hostfile or hosts_spec:
            hosts = hf.read_hostfile(args.hostfile) if args.hostfile else hosts_from_h(hosts_spec)
            np_ = hosts.slots if args.np is None else args.np
        elif slurm.in_allocation(env):  # the allocation's hosts, -np its task count
            hosts = slurm.allocation_hosts(env)
            np_ = slurm.allocation_np(env, hosts) if args.np is None else args.np
            notes.append(f"hosts from {hosts.path}: {hosts.as_h()}")
        elif args.launcher == "srun":  # srun makes its own allocation of -np tasks
            hosts, np_ = None, args.np
            if np_ is None:
                raise PlanError("-np is required with --launcher srun outside an allocation")
        else:  # as horovodrun -np N: this host
            hosts = this_host(args.np)
            np_ = args.np
            notes.append(f"no --hostfile, -H or Slurm allocation: {np_} rank(s) on this host")
        if hosts is not None:
            hf.check_np(hosts, np_)
        elif np_ < 1:
            raise hf.HostfileError(f"-np must be at least 1, got {np_}")
    except hf.HostfileError as exc:
        raise PlanError(str(exc)) from None
    checks = []
    if args.check:
        if not args.hostfile:
            raise PlanError("--check needs --hostfile (with -H, this host or inside Slurm, "
                            "write the hosts into a hostfile)")
        checks.append("preflight")
    if args.launcher == "srun":
        checks.append("srun")
    user_mca = _mca(args)
    yield_reason = ""
    if args.launcher == "horovodrun" and args.gloo:
        tuning = None  # no MPI in the job; horovodrun_argv drops -mca settings anyway
        notes.append(f"--gloo: no MPI, so no {YIELD_MCA}")
    else:  # nvidia-smi is only run for auto
        if gpus is None:
            gpus = visible_gpus() if args.yield_when_idle == "auto" else 0
        tuning, reason = launch_tuning(args.yield_when_idle, gpus, env=env)
        if YIELD_MCA in user_mca:
            reason += f"; --mca {YIELD_MCA}={user_mca[YIELD_MCA]} overrides this"
        notes.append(reason)
        yield_reason = reason
    tuning = tuning or {}
    mca = {**tuning, **user_mca}
    # What the launch says the ranks get, they get, whatever their launcher forwards and whatever
    # each rank's init() would choose (tuning.rank_settings); the record says who chose it.
    choices = {f"OMPI_MCA_{k}": ("hvdtrain launch --mca" if k in user_mca else
                                 f"hvdtrain launch: {yield_reason}")
               for k in mca if k == YIELD_MCA}
    choices.update({k: f"hvdtrain launch {_KNOB_OPTIONS.get(k, k)}" for k in knobs})
    if args.launcher != "srun":  # srun_argv sets them itself, and shows them
        env.update({f"OMPI_MCA_{k}": v for k, v in mca.items()})
        env[LAUNCH_CHOICES_VAR] = json.dumps(choices)
    if args.launcher == "horovodrun":
        try:
            argv, env = hf.horovodrun_argv(np_, hosts, command, gloo=args.gloo, mca=mca,
                                           network_interfaces=args.network_interfaces,
                                           knobs=knobs, env=env, **ssh)
        except hf.HostfileError as exc:
            raise PlanError(str(exc)) from None
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
        env[LAUNCH_CHOICES_VAR] = json.dumps(choices)  # the ranks' record, not the user's command
    return LaunchPlan(args.launcher, argv, env, shown, notes, checks, np_, hosts, **ssh)
