"""Cluster presets for :mod:`hvdtrain.scaling.model` (bandwidths in bytes/s, latencies in s).

The network figures are line rates times an achievable fraction (``NET_EFFICIENCY``: framing,
TCP/IP or RDMA headers; nccl-tests report all-reduce bus bandwidths of roughly 85-95 % of the
line rate on tuned InfiniBand, less on TCP). The intra-host figures are NCCL all-reduce bus
bandwidths of the class of machine (nccl-tests ``doc/PERFORMANCE.md`` defines busbw): PCIe 3
x16 about 10 GB/s, NVLink 2 (V100, DGX-1) about 130 GB/s, NVLink 3 + NVSwitch (A100) about
230 GB/s, NVLink 4 (H100) about 360 GB/s. They are round figures for planning, not
measurements of a given machine: pass ``--intra-gbps``/``--inter-gbps``/``--latency-us`` or
measure with ``benchmarks/allreduce.py`` for yours.

``this-host`` is this machine, from the all-reduce times ``benchmarks/allreduce.py`` measured
(its committed ``benchmarks/results/allreduce.json``, Horovod over MPI at np=2 with a 0.1 ms
cycle, :data:`BINDING_SERIES` says why): all-reduce times interpolated from the measured
sizes, since a CPU host's bus bandwidth depends on the size (here about 0.01-0.02 GB/s at 4 KiB
where the latency dominates, 4-7 GB/s at 4 MiB while the buffers fit the caches, 1.6-2 GB/s at
64 MiB from memory), with ``t = alpha + bytes / B`` fitted for the latency; ranks per host =
its cores; no overlap (CPU ranks compute and communicate on the same cores).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from hvdtrain.scaling.model import Cluster, HorovodSettings

GB = 1e9
NET_EFFICIENCY = 0.9  # achievable fraction of a network's line rate (see the module docstring)


def _gbit(gbps: float, nics: int = 1) -> float:
    return gbps / 8 * GB * nics * NET_EFFICIENCY


PRESETS: dict[str, Cluster] = {
    "pcie-25gbe": Cluster(
        "pcie-25gbe", 4, 10 * GB, 5e-6, _gbit(25), 25e-6, True,
        "4 GPUs per host on PCIe 3 (~10 GB/s busbw), 25 Gb/s Ethernet, TCP (~25 us per hop); "
        "the Horovod paper's 2017 cluster"),
    "pcie-25gbe-rdma": Cluster(
        "pcie-25gbe-rdma", 4, 10 * GB, 5e-6, _gbit(25), 5e-6, True,
        "as pcie-25gbe with RoCE/RDMA: the same line rate, ~5 us per hop"),
    "pcie-100gbe": Cluster(
        "pcie-100gbe", 8, 10 * GB, 5e-6, _gbit(100), 15e-6, True,
        "8 GPUs per host on PCIe, 100 Gb/s Ethernet, TCP"),
    "nvlink-100gbe": Cluster(
        "nvlink-100gbe", 8, 130 * GB, 2e-6, _gbit(100), 15e-6, True,
        "8 V100 per host on NVLink 2 (~130 GB/s busbw), 100 Gb/s Ethernet, TCP (AWS "
        "p3dn.24xlarge class)"),
    "nvlink-ib100": Cluster(
        "nvlink-ib100", 8, 130 * GB, 2e-6, _gbit(100), 3e-6, True,
        "8 V100 per host on NVLink 2, one 100 Gb/s InfiniBand (EDR) port per host"),
    "nvlink-ib200": Cluster(
        "nvlink-ib200", 8, 230 * GB, 2e-6, _gbit(200), 3e-6, True,
        "8 A100 per host on NVLink 3 + NVSwitch (~230 GB/s busbw), one 200 Gb/s InfiniBand "
        "(HDR) port per host"),
    "nvlink-ib400": Cluster(
        "nvlink-ib400", 8, 360 * GB, 2e-6, _gbit(400), 3e-6, True,
        "8 H100 per host on NVLink 4 (~360 GB/s busbw), one 400 Gb/s InfiniBand (NDR) port per "
        "host"),
    "nvlink-ib200x8": Cluster(
        "nvlink-ib200x8", 8, 230 * GB, 2e-6, _gbit(200, 8), 3e-6, True,
        "DGX A100 class: 8 A100 on NVSwitch, 8 x 200 Gb/s InfiniBand ports per host (one per "
        "GPU)"),
}

# benchmarks/allreduce.py's Horovod series -> the settings it runs them with (its series_env
# sets the variables from here): Horovod's 1 ms default cycle, a 0.1 ms cycle, or hvdtrain's
# CPU rank settings (the background thread woken when a tensor is enqueued;
# hvdtrain.launch.tuning.CPU_RANK_SETTINGS).
SERIES_SETTINGS = {"horovod-mpi": HorovodSettings(cycle_time_s=1e-3),
                   "horovod-mpi-cycle0.1": HorovodSettings(cycle_time_s=1e-4),
                   "horovod-tf-cycle0.1": HorovodSettings(cycle_time_s=1e-4),
                   "horovod-gloo": HorovodSettings(cycle_time_s=1e-3),
                   "horovod-mpi-wake": HorovodSettings(cycle_time_s=1e-3, cycle_wake=True)}
# The series whose times plan a job's binding on this host. CPU ranks run hvdtrain's settings
# (wake on enqueue), but a lone call on idle cores (horovod-mpi-wake: 0.06 ms at 4 KiB) is not
# what a cycle costs inside a training step, whose thread wakes on cores that compute: planned
# with those times, the MNIST CNN at np=2 came out 27-40 % fast in three rounds. The 0.1 ms
# cycle's lone calls (0.17-0.35 ms at 4 KiB) stand in for that cost. PyTorch's binding reduces
# in place; TensorFlow's (Keras on the TensorFlow backend) out of place, an output allocated and
# written per tensor, which has cost more here (dense's 42 MB of gradients grouped at np=2:
# 19-25 ms against 13-16 ms), so each is planned with its own.
BINDING_SERIES = {"torch": "horovod-mpi-cycle0.1", "tensorflow": "horovod-tf-cycle0.1"}


def series_cycle_wait_s(impl: str) -> float:
    """The wait for Horovod's next cycle that a lone call of series ``impl`` pays, seconds: the
    cycle time, or 0 where the thread wakes on enqueue (or the series is not Horovod's)."""
    settings = SERIES_SETTINGS.get(impl)
    return 0.0 if settings is None or settings.cycle_wake else settings.cycle_time_s


ALLREDUCE_JSON = Path("benchmarks") / "results" / "allreduce.json"


def find_allreduce_json(path: str | os.PathLike | None = None) -> Path | None:
    """The all-reduce results file: ``path``, else ``benchmarks/results/allreduce.json`` under
    the working directory or the checkout this package sits in; None when there is none."""
    candidates = [Path(path)] if path else [
        Path.cwd() / ALLREDUCE_JSON, Path(__file__).resolve().parents[2] / ALLREDUCE_JSON]
    return next((p for p in candidates if p.is_file()), None)


def this_host(allreduce_json: str | os.PathLike | None = None,
              impl: str | None = None, cores: int | None = None,
              binding: str = "torch") -> Cluster:
    """This machine as a :class:`Cluster` from ``benchmarks/allreduce.py``'s measured times of
    ``impl`` (``seconds``: ``{bytes: s}`` at ``np`` ranks; default: the series of Horovod's
    ``binding``, ``"torch"`` or ``"tensorflow"`` (:data:`BINDING_SERIES`), where the file has
    it, else PyTorch's, as ``allreduce.py`` measures TensorFlow's only when asked):
    interpolated per size
    (``intra_table``), and ``t = alpha + bytes / B`` fitted (:func:`fit_alpha_beta`; alpha less
    the series' wait for a cycle (:func:`series_cycle_wait_s`) split over the ring's
    ``2 (N-1)`` steps and the negotiation's ``2 ceil(log2 N)`` as the per-step latency). A file
    with only the
    ``alpha_beta`` summary gives that fit and no table.

    Raises:
        FileNotFoundError: no results file (run ``benchmarks/allreduce.py``, or describe the
            cluster with ``--cluster custom``: ``--ranks-per-host``, ``--intra-gbps``,
            ``--inter-gbps`` and ``--latency-us``).
        ValueError: the file has no times or fit of ``impl`` (the message says what to
            run).
    """
    found = find_allreduce_json(allreduce_json)
    if found is None:
        wanted = f"{allreduce_json} (no such file)" if allreduce_json else \
            f"{ALLREDUCE_JSON} (run benchmarks/allreduce.py)"
        raise FileNotFoundError(
            f"this-host needs {wanted}, or pass --cluster custom with --ranks-per-host, "
            "--intra-gbps, --inter-gbps and --latency-us")
    data = json.loads(found.read_text())
    def has(series: str) -> bool:
        return series in data.get("seconds", {}) or series in data.get("alpha_beta", {})
    if impl is None:
        impl = BINDING_SERIES.get(binding, BINDING_SERIES["torch"])
        if not has(impl):
            impl = BINDING_SERIES["torch"]
    if not has(impl):
        raise ValueError(f"{found} has no all-reduce times of {impl}: run "
                         "benchmarks/allreduce.py (--impls all for every series)")
    ranks = int(data.get("np", 2))
    table: tuple = ()
    if "seconds" in data and impl in data["seconds"]:
        measured = {int(k): float(v) for k, v in data["seconds"][impl].items()}
        alpha, bw = fit_alpha_beta(measured)
        table = tuple(sorted(measured.items()))
    else:
        fit = data["alpha_beta"][impl]
        alpha, bw = float(fit["alpha_s"]), float(fit["bandwidth_bytes_per_s"])
    cores = cores or os.cpu_count() or 1
    # The fitted alpha holds the wait for Horovod's next cycle (the series' cycle time, which
    # the model adds itself), the negotiation (2 ceil(log2 N) latencies) and the ring's
    # 2 (N-1) steps: the per-step latency is what is left, shared out.
    cycle_s = series_cycle_wait_s(impl)
    steps = 2 * (ranks - 1) + 2 * math.ceil(math.log2(ranks))
    latency = max(0.0, alpha - cycle_s) / steps
    machine = data.get("machine", {})
    return Cluster("this-host", cores, bw, latency, bw, latency, False,
                   f"{found.name}: {impl} at np={ranks} on {machine.get('cpu', '?')} "
                   f"({machine.get('cores', '?')} cores): alpha {alpha * 1e3:.3f} ms, "
                   f"{bw / GB:.2f} GB/s (fit), times interpolated from the measured sizes; "
                   "CPU ranks: no overlap", table, ranks)


def fit_alpha_beta(seconds: dict[int, float]) -> tuple[float, float]:
    """Fit ``t = alpha + bytes / B`` to measured all-reduce times ``{bytes: seconds}`` by least
    squares on the relative error (weights ``1 / t^2``, so that 4 KiB and 64 MiB count alike).

    Returns:
        ``(alpha s, B bytes/s)``; alpha clipped at 0.

    Raises:
        ValueError: fewer than two sizes, or times that do not grow with size.
    """
    if len(seconds) < 2:
        raise ValueError("need all-reduce times of at least two sizes to fit")
    w = {x: 1 / t ** 2 for x, t in seconds.items()}
    sw = sum(w.values())
    sx = sum(w[x] * x for x in seconds)
    sy = sum(w[x] * t for x, t in seconds.items())
    sxx = sum(w[x] * x * x for x in seconds)
    sxy = sum(w[x] * x * t for x, t in seconds.items())
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    if slope <= 0:
        raise ValueError("all-reduce times do not grow with size: cannot fit a bandwidth")
    alpha = max(0.0, (sy - slope * sx) / sw)
    return alpha, 1 / slope


def custom(ranks_per_host: int, intra_gbps: float, inter_gbps: float, latency_us: float,
           overlap: bool = True) -> Cluster:
    """A cluster from figures: bandwidths in GB/s (bytes, not bits), latency in microseconds."""
    return Cluster("custom", ranks_per_host, intra_gbps * GB, latency_us * 1e-6,
                   inter_gbps * GB, latency_us * 1e-6, overlap, "given on the command line")


def cluster(name: str, **kw) -> Cluster:
    """A preset by name, or ``this-host``.

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    if name == "this-host":
        return this_host(**kw)
    if name not in PRESETS:
        raise ValueError(f"unknown cluster {name!r}; use this-host, custom or one of "
                         f"{', '.join(PRESETS)}")
    return PRESETS[name]
