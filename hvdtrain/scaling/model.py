"""The cost model of one data-parallel training step under Horovod: pure functions, no framework.

Units everywhere: bytes, seconds, bytes/s, samples/s.

Sources of the terms:

* Ring all-reduce: each of N ranks sends and receives ``2 (N-1)/N x bytes`` in ``2 (N-1)``
  steps (a reduce-scatter then an all-gather), so its time is ``2 (N-1)/N x bytes / B + 2 (N-1)
  x alpha``, bandwidth-optimal (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms
  for clusters of workstations", JPDC 69(2); Horovod's use of it: Sergeev & Del Balso 2018,
  arXiv:1802.05799, section 3). ``B`` is the *bus bandwidth* in NCCL's sense
  (nccl-tests ``doc/PERFORMANCE.md``: busbw = algbw x 2 (N-1)/N for all-reduce, the figure
  comparable to the hardware's link rate whatever N).
* Hierarchical all-reduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``): a reduce-scatter within each host,
  an all-reduce of each rank's 1/L shard across the H hosts (the L shards share the host's
  network link), an all-gather within the host.
* Tensor Fusion (Sergeev & Del Balso 2018, section 7; Horovod docs "Tensor Fusion"): Horovod's
  background thread wakes every ``HOROVOD_CYCLE_TIME``, negotiates the tensors ready on every
  rank, and all-reduces them fused into buffers of at most ``HOROVOD_FUSION_THRESHOLD`` bytes (a
  tensor larger than the threshold goes alone). With hvdtrain's patch 08
  (``HOROVOD_CYCLE_WAKE=1``) the thread wakes as soon as a tensor is enqueued.
* Overlap: the gradients are all-reduced while the backward pass still computes the earlier
  layers' gradients; what is left after the backward pass ends is the exposed communication.
* ``backward_passes_per_step`` k: k forward/backward passes accumulate locally, one all-reduce
  after the last (Horovod's ``DistributedOptimizer(backward_passes_per_step=k)``).
* fp16 compression (``hvd.Compression.fp16``): float32 gradients sent as float16, half the bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MiB = 2 ** 20


@dataclass(frozen=True)
class Gradient:
    """One gradient tensor of the model.

    Attributes:
        name: the parameter's name.
        nbytes: its size in bytes (float32: 4 x elements).
        ready_s: seconds after the start of the backward pass at which it is final (its
            gradient-ready hook fires).
    """
    name: str
    nbytes: int
    ready_s: float


@dataclass(frozen=True)
class ComputeProfile:
    """What one rank computes per micro-batch, timed on its own device (no communication).

    Attributes:
        batch_size: samples per micro-batch per rank.
        forward_s: forward pass and loss, seconds.
        backward_s: backward pass, seconds.
        optimizer_s: one optimizer step, seconds.
        gradients: the gradients in the order they become ready.
        source: where the numbers come from (measured here, a published throughput, ...).
        jitter_s: standard deviation of one micro-batch's compute time, seconds (0: unknown).
    """
    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    gradients: tuple[Gradient, ...]
    source: str = ""
    jitter_s: float = 0.0

    @property
    def gradient_bytes(self) -> int:
        """Bytes all-reduced per step without compression."""
        return sum(g.nbytes for g in self.gradients)

    @property
    def micro_batch_s(self) -> float:
        """Forward plus backward of one micro-batch, seconds."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Cluster:
    """The machines: hosts of ``ranks_per_host`` ranks joined by a network.

    Attributes:
        name: preset name or ``"custom"``.
        ranks_per_host: ranks (GPUs, or CPU ranks) per host.
        intra_busbw: all-reduce bus bandwidth between the ranks of one host, bytes/s.
        intra_latency_s: per-step latency of a ring step within a host, seconds.
        inter_bw: network bandwidth of one host (all its NICs, after protocol overhead), bytes/s.
        inter_latency_s: per-step latency of a ring step between hosts, seconds.
        overlap: the all-reduce's time can hide behind the backward pass (GPU ranks: the
            collectives use copy engines/NICs; CPU ranks: the same cores do both, so no: every
            cycle's time adds to the step).
        source: where the figures come from.
        intra_table: measured one-host all-reduce times ``((bytes, seconds), ...)`` at
            ``table_ranks`` ranks, ascending; when given, one-host all-reduces are interpolated
            from it (linearly in bytes, the last segment extended) instead of the ring formula,
            since a CPU host's bandwidth depends on the size (caches).
        table_ranks: the rank count the table was measured at.
    """
    name: str
    ranks_per_host: int
    intra_busbw: float
    intra_latency_s: float
    inter_bw: float
    inter_latency_s: float
    overlap: bool = True
    source: str = ""
    intra_table: tuple[tuple[int, float], ...] = ()
    table_ranks: int = 2


@dataclass(frozen=True)
class HorovodSettings:
    """Horovod's knobs that the model knows.

    Attributes:
        fusion_threshold: ``HOROVOD_FUSION_THRESHOLD``, bytes (Horovod's default 128 MiB).
        cycle_time_s: ``HOROVOD_CYCLE_TIME``, seconds (default 1 ms).
        cycle_wake: the background thread wakes when a tensor is enqueued (hvdtrain patch 08).
        hierarchical: ``HOROVOD_HIERARCHICAL_ALLREDUCE``.
        compression: ``"none"`` or ``"fp16"``.
        backward_passes_per_step: k micro-batches per all-reduce.
    """
    fusion_threshold: int = 128 * MiB
    cycle_time_s: float = 1e-3
    cycle_wake: bool = False
    hierarchical: bool = False
    compression: str = "none"
    backward_passes_per_step: int = 1

    def __post_init__(self):
        if self.compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {self.compression!r}")
        if self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1, got "
                             f"{self.backward_passes_per_step}")
        if self.fusion_threshold < 0 or self.cycle_time_s < 0:
            raise ValueError("fusion_threshold and cycle_time_s must be >= 0")


def ring_allreduce_seconds(nbytes: float, ranks: int, busbw: float, latency_s: float) -> float:
    """Time of one ring all-reduce: ``2 (N-1)/N x nbytes / busbw + 2 (N-1) x latency_s``.

    Args:
        nbytes: bytes per rank.
        ranks: N >= 1 (1 -> 0 s).
        busbw: bus bandwidth in NCCL's sense, bytes/s.
        latency_s: per-step latency, seconds.

    Raises:
        ValueError: ranks < 1 or busbw <= 0.
    """
    if ranks < 1 or busbw <= 0:
        raise ValueError(f"need ranks >= 1 and busbw > 0, got {ranks}, {busbw}")
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / busbw + 2 * (ranks - 1) * latency_s


def layout(ranks: int, ranks_per_host: int) -> tuple[int, int]:
    """``(hosts, ranks on a host)`` for ``ranks`` placed host by host."""
    if ranks < 1 or ranks_per_host < 1:
        raise ValueError(f"need ranks >= 1 and ranks_per_host >= 1, got {ranks}, {ranks_per_host}")
    return math.ceil(ranks / ranks_per_host), min(ranks, ranks_per_host)


def allreduce_seconds(nbytes: float, ranks: int, cluster: Cluster,
                      hierarchical: bool = False) -> float:
    """Time of one all-reduce of ``nbytes`` over ``ranks`` ranks of ``cluster``.

    One host: a ring at the host's bus bandwidth. Several hosts, flat: one ring through every
    rank; each host's link carries the ring's ``2 (N-1)/N x nbytes`` and each of the ``2 (N-1)``
    steps waits for the slowest hop, so ``2 (N-1)/N x nbytes / min(intra, inter) + 2 (N-1) x
    inter_latency``. Hierarchical: reduce-scatter + all-gather within the host (``2 (L-1)/L x
    nbytes / intra + 2 (L-1) x intra_latency``) plus a ring across the H hosts of the L shards
    side by side on the host's link (``2 (H-1)/H x nbytes / inter + 2 (H-1) x inter_latency``).
    """
    hosts, local = layout(ranks, cluster.ranks_per_host)
    if hosts == 1 and cluster.intra_table and ranks > 1:
        # The measured curve, its ring factor 2 (N-1)/N rescaled from the table's N.
        scale = ((ranks - 1) / ranks) / ((cluster.table_ranks - 1) / cluster.table_ranks)
        return interpolate(cluster.intra_table, nbytes) * scale
    if hosts == 1:
        return ring_allreduce_seconds(nbytes, ranks, cluster.intra_busbw, cluster.intra_latency_s)
    if hierarchical and local > 1:
        inside = ring_allreduce_seconds(nbytes, local, cluster.intra_busbw,
                                        cluster.intra_latency_s)
        across = ring_allreduce_seconds(nbytes, hosts, cluster.inter_bw, cluster.inter_latency_s)
        return inside + across
    return ring_allreduce_seconds(nbytes, ranks, min(cluster.intra_busbw, cluster.inter_bw),
                                  cluster.inter_latency_s)


def interpolate(table: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``table`` (ascending x): below the first point its
    value, above the last the last segment extended."""
    if x <= table[0][0] or len(table) == 1:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = table[-2], table[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def negotiation_seconds(ranks: int, cluster: Cluster) -> float:
    """Horovod's per-cycle coordination: ranks agree on which tensors are ready (a small
    all-reduce of a bit vector with the response cache on: ``2 ceil(log2 N)`` latencies,
    recursive doubling). 0 for one rank, and on one host with a measured ``intra_table`` (its
    times are whole lone calls, the negotiation included)."""
    hosts = layout(ranks, cluster.ranks_per_host)[0] if ranks > 1 else 0
    if ranks <= 1 or (hosts == 1 and cluster.intra_table):
        return 0.0
    latency = cluster.inter_latency_s if hosts > 1 else cluster.intra_latency_s
    return 2 * math.ceil(math.log2(ranks)) * latency


def fuse(nbytes: list[int], threshold: int) -> list[list[int]]:
    """Tensor Fusion of the tensors one cycle found ready, in order: consecutive tensors packed
    into buffers of at most ``threshold`` bytes; a tensor over the threshold goes alone.

    Returns:
        index lists, one per all-reduce. ``fuse([3, 3, 3], 6) == [[0, 1], [2]]``.
    """
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(nbytes):
        if buckets and size + n <= threshold and n <= threshold:
            buckets[-1].append(i)
            size += n
        else:
            buckets.append([i])
            size = n
    return buckets


@dataclass(frozen=True)
class Bucket:
    """One fused all-reduce: start and end times (s, from the step's start) and bytes."""
    start_s: float
    end_s: float
    nbytes: int
    tensors: int


def schedule(ready: list[tuple[float, int]], ranks: int, cluster: Cluster,
             settings: HorovodSettings) -> list[Bucket]:
    """Horovod's background thread over one step: when each fused all-reduce runs.

    Each cycle starts at the next tick of ``cycle_time_s`` (or, with ``cycle_wake``, as soon as a
    tensor is enqueued) once the previous cycle's all-reduces are done; it takes every tensor
    ready by then, negotiates (:func:`negotiation_seconds`), fuses them (:func:`fuse`) and
    all-reduces the buffers one after another (:func:`allreduce_seconds`).

    Args:
        ready: ``(ready time s, bytes)`` per tensor, bytes as sent (after compression).
        ranks, cluster, settings: as in :func:`predict_step`.

    Returns:
        the buckets in order; ``[]`` for one rank or no tensors.
    """
    if ranks <= 1 or not ready:
        return []
    ready = sorted(ready)
    cycle = settings.cycle_time_s
    buckets: list[Bucket] = []
    t, i = 0.0, 0
    while i < len(ready):
        t = max(t, ready[i][0])
        if not settings.cycle_wake and cycle > 0:
            t = math.ceil(t / cycle - 1e-9) * cycle
        j = i
        while j < len(ready) and ready[j][0] <= t + 1e-12:
            j += 1
        t += negotiation_seconds(ranks, cluster)
        sizes = [n for _, n in ready[i:j]]
        for group in fuse(sizes, settings.fusion_threshold):
            nbytes = sum(sizes[g] for g in group)
            end = t + allreduce_seconds(nbytes, ranks, cluster, settings.hierarchical)
            buckets.append(Bucket(t, end, nbytes, len(group)))
            t = end
        i = j
    return buckets


@dataclass(frozen=True)
class StepPrediction:
    """The model's answer for one configuration.

    Attributes:
        ranks: N.
        step_s: one optimizer step (k micro-batches), seconds.
        samples_per_s: ``k x batch x N / step_s``.
        compute_s: the step without communication: ``k x (forward + backward) + optimizer``.
        comm_s: the all-reduces' own time (buckets + negotiation), seconds.
        exposed_s: communication not hidden behind the backward pass, seconds.
        overlap: fraction of ``comm_s`` hidden behind the backward pass (1.0 with no comm).
        buckets: the fused all-reduces.
        straggler_s: the expected wait for the slowest rank, seconds (in ``step_s``).
    """
    ranks: int
    step_s: float
    samples_per_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    overlap: float
    buckets: tuple[Bucket, ...] = field(default=(), repr=False)
    straggler_s: float = 0.0


def sent_bytes(nbytes: int, compression: str) -> int:
    """Bytes on the wire for a float32 gradient of ``nbytes``: halved by fp16 compression."""
    return nbytes // 2 if compression == "fp16" else nbytes


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables] (order statistics; 0.5642 for n=2,
    1.0294 for 4, 1.4236 for 8), by numerical integration of ``x n phi(x) Phi(x)^(n-1)``."""
    if n <= 1:
        return 0.0
    h, total = 0.005, 0.0
    for i in range(-2400, 2401):
        x = i * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * phi * cdf ** (n - 1) * h
    return total


def straggler_seconds(profile: ComputeProfile, ranks: int, k: int = 1) -> float:
    """Expected wait for the slowest rank: a synchronous step ends when the last rank's
    gradients are in, so with independent per-rank compute times of standard deviation sigma
    (k micro-batches: sigma sqrt(k)) the step is longer than the mean by
    ``sigma sqrt(k) E[max of N standard normals]`` (Dean & Barroso 2013, "The tail at scale", on
    why fan-in waits grow with N)."""
    return profile.jitter_s * math.sqrt(k) * expected_max_normal(ranks)


def predict_step(profile: ComputeProfile, ranks: int, cluster: Cluster,
                 settings: HorovodSettings = HorovodSettings()) -> StepPrediction:
    """Predict one optimizer step of ``ranks`` ranks.

    The k-1 first micro-batches compute alone; the last one's gradients are enqueued as its
    backward pass makes them (``ready_s``; a profile whose gradients are all ready at the end, as
    Keras on TensorFlow, enqueues them together), and Horovod's cycles run as :func:`schedule`
    says. Where ``cluster.overlap`` holds, the step ends when both the backward pass and the last
    all-reduce are done: ``exposed = max(0, last all-reduce end - backward end)``. Where it does
    not (CPU ranks: the same cores compute and communicate), the cycles are the same, since the
    hooks enqueue each gradient as it is made and the background thread wakes for it, but none
    of their time hides: ``exposed = max(comm, last all-reduce end - backward end)`` (the second
    where the thread waits for a cycle's tick). Then the optimizer step and the wait for the
    slowest rank (:func:`straggler_seconds`).

    Returns:
        a :class:`StepPrediction`.
    """
    k = settings.backward_passes_per_step
    bwd_start = (k - 1) * profile.micro_batch_s + profile.forward_s
    bwd_end = k * profile.micro_batch_s
    ready = [(bwd_start + g.ready_s, sent_bytes(g.nbytes, settings.compression))
             for g in profile.gradients]
    buckets = schedule(ready, ranks, cluster, settings)
    comm = comm_seconds(buckets, ranks, cluster)
    comm_end = buckets[-1].end_s if buckets else bwd_end
    exposed = max(0.0, comm_end - bwd_end)
    if not cluster.overlap:  # nothing hides, and the last one still waits for its cycle's tick
        exposed = max(exposed, comm)
    straggler = straggler_seconds(profile, ranks, k)
    step = bwd_end + exposed + profile.optimizer_s + straggler
    return StepPrediction(
        ranks=ranks, step_s=step, samples_per_s=k * profile.batch_size * ranks / step,
        compute_s=bwd_end + profile.optimizer_s, comm_s=comm, exposed_s=exposed,
        overlap=1.0 if comm <= 0 else max(0.0, 1.0 - exposed / comm), buckets=tuple(buckets),
        straggler_s=straggler)


def comm_seconds(buckets: list[Bucket], ranks: int, cluster: Cluster) -> float:
    """Communication time of a schedule: the buckets' all-reduces plus one negotiation per
    cycle (cycles = distinct groups of back-to-back buckets)."""
    if not buckets:
        return 0.0
    busy = sum(b.end_s - b.start_s for b in buckets)
    cycles = 1 + sum(1 for a, b in zip(buckets, buckets[1:]) if b.start_s > a.end_s + 1e-12)
    return busy + cycles * negotiation_seconds(ranks, cluster)


def efficiency(prediction: StepPrediction, single: StepPrediction) -> float:
    """Scaling efficiency: samples/s at N over N x samples/s of one rank."""
    return prediction.samples_per_s / (prediction.ranks * single.samples_per_s)


def with_settings(settings: HorovodSettings, **changes) -> HorovodSettings:
    """``settings`` with some fields changed (a new object)."""
    return replace(settings, **changes)
