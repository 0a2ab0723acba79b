"""Gradient all-reduces started during the backward pass on Keras's PyTorch backend, as Horovod's
PyTorch ``DistributedOptimizer`` starts them (one ``allreduce_async_`` per gradient from a hook
as soon as autograd has finished it, fused by Horovod's background thread, waited for just
before the update). The all-reduce of the first layers' gradients then runs while autograd is
still computing the last ones, instead of after the whole backward pass.

Keras's torch trainer (``keras/src/backend/torch/trainer.py``, ``train_step``) calls
``optimizer.scale_loss(loss)`` right before ``loss.backward()`` and
``optimizer.apply(grads)`` right after it; :class:`BackwardAllreduce` arms the hooks in the
first and collects the results in the second (``GradientAllreduce.clip_gradients``). A step
that does not go through ``scale_loss`` (a custom ``train_step``, ``torch.autograd.grad``) is
not armed and takes the grouped all-reduce after backward, as before. The hooks are put on the
variables by :func:`hvdtrain.keras.distribute`, so every rank's first step (an elastic
newcomer's too) is armed alike.

Used only with one backward pass per step (``backward_passes_per_step=1``), without a
``LossScaleOptimizer`` or ``loss_scale_factor`` and without variables that take their gradient
as their value (``overwrite_with_gradient``): Keras's ``apply`` reads those gradients before
``_clip_gradients``, while their all-reduce would still write them. Eager steps only (not
under ``torch.compile``). Between ``backward()`` and ``optimizer.apply`` a custom step must
not change the gradients in place (e.g. ``clip_grad_norm_``): they are being all-reduced.
"""
from __future__ import annotations

import torch

from hvdtrain.keras import collectives as B


class BackwardAllreduce:
    """The per-gradient hooks of one distributed optimizer.

    Args:
        compression: ``"none"`` or ``"fp16"``.
        predivide: Horovod's ``gradient_predivide_factor`` (1.0: a plain average).
        check_finite: also note, per gradient, whether this rank's local gradient was finite
            (the :class:`~hvdtrain.keras.optimizer.NonFiniteGuard`'s flag, computed before the
            gradient is overwritten by its all-reduce).

    Raises:
        RuntimeError: (from ``backward()``) a gradient was accumulated twice in one armed step,
            i.e. ``backward`` ran twice between ``scale_loss`` and ``apply``; its first
            all-reduce is still in flight.
    """

    _made = 0  # instances made in this process, the same sequence on every rank

    def __init__(self, compression: str, predivide: float, check_finite: bool):
        self.compression = B.COMPRESSIONS[compression]
        self.predivide = predivide
        self.check_finite = check_finite
        BackwardAllreduce._made += 1
        self.prefix = f"hvdtrain.grad.{BackwardAllreduce._made}"  # two optimizers: two names
        self.armed = False
        self.hooked: list = []  # the Parameters with a hook
        self._inflight: dict[int, tuple] = {}  # grad data_ptr -> (handle, grad, sent, ctx)
        self.local_bad = None  # tensor (bool), this rank's gradients so far not all finite
        self.steps = 0  # steps whose gradients were all-reduced during backward

    def register(self, variables: list) -> None:
        """Put a hook on the torch ``Parameter`` of each Keras variable (once)."""
        if self.hooked:
            return
        for i, var in enumerate(variables):
            param = getattr(var, "value", None)
            if isinstance(param, torch.nn.Parameter) and param.requires_grad:
                param.register_post_accumulate_grad_hook(self._hook(f"{self.prefix}.{i}"))
                self.hooked.append(param)

    def arm(self) -> None:
        """Start the next backward pass's all-reduces from the hooks (``scale_loss``)."""
        if self.hooked and not torch.compiler.is_compiling():
            self.armed, self._inflight, self.local_bad = True, {}, None

    def _hook(self, name: str):
        def hook(param: torch.nn.Parameter) -> None:
            if not self.armed or param.grad is None:
                return
            grad = param.grad
            key = grad.data_ptr()
            if key in self._inflight:
                self.armed = False
                raise RuntimeError(
                    f"{name}: a gradient was accumulated twice in one step while its all-reduce "
                    "was in flight (backward ran twice between optimizer.scale_loss and "
                    "optimizer.apply); compute one loss and call backward once per step")
            if self.check_finite:
                bad = torch.logical_not(B.finite(grad))
                self.local_bad = bad if self.local_bad is None else self.local_bad | bad
            sent, ctx = self.compression.compress(grad)
            op, scaling = B.hvd.Average, {}
            if self.predivide != 1.0:  # the size read now: elastic jobs change it
                op = B.hvd.Sum
                scaling = {"prescale_factor": 1.0 / self.predivide,
                           "postscale_factor": self.predivide / B.hvd.size()}
            handle = B.hvd.allreduce_async_(sent, name=name, op=op, **scaling)
            self._inflight[key] = (handle, grad, sent, ctx)
        return hook

    def collect(self, grads: list) -> tuple[list, list[int]]:
        """Wait for the all-reduces started in backward and disarm.

        Args:
            grads: the step's gradients (torch tensors), as the optimizer got them.

        Returns:
            ``(reduced, missing)``: ``reduced[i]`` is the all-reduced ``grads[i]`` (the same
            storage, overwritten), or None where no hook started one; ``missing`` the indices
            of those (every rank has the same ones: the same model ran the same backward).
        """
        self.armed = False
        inflight, self._inflight = self._inflight, {}
        reduced, missing = [], []
        for i, g in enumerate(grads):
            entry = inflight.pop(g.data_ptr(), None) if g is not None else None
            if entry is None:
                reduced.append(None)
                missing.append(i)
                continue
            handle, grad, sent, ctx = entry
            B.hvd.synchronize(handle)
            if sent is not grad:  # compressed: back into the gradient's own dtype and storage
                grad.copy_(self.compression.decompress(sent, ctx))
            reduced.append(grad.detach())
        for handle, *_ in inflight.values():  # gradients the optimizer did not get
            B.hvd.synchronize(handle)
        self.steps += len(missing) < len(grads)
        return reduced, missing
