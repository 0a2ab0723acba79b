"""Gradient accumulation plan: which micro-batch closes an optimizer step, and how to scale its loss.

With ``backward_passes_per_step = k``, each rank runs k forward/backward passes (micro-batches)
and Horovod all-reduces the summed gradients once, at the optimizer step. For the step to equal
one step on the mean loss over the global batch, each micro-batch loss is multiplied by
``len(micro-batch) / samples in its group``. The last group of an epoch may hold r < k
micro-batches (and a short last batch); the scale then uses that group's own sample count, so the
step is still the mean over the samples it saw -- not r/k of it, which is what a fixed ``1/k``
gives (the usual accumulation mistake at epoch ends).

Framework-free: both adapters use it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


@dataclass(frozen=True)
class MicroBatch:
    """Where one micro-batch stands in its accumulation group.

    Attributes:
        index: position in the group, 0-based.
        group_size: micro-batches in this group (k, or r < k for the epoch's last group).
        samples: samples in this micro-batch (its leading dimension).
        group_samples: samples in the whole group on this rank.
        loss_weight: ``samples / group_samples``; multiply the micro-batch's mean loss by it.
            (Called ``loss_scale`` before 0.2; that name still works, with a
            ``DeprecationWarning``, and is easily confused with AMP's loss scale,
            ``torch.amp.GradScaler.scale``, which sits in the same loop.)
            After Horovod averages the ranks' gradients, the step is the mean over the global
            batch only when every rank's group holds the same number of samples (true for a
            padded ``DistributedSampler`` with equal batch sizes; see
            :func:`hvdtrain.torch.micro_batches` for the uneven case).
        sync: True on the group's last micro-batch: call ``optimizer.step()`` after its backward.
    """
    index: int
    group_size: int
    samples: int
    group_samples: int
    loss_weight: float
    sync: bool

    @property
    def loss_scale(self) -> float:
        """Deprecated name of :attr:`loss_weight` (kept so existing loops keep working)."""
        warnings.warn("MicroBatch.loss_scale is deprecated: use MicroBatch.loss_weight (the name "
                      "'loss scale' belongs to mixed precision's GradScaler)", DeprecationWarning,
                      stacklevel=2)
        return self.loss_weight


def leading_dim(batch: Any) -> int:
    """Samples in a batch: the first dimension of the batch, or of its first element when the
    batch is a tuple/list/dict of arrays or tensors (shape ``(B, ...)``).

    Raises:
        TypeError: nothing in the batch has a ``shape`` or a ``len``.
    """
    item = batch
    if isinstance(item, dict) and item:
        item = next(iter(item.values()))
    elif isinstance(item, (tuple, list)) and item:
        item = item[0]  # (inputs, targets): count the inputs
    if hasattr(item, "shape") and len(item.shape) > 0:
        return int(item.shape[0])
    if hasattr(item, "__len__"):
        return len(item)
    raise TypeError(f"cannot tell the number of samples in a batch of type {type(batch).__name__}; "
                    "pass samples_of=... to say how")


def micro_batches(batches: Iterable[Any], backward_passes_per_step: int,
                  samples_of: Callable[[Any], int] = leading_dim) -> Iterator[tuple[Any, MicroBatch]]:
    """Yield ``(batch, MicroBatch)`` for each batch, grouped k at a time.

    Reads up to k batches ahead (one group) to know the group's sample count, so it works for any
    iterable, including ones whose length is unknown.

    Args:
        batches: an iterable of batches (e.g. a ``DataLoader``).
        backward_passes_per_step: k >= 1.
        samples_of: returns the number of samples in a batch.

    Raises:
        ValueError: k < 1 (at the call), or a batch with no samples (when iterating).
    """
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    return _groups(batches, backward_passes_per_step, samples_of)


def _groups(batches: Iterable[Any], backward_passes_per_step: int,
            samples_of: Callable[[Any], int]) -> Iterator[tuple[Any, MicroBatch]]:
    """The generator behind :func:`micro_batches` (which checks its arguments at the call)."""
    group: list[Any] = []
    iterator = iter(batches)
    while True:
        group.clear()
        for batch in iterator:
            group.append(batch)
            if len(group) == backward_passes_per_step:
                break
        if not group:
            return
        counts = [samples_of(b) for b in group]
        if min(counts) < 1:
            raise ValueError("a batch with no samples reached the accumulation loop; "
                             "check the data loader's batch size and sharding")
        total = sum(counts)
        for i, (batch, n) in enumerate(zip(group, counts)):
            yield batch, MicroBatch(index=i, group_size=len(group), samples=n, group_samples=total,
                                    loss_weight=n / total, sync=(i == len(group) - 1))


def adasum_takes(size: int) -> bool:
    """Whether Horovod 0.28.1's Adasum runs at world size ``size``: a power of 2 only."""
    return size >= 1 and not size & (size - 1)


def check_distribute_args(backward_passes_per_step, compression: str, op: str,
                          compressions, ops) -> None:
    """The argument checks both adapters' ``distribute`` share.

    Raises:
        ValueError: k is not a whole number >= 1, or ``compression``/``op`` is not offered.
    """
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be a whole number >= 1, got "
                         f"{backward_passes_per_step!r}")
    if compression not in compressions:
        raise ValueError(f"compression must be one of {', '.join(compressions)}; "
                         f"got {compression!r}")
    if op not in ops:
        raise ValueError(f"op must be one of {', '.join(ops)} here; got {op!r}")
