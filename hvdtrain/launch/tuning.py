"""Tuning: the machine-specific settings that make Horovod fast, chosen at launch and at start-up.

:func:`visible_gpus` and :func:`launch_tuning` decide the one machine-specific MPI setting
``hvdtrain launch`` adds (``mpi_yield_when_idle``): on for CPU jobs, off where the launching host
has GPUs. :func:`horovod_knobs` turns ``--fusion-threshold-mb``, ``--cycle-time-ms`` and
``--autotune`` into Horovod's environment variables. :func:`rank_settings` is what every rank's
``init()`` applies before ``hvd.init()``, whatever launched it (``horovodrun``, ``mpirun``,
``srun``, ``hvdtrain launch``): the same rule for ranks whose user set nothing. Framework-free;
the launchers' argv builders that take these settings are in :mod:`hvdtrain.launch.hostfile` (and
:mod:`hvdtrain.launch.slurm` for srun). :func:`openmp_spin` bounds PyTorch's OpenMP spin before
``hvdtrain train`` imports its framework.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import MutableMapping

from hvdtrain.runtime import launched_elastic, launcher_size

log = logging.getLogger(__name__)

# `hvdtrain launch --yield-when-idle` values (see launch_tuning).
YIELD_MODES = ("auto", "on", "off")
YIELD_MCA = "mpi_yield_when_idle"


def visible_gpus(env: dict[str, str] | None = None, timeout_s: float = 10.0) -> int:
    """NVIDIA GPUs a process started on this host with ``env`` could use.

    Counts the ``GPU <n>: ...`` lines of ``nvidia-smi -L`` (found on ``env["PATH"]``), then
    applies ``CUDA_VISIBLE_DEVICES`` the way CUDA does: when it is set, only the devices it lists
    up to its first invalid entry count, so ``""``, ``"-1"`` or ``"NoDevFiles"`` mean none (and
    nvidia-smi is not run). A MIG-partitioned GPU counts once.

    Never raises: no ``nvidia-smi`` on PATH, one that fails or one that runs longer than
    ``timeout_s`` seconds all give 0. So a GPU host without ``nvidia-smi`` reads as a CPU host.

    Args:
        env: the environment (``PATH``, ``CUDA_VISIBLE_DEVICES``); defaults to ``os.environ``.
        timeout_s: seconds to wait for ``nvidia-smi -L`` (it can hang on a broken driver).

    Returns:
        The number of GPUs, >= 0.
    """
    env = dict(os.environ if env is None else env)
    listed = env.get("CUDA_VISIBLE_DEVICES")
    entries = None if listed is None else [e.strip() for e in listed.split(",")]
    if entries is not None and not _cuda_device_entry(entries[0]):
        return 0
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is None:
        return 0
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout_s,
                              env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return 0
    if proc.returncode != 0:
        return 0
    found = sum(1 for line in proc.stdout.splitlines() if re.match(r"GPU [0-9]+:", line))
    if entries is None:
        return found
    count = 0
    for entry in entries:  # CUDA stops at the first entry that names no device
        if not _cuda_device_entry(entry) or (entry.isdigit() and int(entry) >= found):
            break
        count += 1
    return min(count, found)


def _cuda_device_entry(entry: str) -> bool:
    """A CUDA_VISIBLE_DEVICES entry that can name a device: an index or a GPU-/MIG- UUID."""
    return entry.isdigit() or entry.startswith(("GPU-", "MIG-"))


def launch_tuning(mode: str = "auto", gpus: int = 0,
                  env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """Whether idle MPI ranks should yield their core (Open MPI's ``mpi_yield_when_idle=1``).

    Open MPI ranks (and Horovod's background thread inside MPI calls) busy-poll while they wait.
    In a CPU job hvdtrain gives each rank's compute threads all the cores the host's ranks share
    (``runtime.thread_budget``), so no core is spare for polling and the polling steals compute:
    measured on a 2-core machine (benchmarks/README.md), a CNN at np=2 ran at 0.66x the
    throughput it had with yielding (and lost a third even at np=1). In a GPU job each rank's
    compute runs on its GPU and the CPU cores are mostly idle, so polling costs no compute and
    yielding only adds MPI latency. ``auto`` therefore turns yielding on when no GPU is visible on
    this (the launching) host and leaves it off otherwise; the launching host stands for all
    hosts, so launch from a host of the same kind or say ``on``/``off``.

    Args:
        mode: ``auto``, ``on`` (``mpi_yield_when_idle=1``) or ``off``
            (``mpi_yield_when_idle=0``, Open MPI's default, set explicitly so that no rank's
            :func:`rank_settings` turns yielding on). ``on`` and ``off`` override an
            ``OMPI_MCA_mpi_yield_when_idle`` in the environment. ``auto`` where GPUs are
            visible sets nothing: each rank's own rule applies (GPU ranks busy-poll, CPU ranks
            yield), or a value from the environment.
        gpus: GPUs visible on this host (:func:`visible_gpus`); only ``auto`` reads it.
        env: the launch environment, only to mention an ``OMPI_MCA_mpi_yield_when_idle`` in it.

    Returns:
        ``({mca name: value}, reason)``: the ``-mca`` settings to add (empty where ``auto``
        leaves it to each rank or to the environment) and one sentence saying what was chosen
        and why, for the user.

    Raises:
        ValueError: ``mode`` is not one of :data:`YIELD_MODES`, or ``gpus`` < 0.
    """
    if mode not in YIELD_MODES:
        raise ValueError(f"--yield-when-idle must be one of {', '.join(YIELD_MODES)}; got {mode!r}")
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    on = mode == "on" or (mode == "auto" and gpus == 0)
    if mode != "auto":
        why = f"--yield-when-idle {mode}"
    elif gpus == 0:
        why = ("no GPU visible on this host (nvidia-smi -L, CUDA_VISIBLE_DEVICES): the ranks "
               "compute on the CPU cores they share, and a busy-polling rank would steal them")
    else:
        why = (f"{gpus} GPU{'s' if gpus > 1 else ''} visible on this host: the ranks compute on "
               "their GPUs, and yielding would only add MPI latency")
    if on:
        hint = "; --yield-when-idle off turns this off" if mode == "auto" else ""
        return {YIELD_MCA: "1"}, f"idle MPI ranks yield their core ({YIELD_MCA}=1): {why}{hint}"
    inherited = (env or {}).get("OMPI_MCA_" + YIELD_MCA)
    if mode == "auto" and inherited is not None:
        return {}, (f"{why}; OMPI_MCA_{YIELD_MCA}={inherited} from the environment applies "
                    "(--yield-when-idle on/off overrides it)")
    if mode == "auto":  # each rank's own rule (tuning.rank_settings): GPU ranks busy-poll
        return {}, (f"GPU ranks busy-poll (Open MPI's default), CPU ranks yield their core: "
                    f"{why}; --yield-when-idle on/off sets it for every rank")
    return {YIELD_MCA: "0"}, f"idle MPI ranks busy-poll (Open MPI's default, {YIELD_MCA}=0): {why}"


def horovod_knobs(fusion_threshold_mb: int | None = None, cycle_time_ms: float | None = None,
                  autotune: bool = False) -> dict[str, str]:
    """Horovod's performance settings as environment variables (read by ``hvd.init()``):
    ``HOROVOD_FUSION_THRESHOLD`` (bytes; tensors are fused into buffers of up to this size
    before an all-reduce, default 128 MiB), ``HOROVOD_CYCLE_TIME`` (ms Horovod's background thread
    waits to batch requests), ``HOROVOD_AUTOTUNE``
    (Bayesian search of those settings while training).

    Raises:
        ValueError: a negative threshold or a cycle time <= 0.
    """
    env = {}
    if fusion_threshold_mb is not None:
        if fusion_threshold_mb < 0:
            raise ValueError(f"--fusion-threshold-mb must be >= 0, got {fusion_threshold_mb}")
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_threshold_mb) * 1024 * 1024)
    if cycle_time_ms is not None:
        if cycle_time_ms <= 0:
            raise ValueError(f"--cycle-time-ms must be > 0, got {cycle_time_ms}")
        env["HOROVOD_CYCLE_TIME"] = str(cycle_time_ms)
    if autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
    return env


# The settings `hvdtrain launch` put into its ranks' environment, as JSON {name: why}, so that
# each rank's record says who chose them (rank_settings).
LAUNCH_CHOICES_VAR = "HVDTRAIN_LAUNCH_CHOICES"


def launch_choices(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """``{variable: why}`` for the settings ``hvdtrain launch`` chose for this rank
    (:data:`LAUNCH_CHOICES_VAR`); empty when not launched by it or the value is unreadable."""
    import json
    env = os.environ if env is None else env
    try:
        found = json.loads(env.get(LAUNCH_CHOICES_VAR) or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


# What rank_settings may choose, with Horovod's / Open MPI's own default when nothing is set
# (Horovod >= 0.21: cycle time 1 ms, fusion threshold 128 MiB; horovod/horovod#2468;
# HOROVOD_CYCLE_WAKE is hvdtrain's Horovod patch 08, off unless asked for).
RANK_SETTING_DEFAULTS = {"HOROVOD_CYCLE_TIME": "1", "HOROVOD_CYCLE_WAKE": "0",
                         "HOROVOD_FUSION_THRESHOLD": str(128 * 2**20),
                         "OMPI_MCA_" + YIELD_MCA: "0"}
# What HOROVOD_AUTOTUNE searches itself (of the names above), left to it when it is on.
AUTOTUNED = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD")
# CPU ranks' fusion threshold, bytes: above it a gradient goes alone, all-reduced in place.
CPU_FUSION_THRESHOLD = 4 * 2**20
# The rule for CPU ranks, measured on 2-core hosts (README, "Distributing vs one process").
CPU_RANK_SETTINGS = {
    "HOROVOD_CYCLE_WAKE": (
        "1", "CPU ranks: Horovod's background thread sleeps out each cycle before it negotiates, "
        "and where the all-reduce cannot overlap the backward pass (Keras applies all gradients "
        "at once; short steps) the rest of the cycle is latency on every step; woken when work "
        "is enqueued, a request waits only for the negotiation, and the cycle is how often an "
        "idle rank negotiates"),
    "HOROVOD_FUSION_THRESHOLD": (
        str(CPU_FUSION_THRESHOLD), "CPU ranks: a fused all-reduce copies each gradient into "
        "Horovod's fusion buffer and back, and on a CPU host those copies take the memory "
        "bandwidth and cores the compute needs; a tensor over 4 MiB is all-reduced in place with "
        "no copy, smaller ones are still fused into one call (a 10.5 M-parameter MLP at np=2: "
        "+29 % PyTorch, +12 % Keras; the smaller models unchanged)"),
    "OMPI_MCA_" + YIELD_MCA: (
        "1", "CPU ranks: each rank's compute threads take its share of the cores, and an MPI rank "
        "that busy-polls while it waits steals them"),
}
# CPU ranks' cycle time, ms, where the Horovod build cannot wake its thread (one without
# hvdtrain's patch 08): short, so the sleep it adds to every step is short.
CPU_CYCLE_WITHOUT_WAKE = (
    "0.1", "CPU ranks, a Horovod without wake-on-enqueue (hvdtrain's patch 08): the thread sleeps "
    "out each cycle before it negotiates, and where the all-reduce cannot overlap the backward "
    "pass the 1 ms default cycle is latency on every step and made run-to-run speed bimodal; "
    "0.1 ms measured faster and steadier")
# CPU ranks' cycle time, ms, in a job of one rank whose thread wakes on enqueue: no peer to
# negotiate with, so the cycle is only how often an idle thread wakes.
CPU_CYCLE_ALONE = (
    "10", "CPU, one rank, woken when work is enqueued: no peer to negotiate with, so the cycle "
    "is only how often the idle thread wakes; at Horovod's 1 ms it woke 904 times a second "
    "(2.6 % of a core, each wake taking a core from the compute threads), at 10 ms 99 (0.4 %)")


def horovod_can_wake() -> bool:
    """Whether the installed Horovod has hvdtrain's patch 08 (``HOROVOD_CYCLE_WAKE``, its
    background thread woken when work is enqueued): ``horovod.common.basics.CYCLE_WAKE``. False
    where Horovod is missing or built without it. Imports no framework."""
    try:
        import horovod.common.basics
    except ImportError:
        return False
    return bool(getattr(horovod.common.basics, "CYCLE_WAKE", False))


# How Horovod reads an integer variable (strtol): the leading integer, 0 where there is none.
_HOROVOD_INT = re.compile(r"\s*([+-]?[0-9]+)")


def horovod_flag(value: str) -> bool:
    """A Horovod boolean variable as Horovod reads it (``strtol``: the leading integer, 0 where
    there is none, so ``"true"`` is off): ``"1"`` -> True; ``"0"``, ``"true"``, ``"on"`` ->
    False."""
    match = _HOROVOD_INT.match(value)
    return bool(match and int(match.group(1)))


def rank_settings(on_gpu: bool, size: int | None = None,
                  env: MutableMapping[str, str] | None = None,
                  can_wake: bool | None = None) -> dict[str, dict]:
    """Choose Horovod's runtime settings for this rank where the user set none, and put them into
    ``env`` before ``hvd.init()`` (which reads ``HOROVOD_*``, and ``MPI_Init`` inside it the
    ``OMPI_MCA_*`` variables). A variable already set, by the user, ``mpirun -x`` or
    ``hvdtrain launch``, always wins and is left as it is.

    The rule: CPU ranks get :data:`CPU_RANK_SETTINGS`: Horovod's background thread woken when
    work is enqueued (``HOROVOD_CYCLE_WAKE=1``, so the 1 ms cycle is only how often an idle rank
    negotiates), a fusion threshold of 4 MiB instead of 128 MiB, idle MPI ranks yielding their
    core; a job of one rank (not elastic) gets a 10 ms cycle (:data:`CPU_CYCLE_ALONE`): with
    nobody to negotiate with, the cycle only sets how often the idle thread wakes. With a
    Horovod that cannot wake its thread (``can_wake`` false), CPU ranks get a
    0.1 ms cycle instead (:data:`CPU_CYCLE_WITHOUT_WAKE`), as they do where the user turned the
    wake off (``HOROVOD_CYCLE_WAKE=0``), except that a job of one rank keeps
    the 1 ms cycle: it has nothing to negotiate, and a background thread waking every 0.1 ms only
    takes CPU from the compute (measured: np=1 at 0.79-0.89 of the plain loop with 0.1 ms). GPU
    ranks keep Horovod's defaults: there the compute runs on the GPU, the all-reduce overlaps the
    backward pass, and nothing was measured here that says otherwise (``hvdtrain launch
    --cycle-time-ms`` or the variables set them).

    Args:
        on_gpu: this rank computes on a GPU.
        size: the job's world size; default: the launcher's
            (:func:`hvdtrain.runtime.launcher_size`, 1 without a launcher).
        env: the environment to read and fill in; defaults to ``os.environ``.
        can_wake: the Horovod build has ``HOROVOD_CYCLE_WAKE``; default:
            :func:`horovod_can_wake`.

    With ``HOROVOD_AUTOTUNE`` set, Horovod's own search tunes the cycle time and the fusion
    threshold it was not given (:data:`AUTOTUNED`), so neither is set here. An ``OMPI_MCA_*``
    variable also overrides a value from an Open MPI ``mca-params.conf`` file; set the variable
    to keep the file's value.

    Returns:
        ``{name: {"value": str, "by": "user" | "hvdtrain launch" | "hvdtrain" | "default" |
        "autotune", "why": str}}`` for each name in :data:`RANK_SETTING_DEFAULTS`: what applies and who chose it,
        for the run header and ``metrics.json`` (:func:`settings_in_effect` after
        ``hvd.init()``).
    """
    env = os.environ if env is None else env
    size = launcher_size() if size is None else size
    can_wake = horovod_can_wake() if can_wake is None else can_wake
    autotune = env.get("HOROVOD_AUTOTUNE", "").strip() not in ("", "0")
    users_wake = env.get("HOROVOD_CYCLE_WAKE", "").strip()
    wake_on = can_wake and (not users_wake or horovod_flag(users_wake))
    cpu_rule = dict(CPU_RANK_SETTINGS)
    if wake_on and size == 1 and not launched_elastic(env):
        # One rank for good (an elastic job may grow: peers would wait up to a cycle for it).
        cpu_rule["HOROVOD_CYCLE_TIME"] = CPU_CYCLE_ALONE
    if not wake_on:
        # No wake in effect: a short cycle is what hides the negotiation's latency.
        del cpu_rule["HOROVOD_CYCLE_WAKE"]
        if size > 1:
            cpu_rule["HOROVOD_CYCLE_TIME"] = CPU_CYCLE_WITHOUT_WAKE
    chosen = {}
    by_launch = launch_choices(env)
    for name, default in RANK_SETTING_DEFAULTS.items():
        if env.get(name, "").strip() and name in by_launch:
            chosen[name] = {"value": env[name], "by": "hvdtrain launch", "why": by_launch[name]}
        elif env.get(name, "").strip():
            chosen[name] = {"value": env[name], "by": "user", "why": "set in the environment"}
            if name == "HOROVOD_CYCLE_WAKE" and not _HOROVOD_INT.match(env[name]):
                chosen[name]["why"] += (f"; Horovod reads {env[name]!r} as 0 (off): set 1 or 0")
        elif autotune and name in AUTOTUNED:
            chosen[name] = {"value": default, "by": "autotune",
                            "why": "HOROVOD_AUTOTUNE searches it while training, from the default"}
        elif not on_gpu and name in cpu_rule:
            value, why = cpu_rule[name]
            env[name] = value
            chosen[name] = {"value": value, "by": "hvdtrain", "why": why}
        elif on_gpu:
            chosen[name] = {"value": default, "by": "default", "why": "GPU ranks keep the default"}
        elif name == "HOROVOD_CYCLE_WAKE":
            chosen[name] = {"value": default, "by": "default",
                            "why": "this Horovod cannot wake its thread (no hvdtrain patch 08)"}
        elif name == "HOROVOD_CYCLE_TIME" and wake_on:
            chosen[name] = {"value": default, "by": "default",
                            "why": "woken when work is enqueued, the cycle is only how often an "
                                   "idle rank negotiates"}
        elif name == "HOROVOD_CYCLE_TIME":
            chosen[name] = {"value": default, "by": "default",
                            "why": "one rank: nothing to negotiate, a shorter cycle only costs CPU"}
        else:
            chosen[name] = {"value": default, "by": "default", "why": "the default"}
    return chosen


def settings_in_effect(settings: dict[str, dict], mpi: bool, size: int | None = None,
                       env: MutableMapping[str, str] | None = None) -> dict[str, dict]:
    """:func:`rank_settings`'s record after ``hvd.init()``: Open MPI's ``OMPI_MCA_*`` settings
    apply only where MPI runs the job (``hvd.mpi_enabled()``); under the Gloo controller
    (``horovodrun --gloo``, elastic runs) they are marked ``"by": "n/a"``.

    With ``size`` (``hvd.size()``), the one-rank cycle (:data:`CPU_CYCLE_ALONE`), read by
    ``hvd.init()`` already, leaves ``env`` (default ``os.environ``), so that a job this process
    launches does not take it for the user's; and where the job has more ranks than the
    launcher's environment said (a launcher whose size variable hvdtrain does not read), a
    warning says to set ``HOROVOD_CYCLE_TIME``, and the record says so.
    """
    env = os.environ if env is None else env
    cycle = settings.get("HOROVOD_CYCLE_TIME", {})
    if size is not None and cycle.get("by") == "hvdtrain" and \
            cycle.get("value") == CPU_CYCLE_ALONE[0]:
        if env.get("HOROVOD_CYCLE_TIME") == CPU_CYCLE_ALONE[0]:
            del env["HOROVOD_CYCLE_TIME"]
        if size != 1:
            log.warning("hvdtrain chose Horovod's cycle for a job of one rank (the launcher's "
                        "environment named no size), but the job has %d ranks: set "
                        "HOROVOD_CYCLE_TIME=1 for its ranks", size)
            settings = {**settings, "HOROVOD_CYCLE_TIME": {
                **cycle, "why": cycle["why"] + f"; but the job has {size} ranks (the "
                "launcher's environment named no size): set HOROVOD_CYCLE_TIME=1"}}
    if mpi:
        return settings
    return {name: ({**s, "by": "n/a", "why": "not used: the Gloo controller runs the job, no MPI"}
                   if name.startswith("OMPI_MCA_") else s) for name, s in settings.items()}


# How long a waiting OpenMP thread of libgomp (PyTorch's OpenMP on Linux) spins before it sleeps:
# libgomp's default is 300,000 turns (GOMP_SPINCOUNT, with OMP_WAIT_POLICY unset; GCC's libgomp
# manual), read once, when the library loads. Measured on the 2-core machine, one process, 2
# threads, digits, 3 epochs: idle 2.2-2.4 s at both 300,000 and 1,000; with one other busy process
# 28-53 s at 300,000 (threads spin for a core the other thread needs), 5.4-5.5 s at 1,000, 4.5-4.8
# s with OMP_WAIT_POLICY=PASSIVE (which costs 16 % idle).
OPENMP_SPIN = "1000"


def openmp_spin(env: MutableMapping[str, str] | None = None) -> dict:
    """Bound how long PyTorch's idle OpenMP threads spin (``GOMP_SPINCOUNT=1000``, see
    :data:`OPENMP_SPIN`) where the user set neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY``,
    so that a rank sharing its cores with other work does not lose them to its own spinning
    threads. Call before the framework is imported (``hvdtrain train`` does): libgomp reads it
    once, when it loads. Measured with 2 threads on 2 cores (:data:`OPENMP_SPIN`); not part of
    the run header's ``horovod_settings``.

    Args:
        env: the environment to read and fill in (changed in place); defaults to ``os.environ``.
    Returns: ``{"value": "NAME=VALUE", "by": "user" | "hvdtrain", "why": str}``.
    """
    env = os.environ if env is None else env
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        if env.get(name, "").strip():
            return {"value": f"{name}={env[name]}", "by": "user", "why": "set in the environment"}
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN
    return {"value": f"GOMP_SPINCOUNT={OPENMP_SPIN}", "by": "hvdtrain",
            "why": "idle OpenMP threads sleep after 1,000 turns instead of 300,000: spinning "
                   "threads took the cores a rank shares with other work (5-10x slower)"}


def describe_settings(settings: dict[str, dict]) -> str:
    """One line for the run header: ``HOROVOD_CYCLE_TIME=0.1 (hvdtrain), ...``."""
    return ", ".join(f"{name}={s['value']} ({s['by']})" for name, s in settings.items())
