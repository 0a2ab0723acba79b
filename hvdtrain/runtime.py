"""Process-level facts and settings that need no framework: rank from the launcher's environment,
the per-rank thread budget, and per-rank seeds.

``torch``/``tensorflow`` are not imported here; each adapter's ``init()`` calls ``hvd.init()`` and
then applies :func:`thread_budget` and :func:`rank_seed` with its own framework's calls.
"""
from __future__ import annotations

import gc
import importlib
import os
import random
import sys
import time
from collections.abc import Mapping
from types import ModuleType

import numpy as np

# Environment variables set by the launchers, in the order they are trusted: horovodrun (Gloo
# and MPI), Open MPI's mpirun, MPICH/Intel MPI, then srun (PMIX_RANK from Slurm's PMIx plugin,
# SLURM_PROCID always). Slurm's come last: in an sbatch script the batch shell's SLURM_PROCID=0
# is inherited by every rank that horovodrun or mpirun starts there, and their own variables win.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                    "SLURM_LOCALID")
_LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return default


def launcher_rank() -> int:
    """This process's rank as the launcher (horovodrun/Gloo, Open MPI, MPICH, Slurm's srun) set
    it in the environment, before ``hvd.init()``; 0 when not launched by one. Used to let only
    rank 0 print errors found while validating input, before any framework is loaded."""
    return _first_int(_RANK_VARS, 0)


def launcher_size() -> int:
    """World size according to the launcher's environment; 1 when not launched by one."""
    return _first_int(_SIZE_VARS, 1)


def launcher_local_rank() -> int:
    """Rank among the processes on this host according to the launcher; 0 when not launched."""
    return _first_int(_LOCAL_RANK_VARS, 0)


def launcher_local_size() -> int:
    """Processes on this host according to the launcher's environment (under srun: this host's
    entry of ``SLURM_STEP_TASKS_PER_NODE``, picked by ``SLURM_NODEID``); 1 when not launched."""
    value = _first_int(_LOCAL_SIZE_VARS, 0)
    if value:
        return value
    if "SLURM_PROCID" in os.environ and "HOROVOD_RANK" not in os.environ:
        from hvdtrain.launch.slurm import expand_tasks_per_node
        try:
            per_node = expand_tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
            return per_node[int(os.environ.get("SLURM_NODEID", "0"))]
        except (ValueError, IndexError):
            pass
    return 1


def use_keras_torch_device(device: str, env: dict[str, str] | None = None) -> None:
    """Tell Keras's PyTorch backend to compute on ``device`` (``"cpu"`` or ``"cuda"``; ``"auto"``
    leaves its own choice): it reads ``KERAS_TORCH_DEVICE`` once, when ``keras`` is imported,
    and otherwise takes a visible GPU, so call this before Keras is imported.
    :func:`hvdtrain.keras.init` refuses a Keras that computes elsewhere than the rank."""
    if device != "auto":
        (os.environ if env is None else env)["KERAS_TORCH_DEVICE"] = device


def launched_elastic(env: Mapping[str, str] | None = None) -> bool:
    """Whether Horovod Elastic launched this process (``horovodrun`` sets ``HOROVOD_ELASTIC=1``
    for its workers): the job's size may change at a reset."""
    return (os.environ if env is None else env).get("HOROVOD_ELASTIC") == "1"


def slurm_hosts_warning(hosts: int, env: dict[str, str] | None = None) -> str | None:
    """A warning when a job inside a Slurm allocation of several nodes runs on fewer hosts than
    the allocation has, e.g. ``horovodrun -np 8`` without ``-H`` in an sbatch script: horovodrun
    (0.28) knows nothing of Slurm and starts every rank on the batch host. None otherwise.

    Args:
        hosts: hosts the job's ranks run on (``RankInfo.hosts``).
        env: the environment; defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not env.get("SLURM_JOB_ID") or not (nodes and nodes.isdigit()) or hosts >= int(nodes):
        return None
    return (f"this job runs on {hosts} host(s) of Slurm job {env['SLURM_JOB_ID']}'s {nodes} "
            "nodes: a launcher given no hosts (horovodrun without -H) starts every rank on the "
            "batch host. Launch with 'hvdtrain launch' (it takes the hosts from the allocation) "
            "or 'srun --mpi=pmix'")


def import_frozen(*modules: str) -> list[ModuleType]:
    """Import ``modules`` with Python's cyclic garbage collector paused, then move every object
    alive to its permanent generation (:func:`gc.freeze`), which later collections skip.

    A framework's import makes hundreds of thousands of objects that live as long as the process
    (PyTorch with Horovod about 260,000; TensorFlow with Keras about 670,000). The collector
    would walk them over and over while they are made, and again at every full collection of
    the training loop after. Measured on a 2-core machine, ``hvdtrain train`` (which calls this)
    against the same code without it, same accuracy: one process on digits for 3 epochs,
    PyTorch 3.4 -> 2.4 s wall, Keras on TensorFlow 5.5 -> 4.2 s; ``horovodrun -np 2`` on MNIST
    for 1 epoch, CPU seconds of both ranks, PyTorch 19.4 -> 15.4, Keras 19.7 -> 15.5. The
    technique is CPython's own advice for long-lived objects made at start-up (the
    documentation of :func:`gc.freeze`) and what Instagram did for its servers ("Dismissing
    Python Garbage Collection at Instagram", 2017).

    Call it first, before the script makes anything large: garbage is collected first, but every
    object alive at the end is frozen (never collected; ``gc.unfreeze()`` undoes it). Nothing is
    done when every module is loaded already. The collector ends as it was, whatever is raised.

    Args:
        modules: dotted module names, imported in this order.

    Returns:
        The modules, in the order given.

    Raises:
        ImportError: a module could not be imported (nothing is frozen then).
    """
    if all(name in sys.modules for name in modules):
        return [sys.modules[name] for name in modules]
    enabled = gc.isenabled()
    gc.collect()  # what was garbage before the import is not frozen with it
    gc.disable()
    try:
        imported = [importlib.import_module(name) for name in modules]
    finally:
        if enabled:
            gc.enable()
    gc.freeze()
    return imported


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def omp_num_threads(env: Mapping[str, str] | None = None) -> int | None:
    """The threads per rank ``OMP_NUM_THREADS`` asks for, or None when it is unset or empty. An
    OpenMP list for nested levels ("4,2") gives its first value, the rank's own.

    Raises:
        ValueError: set but not a whole number >= 1; the message names the value and the fix.
    """
    value = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    first = value.split(",")[0].strip()
    if not (first.isascii() and first.isdigit()) or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS must be a whole number >= 1 (threads per rank); "
                         f"got {value!r}: unset it or set e.g. OMP_NUM_THREADS=1")
    return int(first)


def thread_budget(local_size: int, cores: int | None = None,
                  env: Mapping[str, str] | None = None) -> int:
    """Intra-op threads each rank should use so that the ranks on one host do not fight over cores.

    ``OMP_NUM_THREADS``, when set to a whole number >= 1, wins: it is how users of MPI and
    Horovod set a rank's threads (``mpirun -x OMP_NUM_THREADS``; PyTorch reads it too), e.g.
    where a host's cores are shared with other jobs or hosts are containers on one machine, which
    ``local_size`` cannot see.

    Args:
        local_size: ranks on this host (``hvd.local_size()``), >= 1.
        cores: cores on the host; defaults to :func:`available_cores`.
        env: the environment; defaults to ``os.environ``.

    Returns:
        ``OMP_NUM_THREADS`` when set, else ``max(1, cores // local_size)``.

    Raises:
        ValueError: ``local_size`` < 1, or ``OMP_NUM_THREADS`` set but not a whole number >= 1
            (the message names the value).
    """
    if local_size < 1:
        raise ValueError(f"local_size must be >= 1, got {local_size}")
    requested = omp_num_threads(env)
    if requested is not None:
        return requested
    cores = available_cores() if cores is None else cores
    return max(1, cores // local_size)


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible seed per rank: ``seed + 1000003 * rank`` modulo 2**31.

    Rank 0 gets ``seed`` itself, so a single-process run seeded with ``seed`` starts from the same
    random state as rank 0 of a parallel run (whose state is then broadcast to all ranks).
    """
    return (seed + 1_000_003 * rank) % (2**31)


def seed_python_numpy(seed: int) -> None:
    """Seed Python's ``random`` and NumPy's global generator (frameworks seed themselves)."""
    random.seed(seed)
    np.random.seed(seed)


def count_hosts(local_rank: int, cross_size: int, allreduce_sums) -> int:
    """Hosts in the job: the ranks whose ``local_rank`` is 0, counted with one all-reduce
    (``allreduce_sums`` is the adapter's; every rank must call this at the same point).

    Horovod's ``cross_size()`` is no count of hosts when hosts have unequal slots (2 + 1 slots:
    it is 2 on the ranks with local rank 0, 1 on the other). Under Horovod Elastic
    (``HOROVOD_ELASTIC=1``) no collective may run outside the elastic loop (a joining worker
    would meet the others' state sync), so there ``cross_size`` is returned as is.
    """
    if launched_elastic():
        return cross_size
    return int(allreduce_sums({"hosts": float(local_rank == 0)})["hosts"])


class RankInfo:
    """What ``init()`` set up for this process (both adapters return one).

    Attributes:
        rank: global rank in ``[0, size)``.
        local_rank: rank among the processes on this host.
        size: world size (number of processes).
        local_size: processes on this host.
        threads: intra-op threads given to this rank (:func:`thread_budget`).
        seed: the seed this rank used (:func:`rank_seed`); None: ``init(seed=None)``.
        hosts: hosts in the job as Horovod sees them (``hvd.cross_size()``).
        device: where this rank computes: ``"cpu"`` or ``"cuda:N"`` (N = the GPU this rank was
            pinned to, its ``local_rank``; for Keras the physical GPU made visible to TensorFlow).
        horovod_settings: Horovod's runtime settings in force and who chose them
            (:func:`hvdtrain.launch.tuning.rank_settings`).
    """
    __slots__ = ("rank", "local_rank", "size", "local_size", "threads", "seed", "hosts", "device",
                 "horovod_settings")

    def __init__(self, rank: int, local_rank: int, size: int, local_size: int, threads: int,
                 seed: int | None, hosts: int = 1, device: str = "cpu",
                 horovod_settings: dict | None = None):
        self.rank, self.local_rank, self.size = rank, local_rank, size
        self.local_size, self.threads, self.seed, self.hosts = local_size, threads, seed, hosts
        self.device = device
        self.horovod_settings = dict(horovod_settings or {})

    @property
    def is_root(self) -> bool:
        """True on rank 0, the rank that alone logs and writes files."""
        return self.rank == 0

    def __repr__(self) -> str:
        return (f"RankInfo(rank={self.rank}, local_rank={self.local_rank}, size={self.size}, "
                f"local_size={self.local_size}, threads={self.threads}, seed={self.seed}, "
                f"hosts={self.hosts}, device={self.device!r})")


DEVICES = ("auto", "cpu", "cuda")
BUFFER_SYNC_OPS = ("average", "broadcast")  # sync_buffers' rules, both adapters


def check_buffer_sync_op(op: str) -> None:
    """The argument check of both adapters' ``sync_buffers``.

    Raises:
        ValueError: ``op`` is not ``"average"`` or ``"broadcast"``.
    """
    if op not in BUFFER_SYNC_OPS:
        raise ValueError(f"op must be one of {', '.join(BUFFER_SYNC_OPS)}; got {op!r}")


def choose_device(device: str, gpus: int, local_rank: int, local_size: int) -> str:
    """The device a rank computes on: ``"cpu"`` or ``"cuda:<local_rank>"`` (one GPU per rank,
    Horovod's documented pattern).

    Args:
        device: ``"auto"`` (a GPU when this host has one per rank, else the CPU), ``"cpu"`` or
            ``"cuda"``.
        gpus: GPUs visible to this process.
        local_rank, local_size: this rank's place among the processes on its host.

    Raises:
        ValueError: an unknown ``device``; ``"cuda"`` without GPUs; or GPUs present (``auto`` or
            ``cuda``) but fewer than ``local_size`` (NCCL refuses two ranks on one GPU).
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device == "cpu" or (device == "auto" and gpus == 0):
        return "cpu"
    if gpus == 0:
        raise ValueError("device 'cuda' asked for, but no CUDA GPU is visible to this process "
                         "(CUDA_VISIBLE_DEVICES, driver, a CPU-only build?); use device 'cpu' "
                         "or 'auto'")
    if local_size > gpus:
        raise ValueError(f"{local_size} ranks on this host but {gpus} GPU(s): each rank needs "
                         f"its own GPU (NCCL refuses two ranks on one); launch at most {gpus} "
                         "ranks per host (slots in the hostfile), or pass device 'cpu'")
    return f"cuda:{local_rank}"


_RANK_INFO: RankInfo | None = None  # what the adapter's init() set up in this process


def remember_rank_info(info: RankInfo) -> RankInfo:
    """Keep what an adapter's ``init()`` set up, for its ``rank_info()``; returns ``info``."""
    global _RANK_INFO
    _RANK_INFO = info
    return info


def remembered_rank_info(init_name: str) -> RankInfo:
    """What :func:`remember_rank_info` kept (both adapters' ``rank_info()``).

    Raises:
        RuntimeError: no ``init()`` ran yet; the message names ``init_name`` to call.
    """
    if _RANK_INFO is None:
        raise RuntimeError(f"call {init_name} first")
    return _RANK_INFO


def ranks_where(flag: bool, rank: int, size: int, allreduce_sums) -> list[int]:
    """The ranks on which ``flag`` is true, known to every rank after one all-reduce of ``size``
    numbers (``allreduce_sums`` is the adapter's). Every rank must call it at the same point.

    Returns:
        Sorted ranks (empty when the flag is false everywhere).
    """
    values = {f"{r:08d}": 0.0 for r in range(size)}
    values[f"{rank:08d}"] = float(bool(flag))
    return [int(r) for r, v in allreduce_sums(values).items() if v > 0]


class NonFiniteLossError(RuntimeError):
    """A loss was NaN/Inf on some rank and ``--on-nonfinite stop`` was chosen (raised on every
    rank at the same optimizer step).

    Attributes:
        reported: rank 0 recorded it in ``metrics.json`` and printed it already, before the ranks
            stopped together (:meth:`hvdtrain.run.report.RunReport.stops_on_nonfinite`).
    """

    def __init__(self, message: str, reported: bool = False):
        super().__init__(message)
        self.reported = reported


def nonfinite_message(bad_ranks: list[int], step: int, epoch: int) -> str:
    """The one-line report of a non-finite loss, the same for both adapters. With no rank named,
    the losses were finite but the all-reduced gradients were not (e.g. an fp16-compression
    overflow)."""
    if not bad_ranks:
        return (f"non-finite gradients after the all-reduce, with finite losses on every rank, at "
                f"optimizer step {step} (epoch {epoch}); with --compression fp16, try none")
    return f"non-finite loss on rank(s) {bad_ranks} at optimizer step {step} (epoch {epoch})"


def nonfinite_stop(message: str) -> NonFiniteLossError:
    """The error raised with ``--on-nonfinite stop``, saying what to change."""
    return NonFiniteLossError(message + "; stopped (--on-nonfinite stop). Lower --lr or check "
                              "the data")


def slow_step(slow: tuple[int, float] | None, step: int) -> None:
    """The ``--fault-slow-from`` drill (:meth:`hvdtrain.config.TrainConfig.slow_fault`): sleep
    ``slow[1]`` seconds before optimizer step ``step`` (0-based, over the run) once
    ``step >= slow[0]``; nothing when ``slow`` is None."""
    if slow is not None and step >= slow[0]:
        time.sleep(slow[1])


def python_numpy_rng_state() -> dict:
    """Python's and NumPy's global RNG states as plain lists/ints/strings (storable in JSON and
    in ``torch.load(weights_only=True)`` checkpoints)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    return {"numpy": {"kind": kind, "keys": keys.astype(np.int64).tolist(), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "python": {"version": version, "state": list(state), "gauss": gauss}}


def set_python_numpy_rng_state(state: dict) -> None:
    """Restore what :func:`python_numpy_rng_state` returned."""
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
