"""The PyTorch adapter: Horovod's DistributedOptimizer, rank-0 broadcast, LR scaling, accumulation.

Typical use (launched with ``horovodrun -np 2 python train.py``)::

    import hvdtrain.torch as ht

    info = ht.init(seed=42)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=4,
                                     lr_scaling="linear")
    scheduler = ht.warmup(optimizer, warmup_epochs=2, steps_per_epoch=...)
    for (x, y), micro in ht.micro_batches(loader, optimizer.backward_passes_per_step):
        loss = F.cross_entropy(model(x), y)
        (loss * micro.loss_scale).backward()
        if micro.sync:
            optimizer.step(); optimizer.zero_grad(); scheduler.step()
"""
from __future__ import annotations

import horovod.torch as hvd
import torch

from hvdtrain import runtime, schedule
from hvdtrain.accumulation import check_distribute_args

_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
_OPS = {"average": hvd.Average, "adasum": hvd.Adasum}


def init(seed: int = 42, threads: int | None = None) -> runtime.RankInfo:
    """Start Horovod, give this rank its share of the cores, and seed it.

    Calls ``hvd.init()``; sets ``torch.set_num_threads`` to ``threads`` or
    ``max(1, cores // local_size)``; seeds torch, NumPy and ``random`` with
    ``runtime.rank_seed(seed, rank)`` (rank 0 gets ``seed``; other ranks differ, and
    :func:`distribute` makes their models equal by broadcasting rank 0's).

    Returns:
        The :class:`~hvdtrain.runtime.RankInfo` of this process.
    """
    hvd.init()
    threads = runtime.thread_budget(hvd.local_size()) if threads is None else int(threads)
    torch.set_num_threads(threads)
    seed = runtime.rank_seed(seed, hvd.rank())
    torch.manual_seed(seed)
    runtime.seed_python_numpy(seed)
    return runtime.RankInfo(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), threads,
                            seed, hvd.cross_size())


def rank_info() -> runtime.RankInfo:
    """This process's rank, sizes and thread count (after :func:`init`)."""
    return runtime.RankInfo(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(),
                            torch.get_num_threads(), torch.initial_seed())


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


def ranks_where(flag: bool, name: str = "hvdtrain.flag") -> list[int]:
    """The ranks on which ``flag`` is true, known to every rank after one all-reduce (a vector of
    ``size`` numbers). Every rank must call it at the same point.

    Returns:
        Sorted ranks (empty when the flag is false everywhere).
    """
    return runtime.ranks_where(flag, hvd.rank(), hvd.size(),
                               lambda values: allreduce_sums(values, name=name))


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    root_rank: int = 0) -> None:
    """Make every rank's model parameters, buffers and optimizer state equal to ``root_rank``'s.

    Parameters and buffers go through ``hvd.broadcast_parameters(model.state_dict())`` (in place).
    The optimizer's whole ``state_dict`` (state tensors and param-group options such as ``lr``) is
    sent with ``hvd.broadcast_object`` and loaded on the other ranks. Horovod's
    ``broadcast_optimizer_state`` is not used: on a fresh optimizer it takes a zero-gradient step
    (which advances Adam's step count and applies weight decay, so training no longer matches a
    single process), it casts options to float32, and it fails on options that are ``None``
    (``foreach``/``fused`` in current PyTorch).

    Every rank must call this, in the same order relative to other collectives.
    """
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    state = optimizer.state_dict() if hvd.rank() == root_rank else None
    state = hvd.broadcast_object(state, root_rank=root_rank, name="hvdtrain.optimizer_state")
    if hvd.rank() != root_rank:
        optimizer.load_state_dict(state)


def distribute(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
               backward_passes_per_step: int = 1, lr_scaling: str = "linear",
               compression: str = "none", op: str = "average", root_rank: int = 0,
               gradient_predivide_factor: float = 1.0):
    """Turn a single-process model and optimizer into synchronous data-parallel ones.

    1. Multiplies each param group's ``lr`` by ``schedule.scale_factor(lr_scaling, size, k)``
       (Goyal et al. 2017 for ``linear``) and records the factor in ``group["hvdtrain_lr_scale"]``.
    2. Wraps ``optimizer`` in ``hvd.DistributedOptimizer`` with ``named_parameters``,
       ``backward_passes_per_step=k``, ``compression`` and ``op``: gradients are all-reduced
       (averaged over ranks) once every k backward passes, at ``optimizer.step()``. Scale each
       micro-batch loss by :class:`MicroBatch` ``.loss_scale`` (see :func:`micro_batches`) so that
       a step is the mean over the global batch of ``local batch x k x size`` samples.
    3. Keeps the optimizer's existing state (Horovod's wrapper alone would drop it), then
       broadcasts parameters, buffers and optimizer state from ``root_rank``
       (:func:`broadcast_state`).

    Args:
        model: the model, shape-agnostic; its parameters must be the optimizer's.
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters, with the single-process
            learning rate.
        backward_passes_per_step: k >= 1 micro-batches per optimizer step.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``.
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16, halving bytes on the
            wire).
        op: ``"average"`` or ``"adasum"`` (Maleki et al. 2020).
        root_rank: rank whose initial state every rank takes.
        gradient_predivide_factor: passed to Horovod (average op only).

    Returns:
        ``(model, optimizer)``: the same model (now equal on all ranks) and the wrapped optimizer,
        which has ``.backward_passes_per_step``.

    Raises:
        ValueError: an unknown ``lr_scaling``/``compression``/``op``, k < 1, or an optimizer that
            does not hold exactly the model's parameters (the message says what to change).
    """
    check_distribute_args(backward_passes_per_step, compression, op, _COMPRESSIONS, _OPS)
    factor = schedule.scale_factor(lr_scaling, hvd.size(), backward_passes_per_step)
    model_params = {id(p) for p in model.parameters()}
    opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if opt_params - model_params:
        raise ValueError("the optimizer holds parameters that are not the model's; build the "
                         "optimizer from model.parameters()")

    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
        group["hvdtrain_lr_scale"] = factor
    named = [(n, p) for n, p in model.named_parameters() if id(p) in opt_params]
    state = optimizer.state_dict()
    wrapped = hvd.DistributedOptimizer(
        optimizer, named_parameters=named, compression=_COMPRESSIONS[compression],
        backward_passes_per_step=backward_passes_per_step, op=_OPS[op],
        gradient_predivide_factor=gradient_predivide_factor)
    # Horovod builds a new optimizer from the param groups and drops the per-parameter state
    # (momentum buffers, Adam moments, step counts), e.g. one just loaded from a checkpoint.
    wrapped.load_state_dict(state)
    optimizer = wrapped
    broadcast_state(model, optimizer, root_rank)
    return model, optimizer


def warmup(optimizer: torch.optim.Optimizer, *, warmup_epochs: float,
           steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that follows :func:`hvdtrain.schedule.lr_at`: from the base lr to the
    scaled lr over ``warmup_epochs`` (Goyal et al. 2017, gradual warmup), then constant.

    Call ``scheduler.step()`` after each ``optimizer.step()``. Works on an optimizer returned by
    :func:`distribute` (whose param groups hold the scaled lr and ``hvdtrain_lr_scale``).

    Args:
        optimizer: the optimizer returned by :func:`distribute`.
        warmup_epochs: epochs of warmup, >= 0 (0: no warmup).
        steps_per_epoch: optimizer steps per epoch (see ``schedule.steps_per_epoch``).

    Raises:
        ValueError: the optimizer did not come from :func:`distribute`.
    """
    factors = []
    for group in optimizer.param_groups:
        if "hvdtrain_lr_scale" not in group:
            raise ValueError("warmup() needs the optimizer returned by hvdtrain.torch.distribute()")
        factors.append(group["hvdtrain_lr_scale"])

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [
        (lambda step, f=f: schedule.warmup_multiplier(step, f, warmup_epochs, steps_per_epoch))
        for f in factors])
