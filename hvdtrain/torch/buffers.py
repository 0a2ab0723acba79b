"""Model buffers across ranks: :func:`sync_buffers` makes them equal (BatchNorm running
statistics drift apart otherwise), :func:`convert_sync_batchnorm` swaps BatchNorm layers for
Horovod's ``SyncBatchNorm``; and the in-place collective over tensors of any dense memory format
that the buffers and :func:`hvdtrain.torch.broadcast_state` go through.
"""
from __future__ import annotations

import horovod.torch as hvd
import torch

from hvdtrain import runtime


def contiguous_view(tensor: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, ...] | None]:
    """A contiguous view of ``tensor``'s own memory, for the collectives (Horovod's want
    contiguous tensors), without a copy where the memory is dense in another order.

    Returns ``(view, order)``: ``(tensor, None)`` for a contiguous tensor; for a tensor in another
    dense memory format, its dimensions permuted by ``order`` (strides falling), which is
    contiguous: e.g. a ``torch.channels_last`` gradient of shape (N, C, H, W) and strides
    (H*W*C, 1, W*C, C) viewed as (N, H, W, C). An in-place collective on the view writes the
    tensor's memory; ``view.permute(inverse_order(order))`` has ``tensor``'s shape and strides.
    ``(None, None)`` where no permutation is contiguous (gaps or overlaps: a slice, an expanded
    tensor): the caller copies."""
    if tensor.is_contiguous():
        return tensor, None
    # Falling strides; size-1 dimensions (whose strides say nothing) last, in their own order, so
    # that one memory layout always gives the same order, whatever strides they carry.
    order = tuple(sorted(range(tensor.dim()),
                         key=lambda d: (tensor.size(d) == 1, -tensor.stride(d) if
                                        tensor.size(d) != 1 else d)))
    view = tensor.permute(order)
    return (view, order) if view.is_contiguous() else (None, None)


def inverse_order(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``tensor.permute(order)``."""
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return tuple(inverse)


def dense_layout_tensors_(tensors: list[tuple[str, torch.Tensor]], collective) -> None:
    """Run ``collective(buffer, name) -> handle`` on each tensor, all in flight at once, through a
    contiguous copy where the tensor is not contiguous; then wait and copy results back in place.
    A copy, not :func:`contiguous_view`: the copy is in logical order, so ranks whose tensors have
    different layouts (a root restored from a checkpoint saved contiguous, others allocated like
    their channels_last parameters) still exchange element i for element i; these collectives run
    once per job, not per step."""
    pending = []
    for name, tensor in tensors:
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        pending.append((tensor, buffer, collective(buffer, name)))
    for tensor, buffer, handle in pending:
        hvd.synchronize(handle)
        if buffer is not tensor:
            tensor.copy_(buffer)


def sync_buffers(model: torch.nn.Module, op: str = "average", root_rank: int = 0) -> int:
    """Make the model's buffers (BatchNorm ``running_mean``/``running_var``/
    ``num_batches_tracked``, any other registered buffer) equal on every rank, in place.

    Trainable weights stay equal under the gradient all-reduce, but BatchNorm running statistics
    are updated from each rank's own batches and drift apart (about 7e-3 after 8 digits epochs
    at np=2), so ranks would evaluate and checkpoint different models. ``"average"`` (the
    default) all-reduces floating-point buffers to their mean over ranks: each rank's running
    mean and variance estimate its own shard, and their mean uses every shard's data (for equal
    shards the running mean is then the global one; the running variance omits the variance
    between shard means, which a shuffling ``DistributedSampler`` keeps small). Integer buffers
    (``num_batches_tracked``, equal on all ranks anyway) come from ``root_rank``. ``"broadcast"``
    copies every buffer from ``root_rank``, as PyTorch DDP does before each forward
    (``broadcast_buffers=True``), discarding the other ranks' statistics.

    Call it where ranks must agree: before evaluation, before a checkpoint, at the end of
    training (``hvdtrain train`` does all three). Every rank must call it at the same point.

    Args:
        model: any module; its buffers may be on any device and in any memory format.
        op: ``"average"`` or ``"broadcast"``.
        root_rank: the rank whose buffers ``"broadcast"`` (and integer buffers) take.

    Returns:
        The number of buffers synchronised (0 for a model without buffers).

    Raises:
        ValueError: an unknown ``op``.
    """
    runtime.check_buffer_sync_op(op)
    buffers = [(f"hvdtrain.buffer.{name}", b) for name, b in model.named_buffers()]
    if hvd.size() == 1 or not buffers:
        return len(buffers)
    averaged = [(n, b) for n, b in buffers if op == "average" and b.is_floating_point()]
    copied = [(n, b) for n, b in buffers if not (op == "average" and b.is_floating_point())]
    dense_layout_tensors_(averaged, lambda t, n: hvd.allreduce_async_(t, op=hvd.Average, name=n))
    dense_layout_tensors_(copied, lambda t, n: hvd.broadcast_async_(t, root_rank, name=n))
    return len(buffers)


def convert_sync_batchnorm(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every BatchNorm layer (``BatchNorm1d/2d/3d``) in ``model`` with Horovod's
    ``hvd.SyncBatchNorm``, which normalises each batch with the statistics of the global batch
    (all ranks' samples of that step, gathered in the forward pass) and so keeps the running
    statistics equal on every rank; useful when local batches are small (e.g. detection,
    segmentation). The new layers take over the old ones' parameter and buffer objects, so an
    optimizer already built on ``model.parameters()`` keeps working. In place; returns ``model``.

    Costs one all-gather of per-channel statistics per BatchNorm layer per forward pass.
    """
    for name, child in list(model.named_children()):
        if (isinstance(child, torch.nn.modules.batchnorm._BatchNorm)
                and not isinstance(child, hvd.SyncBatchNorm)):
            sync = hvd.SyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                     child.track_running_stats)
            if child.affine:
                sync.weight, sync.bias = child.weight, child.bias
            if child.track_running_stats:
                sync.running_mean, sync.running_var = child.running_mean, child.running_var
                sync.num_batches_tracked = child.num_batches_tracked
            sync.train(child.training)
            setattr(model, name, sync)
        else:
            convert_sync_batchnorm(child)
    return model

