"""What :func:`hvdtrain.torch.distribute` puts into Horovod's ``DistributedOptimizer``: gradients
in any dense memory format (:class:`DenseLayout`), and PyTorch DDP's rules for gradients whose
all-reduce is in flight (:func:`accept_ddp_idioms`).

Horovod starts a parameter's all-reduce in ``loss.backward()``, as soon as its gradient is ready
(after ``backward_passes_per_step`` passes), and collects it in ``optimizer.step()``. In between,
Horovod 0.28.1 refuses two things DDP allows, and both are in the canonical DCGAN
(pytorch/examples ``dcgan/main.py``):

- another backward pass reaching the parameter: the discriminator step
  ``errD_real.backward(); errD_fake.backward(); optimizerD.step()`` stops with "Gradients were
  computed more than backward_passes_per_step times before call to step()";
- zeroing the gradients: the generator step ``errG.backward()`` gives the discriminator gradients
  too (through ``netD(fake)``), which the discriminator's next step zeroes; ``optimizerD
  .zero_grad()`` then stops with "optimizer.zero_grad() was called after loss.backward() but
  before optimizer.step()" (and ``netD.zero_grad()`` with the first error, one pass later).

With :func:`accept_ddp_idioms` both behave as under DDP, which all-reduces every backward pass:

- A gradient arriving at a parameter whose all-reduce is in flight first waits for that
  all-reduce and keeps its average in ``.grad``; the new gradient accumulates on top and the sum
  is all-reduced again when the pass count is reached again (at the latest in ``step()``). The
  average of ``avg1 + local2`` is ``avg1 + avg2``: ``.grad`` at ``step()`` is the gradient of
  all the passes' losses over the global batch, as one process computes it.
- Gradients zeroed while their all-reduce is in flight (``optimizer.zero_grad()``, or
  ``module.zero_grad()`` / ``p.grad = None`` seen at the next backward pass or ``step()``):
  the all-reduce is waited for and its result dropped, and the pass count starts again.

Each decision follows the program's own calls, which are the same on every rank, so every rank
waits for the same all-reduces and starts the same ones, in the same passes, under the same names
(never two of one name in flight), and no all-reduce is left behind.

What stays an error (``RuntimeError`` at the next backward pass reaching the parameter, or at
``step()``/``synchronize()``): a gradient changed in place while its all-reduce is in flight,
e.g. ``module.zero_grad(set_to_none=False)`` or ``p.grad.zero_()`` between ``backward()`` and
``step()``, or ``clip_grad_norm_``/``GradScaler.unscale_`` before ``optimizer.synchronize()``.
Horovod's background thread reads and writes that memory meanwhile, so what ``step()`` then
applies depends on timing and differs between runs and ranks (raw Horovod trains on silently).
It is seen by the tensor's version counter, which every in-place PyTorch operation increments.
``optimizer.zero_grad()`` is always safe: it waits first.
"""
from __future__ import annotations

import functools
import types

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import rocm_built, synchronize as _wait

from hvdtrain.torch.buffers import contiguous_view, inverse_order


class DenseLayout:
    """A Horovod gradient compressor (``compress``/``decompress``) around another one that lets
    gradients in any dense memory format through, e.g. ``torch.channels_last``: Horovod's
    all-reduce wants contiguous tensors (``ValueError: Tensor is required to be contiguous.``).
    A gradient dense in another order is sent as a contiguous view of its own memory, its
    dimensions permuted (:func:`~hvdtrain.torch.buffers.contiguous_view`): the in-place
    all-reduce writes the gradient itself, with no device copy. That needs the same layout on
    every rank: autograd gives a gradient its parameter's layout, parameters are laid out alike
    on every rank, and a missing gradient is zeros in its parameter's layout (:func:`_synchronize`) (the contiguous copy and the copy back that this took before
    cost two permuting copies of every such gradient per step). Only a gradient with gaps in
    its memory goes through a contiguous copy. The result comes back in the gradient's own
    shape and strides; contiguous gradients pass untouched.

    The context it gives Horovod also names the gradient sent and its version counter then, so
    that :func:`accept_ddp_idioms` can tell whether ``.grad`` is still that gradient, unchanged.
    """

    def __init__(self, inner):
        self.inner = inner

    def compress(self, tensor: torch.Tensor):
        """``(tensor to send, context)``: the tensor, a contiguous view of it, or (memory with
        gaps) a contiguous copy; the context's first item says which (None, the permutation,
        or the tensor whose layout the result takes)."""
        view, order = contiguous_view(tensor)
        if view is None:
            compressed, ctx = self.inner.compress(tensor.contiguous())
            return compressed, (tensor, ctx, tensor, tensor._version)
        compressed, ctx = self.inner.compress(view)
        return compressed, (order, ctx, tensor, tensor._version)

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        """The reduced tensor, in the shape and memory format of the tensor given to
        :meth:`compress`."""
        if ctx is None:  # Horovod's sparse path (an all-gather) passes no context
            return self.inner.decompress(tensor, None)
        layout, inner_ctx = ctx[:2]
        out = self.inner.decompress(tensor, inner_ctx)
        if layout is None:
            return out
        if isinstance(layout, tuple):
            return out.permute(inverse_order(layout))
        return torch.empty_like(layout).copy_(out)


# Horovod's own in-place writes to a gradient in flight: none, except on ROCm, where the average
# is a division in place (torch's div_) when the all-reduce completes.
_OWN_WRITES = 1 if rocm_built() else 0


def _sent(ctx):
    """``(gradient sent, its version then)`` from a :class:`DenseLayout` context, or
    ``(None, None)`` (a sparse gradient's all-gather)."""
    return (ctx[2], ctx[3]) if isinstance(ctx, tuple) and len(ctx) == 4 else (None, None)


def _check_unchanged(optimizer, p: torch.Tensor, ctx) -> None:
    """Raise if ``p.grad`` is the gradient sent and was changed in place since (see the module
    docstring)."""
    sent, version = _sent(ctx)
    if sent is not None and p.grad is sent and sent._version > version + _OWN_WRITES:
        name = optimizer._parameter_names.get(p, "a parameter")
        raise RuntimeError(
            f"the gradient of {name} was changed in place while its all-reduce was in flight "
            "(between loss.backward() and optimizer.step()): Horovod reads and writes it "
            "meanwhile, so the result would depend on timing and differ between ranks. To zero "
            "gradients use optimizer.zero_grad() or module.zero_grad() with set_to_none=True "
            "(the default); to clip or unscale them, call optimizer.synchronize() first, then "
            "clip/unscale, then optimizer.step() inside 'with optimizer.skip_synchronize():'")


def _collect(optimizer, p: torch.Tensor, keep: bool) -> None:
    """Take ``p`` out of Horovod's books (its pass count starts again); if its all-reduce is in
    flight, wait for it, and with ``keep`` put the average into ``p.grad`` when ``p.grad`` is
    still the gradient sent (else the result is dropped: the gradient was zeroed or replaced)."""
    handle, ctx = optimizer._handles.pop(p)
    optimizer._allreduce_delay[p] = optimizer.backward_passes_per_step
    if handle is None:  # passes counted, nothing sent yet
        return
    output = handle() if callable(handle) else _wait(handle)
    sent, _ = _sent(ctx)
    if not keep or p.grad is None:
        return
    if sent is None:  # a sparse gradient, as Horovod's synchronize() puts it back
        aggregated = optimizer._compression.decompress(output, ctx)
        p.grad.zero_().add_(aggregated if aggregated.is_sparse else aggregated.to_sparse())
    elif p.grad is sent:
        p.grad.set_(optimizer._compression.decompress(output, ctx))


def _before_accumulation(optimizer, p: torch.Tensor, grad=None) -> None:
    """Run when a backward pass brings ``p`` a gradient ``grad``, before it is added to
    ``p.grad``."""
    entry = optimizer._handles.get(p)
    if entry is None:
        return
    handle, ctx = entry
    if handle is None:  # passes counted, nothing sent yet
        if p.grad is None:  # ... and zeroed since: count again
            _collect(optimizer, p, keep=False)
        return
    _check_unchanged(optimizer, p, ctx)
    _collect(optimizer, p, keep=True)


def _hook_new_parameters(optimizer) -> None:
    """A :func:`_before_accumulation` hook on each parameter Horovod hooks and this has not yet
    (all at first; later those that Horovod registers late: scripts/horovod_patches/05-*)."""
    for p in optimizer._requires_update - optimizer.hvdtrain_hooked:
        p.register_hook(functools.partial(_before_accumulation, optimizer, p))
        optimizer.hvdtrain_hooked.add(p)


def _zero_grad(self, set_to_none: bool = True) -> None:
    """``torch.optim.Optimizer.zero_grad``, allowed between ``backward()`` and ``step()``: the
    all-reduces in flight are waited for and their results dropped first."""
    for p in list(self._handles):
        _collect(self, p, keep=False)
    type(self).zero_grad(self, set_to_none=set_to_none)


def _synchronize(self) -> None:
    """Horovod's ``synchronize()``, after checking the gradients in flight: one changed in place
    raises; one zeroed or replaced since has its all-reduce waited for and dropped (Horovod then
    treats ``p.grad`` as a gradient not yet sent)."""
    for p, (handle, ctx) in list(self._handles.items()):
        if handle is None:
            continue
        _check_unchanged(self, p, ctx)
        sent, _ = _sent(ctx)
        if sent is not None and p.grad is not sent:
            _collect(self, p, keep=False)
    for p in self._requires_update:
        if p.grad is None and p not in self._handles:
            # Horovod would send a contiguous zero tensor for a parameter this rank gave no
            # gradient (control flow); DenseLayout sends a channels_last gradient in memory
            # order, so the zeros take the parameter's layout, as the other ranks' gradients do.
            p.grad = torch.zeros_like(p)
    type(self).synchronize(self)
    _hook_new_parameters(self)


def accept_ddp_idioms(optimizer) -> None:
    """Give a Horovod ``DistributedOptimizer`` (average op, built with :class:`DenseLayout`)
    DDP's rules for gradients in flight (module docstring): ``zero_grad()`` and ``synchronize()``
    of its own on the instance, and a hook on each parameter before its gradient accumulates.
    Nothing changes where Horovod has no hooks (one rank, not elastic: it never has an
    all-reduce in flight)."""
    if not (optimizer._grad_accs or hvd.size() > 1):
        return
    optimizer.hvdtrain_hooked = set()
    _hook_new_parameters(optimizer)
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)
    optimizer.synchronize = types.MethodType(_synchronize, optimizer)
