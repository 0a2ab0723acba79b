"""Horovod's collectives as the PyTorch adapter and the run use them: scalar sums over ranks in
one all-reduce, the ranks where a flag is set, a finiteness check that needs no collective, and
the data-parallel micro-batch loop that checks the ranks' batch counts up front. The Keras
mirror is :mod:`hvdtrain.keras.collectives`.
"""
from __future__ import annotations

import horovod.torch as hvd
import torch

from hvdtrain import accumulation, runtime
from hvdtrain.accumulation import leading_dim


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Horovod's ``broadcast_object`` (pickled): ``obj`` from ``root_rank`` on every rank."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def allgather_object(obj, name: str | None = None) -> list:
    """Horovod's ``allgather_object`` (a list with every rank's object, in rank order)."""
    return hvd.allgather_object(obj, name=name)


def allreduce_sums(values: dict[str, float], name: str = "hvdtrain.metrics") -> dict[str, float]:
    """Sum scalar values over all ranks, in float64, in one all-reduce.

    Used for metrics: each rank passes ``{"loss_sum": ..., "correct": ..., "samples": ...}`` and
    every rank gets the global totals back (divide afterwards, so ranks with unequal sample counts
    are weighted correctly). Keys are sorted, so every rank must pass the same keys.

    Returns:
        ``{key: global sum}``.
    """
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    summed = hvd.allreduce(tensor, op=hvd.Sum, name=name)
    return dict(zip(keys, summed.tolist()))


def finite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether every number of ``tensor`` (any shape and dtype) is finite: a 0-d bool tensor on
    its device, made without a device synchronisation.

    One read of the tensor (``torch.aminmax``: NaN propagates to both ends, an infinity is an
    end) and no temporary of its size. ``torch.isfinite(t).all()`` writes a bool tensor of
    ``t``'s size and reduces it: on one CPU core it took 14 x as long (24 ms against 1.7 ms for
    the 42 MB of gradients of the benchmarks' dense model), once per step.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def all_finite(tensors) -> bool:
    """True when every tensor (any shape; None entries skipped) holds only finite numbers
    (:func:`finite`), with one device synchronisation. On gradients after
    ``optimizer.synchronize()`` (the same on every rank) every rank gets the same answer without
    a collective."""
    flags = [finite(t) for t in tensors if t is not None]
    return bool(torch.stack(flags).all()) if flags else True


def ranks_where(flag: bool, name: str = "hvdtrain.flag") -> list[int]:
    """The ranks on which ``flag`` is true, known to every rank after one all-reduce (a vector of
    ``size`` numbers). Every rank must call it at the same point.

    Returns:
        Sorted ranks (empty when the flag is false everywhere).
    """
    return runtime.ranks_where(flag, hvd.rank(), hvd.size(),
                               lambda values: allreduce_sums(values, name=name))


def micro_batches(batches, backward_passes_per_step: int, samples_of=leading_dim):
    """:func:`hvdtrain.accumulation.micro_batches` for a data-parallel loop: yields ``(batch,
    MicroBatch)``, k batches to a group; run ``optimizer.step()`` when ``micro.sync``.

    The loss weights (:attr:`MicroBatch.loss_weight`, ``samples / group samples on this rank``)
    make each step the mean over the global batch only when every rank's group holds the same
    number of samples, and every rank must run the same number of groups (a rank with more
    batches waits forever in the all-reduce of a step the others never take). Both hold for a
    ``DistributedSampler`` (it pads every rank's shard to the same length) with equal batch
    sizes. For uneven data (an ``IterableDataset``, a custom sampler, token counts), give every
    rank the same number of equal batches, or end each rank's loop with Horovod's ``hvd.join()``
    and weigh losses by the global sample count yourself.

    When ``batches`` has a length on every rank, the ranks' lengths are compared right here, in
    the call, with one all-reduce (every rank must call it), so unequal counts fail at once on
    every rank instead of hanging later. Without a length (an ``IterableDataset``) nothing is
    checked.

    Returns:
        An iterator of ``(batch, MicroBatch)``.

    Raises:
        ValueError: the ranks have different numbers of batches (on every rank), or the errors
            of :func:`hvdtrain.accumulation.micro_batches` (when iterating).
    """
    # Argument checks first (at the call), so no rank reaches the collective alone.
    groups = accumulation.micro_batches(batches, backward_passes_per_step, samples_of)
    if hvd.size() > 1:
        try:
            count = len(batches)
        except TypeError:  # e.g. a DataLoader over an IterableDataset without a length
            count = -1
        # Every rank takes part, with a length or without: -1 anywhere means "unknown", no check.
        low, neg_high = hvd.allreduce(torch.tensor([count, -count], dtype=torch.int64),
                                      op=hvd.Min, name="hvdtrain.batch_counts").tolist()
        if low >= 0 and low != -neg_high:
            raise ValueError(
                f"the ranks have different numbers of batches per epoch (between {low} and "
                f"{-neg_high}; this rank: {count}), so some would wait forever in the all-reduce: "
                "shard with torch.utils.data.DistributedSampler (it pads every rank to the same "
                "length) or give every rank the same number of batches")
    return groups


