"""Horovod's collectives for the Keras 3 backend in use: ``horovod.tensorflow`` under
``KERAS_BACKEND=tensorflow`` (the default), ``horovod.torch`` under ``KERAS_BACKEND=torch``.

Keras 3 picks its backend once, at ``import keras``; each Horovod framework module loads its own
copy of Horovod's core, so one process uses exactly one of them. Everything here takes and
returns the backend's native tensors (``tf.Tensor`` / ``torch.Tensor``) or NumPy arrays, so the
adapter above it is the same code for both backends.
"""
from __future__ import annotations

import keras
import numpy as np

from hvdtrain import runtime

NAME = keras.backend.backend()
if NAME == "tensorflow":
    import tensorflow as tf
    try:
        import horovod.tensorflow as hvd
    except (ImportError, tf.errors.NotFoundError) as exc:
        # Not built (scripts/setup.sh leaves the TF ops out of GPU builds), or built with NCCL
        # against a TensorFlow that lacks the API they call ("undefined symbol").
        if not any(s in str(exc) for s in ("has not been built", "undefined symbol")):
            raise
        raise ImportError(
            f"hvdtrain.keras on Keras's TensorFlow backend needs Horovod's TensorFlow ops, and "
            f"this Horovod has no usable ones ({exc}). scripts/setup.sh leaves them out of GPU "
            f"builds (with NCCL they need a TensorFlow API that recent TensorFlow no longer has): "
            f"run Keras on its PyTorch backend (hvdtrain train --keras-backend torch, or "
            f"KERAS_BACKEND=torch), or build Horovod for the CPU with TensorFlow installed "
            f"(HVDTRAIN_GPU=0 make setup)") from exc
elif NAME == "torch":
    import horovod.torch as hvd
    import torch

    from hvdtrain.torch.collectives import finite as _torch_finite
else:  # pragma: no cover - depends on the environment
    raise ImportError(f"hvdtrain.keras runs on Keras's tensorflow and torch backends; "
                      f"KERAS_BACKEND is {NAME!r}: set KERAS_BACKEND=tensorflow or torch")

COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def native(value):
    """The backend tensor behind a Keras variable or tensor, dense and detached from autograd
    (a ``tf.IndexedSlices`` gradient, e.g. an ``Embedding``'s, becomes a dense tensor: Horovod's
    ``sparse_as_dense``)."""
    if isinstance(value, keras.Variable):
        value = value.value
    if NAME == "tensorflow":
        return tf.convert_to_tensor(value)
    if not isinstance(value, torch.Tensor):
        return torch.as_tensor(value)
    out = value.detach().contiguous()
    if _variable_storage(value) and out.untyped_storage().data_ptr() == \
            value.untyped_storage().data_ptr():
        # A variable's own storage (a Keras torch variable is a Parameter; ops.cast to its own
        # dtype returns it, ops.reshape a view of it): grouped_average must not overwrite it.
        out._hvdtrain_variable = True
    return out


def finite(value):
    """Whether every number of a backend tensor is finite: a 0-d bool tensor (the mirror of
    :func:`hvdtrain.torch.collectives.finite`, which it is on the torch backend: one read of
    the tensor); on TensorFlow ``is_finite`` and ``reduce_all``, which its kernels fuse."""
    if NAME == "torch":
        return _torch_finite(value)
    return tf.reduce_all(tf.math.is_finite(value))


def _variable_storage(t) -> bool:
    """Whether torch tensor ``t`` is a ``Parameter`` (a Keras variable's value) or a view of
    one."""
    return isinstance(t, torch.nn.Parameter) or (t._is_view()
                                                 and isinstance(t._base, torch.nn.Parameter))


def grouped_average(tensors: list, compression: str = "none",
                    gradient_predivide_factor: float = 1.0, name: str | None = None) -> list:
    """The mean over ranks of each tensor, in one grouped all-reduce (Horovod fuses the group
    into one ring operation); works inside a compiled TensorFlow step.

    Args:
        tensors: native tensors, the same shapes and dtypes on every rank.
        compression: ``"none"`` or ``"fp16"`` (sent as float16, returned in the input dtype).
        gradient_predivide_factor: divide by this before the sum and by ``size / factor`` after
            (Horovod's DistributedOptimizer option; 1.0: a plain average).

    Returns:
        The averaged tensors, in order.
    """
    if not tensors:
        return []
    scaling = {}
    op = hvd.Average
    if gradient_predivide_factor != 1.0:
        op = hvd.Sum
        scaling = {"prescale_factor": 1.0 / gradient_predivide_factor,
                   "postscale_factor": gradient_predivide_factor / hvd.size()}
    if NAME == "torch":
        return _torch_grouped_average_(list(tensors), COMPRESSIONS[compression], op, name,
                                       scaling)
    return list(hvd.grouped_allreduce(list(tensors), op=op, compression=COMPRESSIONS[compression],
                                      name=name, **scaling))


def _torch_grouped_average_(tensors: list, compression, op, name: str | None,
                            scaling: dict) -> list:
    """:func:`grouped_average` on the torch backend, with Horovod's in-place grouped all-reduce
    (``grouped_allreduce_async_`` + ``synchronize``), as Horovod's PyTorch
    ``DistributedOptimizer`` reduces ``p.grad``.

    ``hvd.grouped_allreduce`` (out of place) allocates an output per tensor, copies the input
    into it and runs through an autograd ``Function``; the gradients passed here are the step's
    ``.grad`` tensors, which Keras's torch trainer drops after the step (``zero_grad`` sets them
    to ``None``), so they are reduced where they lie: THE TENSORS GIVEN ARE OVERWRITTEN with
    the result. A tensor that may be someone else's storage is copied first: a Keras variable's
    (marked by :func:`native`), a ``Parameter`` or a view of one, one that needs grad or is
    not contiguous. With ``compression="fp16"`` the float16 copies are reduced (in place) and
    turned back into the input dtype, as ``hvd.grouped_allreduce`` does.
    """
    sent, ctxs = [], []
    for t in tensors:
        if (getattr(t, "_hvdtrain_variable", False) or _variable_storage(t)
                or t.requires_grad or not t.is_contiguous()):
            t = t.detach().clone(memory_format=torch.contiguous_format)
        c, ctx = compression.compress(t)
        sent.append(c)
        ctxs.append(ctx)
    hvd.synchronize(hvd.grouped_allreduce_async_(sent, op=op, name=name, **scaling))
    return [compression.decompress(c, ctx) for c, ctx in zip(sent, ctxs)]


def allreduce_numpy(values: np.ndarray, op: str, name: str) -> np.ndarray:
    """``values`` (any shape) reduced over ranks with ``op`` (``"sum"``, ``"min"``, ``"max"``),
    in their own dtype, eagerly."""
    hop = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max}[op]
    if NAME == "tensorflow":
        return hvd.allreduce(tf.constant(values), op=hop, name=name).numpy()
    return hvd.allreduce(torch.from_numpy(np.ascontiguousarray(values)), op=hop,
                         name=name).numpy()


def broadcast_variables(variables: list, root_rank: int, name: str) -> None:
    """Assign every Keras variable ``root_rank``'s value of it, eagerly (one broadcast per
    variable, in order; every rank passes the same list)."""
    for i, var in enumerate(variables):
        var.assign(hvd.broadcast(native(var), root_rank, name=f"{name}.{i}"))


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Horovod's ``broadcast_object`` (pickled) for this backend."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def allgather_object(obj, name: str | None = None) -> list:
    """Horovod's ``allgather_object`` (a list with every rank's object, in rank order)."""
    return hvd.allgather_object(obj, name=name)


def allreduce_sums(values: dict[str, float], name: str = "hvdtrain.metrics") -> dict[str, float]:
    """Sum scalar values over all ranks, in float64, in one all-reduce (eager).

    Every rank must pass the same keys (sorted before the all-reduce).

    Returns:
        ``{key: global sum}``.
    """
    keys = sorted(values)
    summed = allreduce_numpy(np.array([float(values[k]) for k in keys], np.float64), "sum", name)
    return dict(zip(keys, summed.tolist()))


def ranks_where(flag: bool, name: str = "hvdtrain.flag") -> list[int]:
    """The ranks on which ``flag`` is true, known to every rank after one all-reduce (a vector of
    ``size`` numbers). Every rank must call it at the same point.

    Returns:
        Sorted ranks (empty when the flag is false everywhere).
    """
    return runtime.ranks_where(flag, hvd.rank(), hvd.size(),
                               lambda values: allreduce_sums(values, name=name))
