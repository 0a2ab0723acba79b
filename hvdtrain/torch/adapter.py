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
        (loss * micro.loss_weight).backward()
        if micro.sync:
            optimizer.step(); optimizer.zero_grad(); scheduler.step()
"""
from __future__ import annotations

import horovod.torch as hvd
import horovod.torch.optimizer as _hvd_optimizer
import torch

from hvdtrain import runtime, schedule
from hvdtrain.launch import tuning
from hvdtrain.accumulation import adasum_takes, check_distribute_args
from hvdtrain.torch.buffers import dense_layout_tensors_, convert_sync_batchnorm
from hvdtrain.torch.optimizer import DenseLayout, accept_ddp_idioms
# Also importable from here (the trainers call adapter.allreduce_sums, ...).
from hvdtrain.torch.collectives import (all_finite, allreduce_sums, micro_batches,  # noqa: F401
                                        ranks_where)
# Also importable from here (they lived here before torch/buffers.py and torch/scheduler.py);
# the trainer calls them as adapter.sync_buffers and adapter.warmup.
from hvdtrain.torch.buffers import sync_buffers  # noqa: F401
from hvdtrain.torch.scheduler import Warmup, warmup  # noqa: F401

# distribute()'s choices (hvdtrain.torch.lightning's strategy checks its arguments against them).
COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
OPS = {"average": hvd.Average, "adasum": hvd.Adasum}
_distribute_calls = 0  # distribute() calls so far in this process: each model's tensor names


def init(seed: int | None = 42, threads: int | None = None, device: str = "auto"
         ) -> runtime.RankInfo:
    """Start Horovod, pin this rank to its GPU (if any), give it its share of the cores, and seed it.

    Calls ``hvd.init()``; with a GPU per rank on this host (``device="auto"``, the default) or
    ``device="cuda"``, calls ``torch.cuda.set_device(local_rank)`` (Horovod's documented pattern:
    one GPU per process, NCCL between them); sets ``torch.set_num_threads`` to ``threads`` or
    ``max(1, cores // local_size)``; seeds torch (CPU and CUDA), NumPy and ``random`` with
    ``runtime.rank_seed(seed, rank)`` (rank 0 gets ``seed``; other ranks differ, and
    :func:`distribute` makes their models equal by broadcasting rank 0's). Counts the hosts with
    one all-reduce (every rank must call ``init``; :func:`hvdtrain.runtime.count_hosts`).

    Args:
        seed: base seed; None leaves the random generators as they are (Lightning's
            ``seed_everything`` has seeded them).
        threads: intra-op CPU threads for this rank (default: ``OMP_NUM_THREADS`` when set,
            else its share of the cores; :func:`hvdtrain.runtime.thread_budget`).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (:func:`hvdtrain.runtime.choose_device`).

    Returns:
        The :class:`~hvdtrain.runtime.RankInfo` of this process; ``.device`` is ``"cpu"`` or
        ``"cuda:<local_rank>"``: put the model and batches there (``model.to(info.device)``).

    Raises:
        ValueError: ``device="cuda"`` without a GPU, or fewer GPUs than ranks on this host
            (raised before any collective, on the ranks concerned).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    settings = tuning.rank_settings(on_gpu=device == "cuda" or (device == "auto" and gpus > 0))
    hvd.init()
    settings = tuning.settings_in_effect(settings, hvd.mpi_enabled(), hvd.size())
    where = runtime.choose_device(device, gpus, hvd.local_rank(), hvd.local_size())
    if where != "cpu":
        torch.cuda.set_device(torch.device(where))
    threads = runtime.thread_budget(hvd.local_size()) if threads is None else int(threads)
    torch.set_num_threads(threads)
    if seed is not None:  # None: the random generators as the caller left them
        seed = runtime.rank_seed(seed, hvd.rank())
        torch.manual_seed(seed)  # seeds every CUDA device too
        runtime.seed_python_numpy(seed)
    hosts = runtime.count_hosts(hvd.local_rank(), hvd.cross_size(),
                                lambda values: allreduce_sums(values, name="hvdtrain.hosts"))
    return runtime.remember_rank_info(runtime.RankInfo(
        hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), threads, seed, hosts, where,
        settings))


def rank_info() -> runtime.RankInfo:
    """What :func:`init` returned for this process (rank, sizes, threads, seed, hosts).

    Raises:
        RuntimeError: :func:`init` has not been called.
    """
    return runtime.remembered_rank_info("hvdtrain.torch.init()")


def _broadcast_tensors_(tensors: list[tuple[str, torch.Tensor]], root_rank: int) -> None:
    """Broadcast each tensor from ``root_rank`` in place, all in flight at once (Horovod fuses
    them). Non-contiguous tensors (e.g. ``torch.channels_last``) go through a contiguous copy,
    since Horovod's collectives need contiguous memory."""
    dense_layout_tensors_(tensors, lambda t, n: hvd.broadcast_async_(t, root_rank, name=n))


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    root_rank: int = 0) -> None:
    """Make every rank's model parameters, buffers and optimizer state equal to ``root_rank``'s.

    Tensors are broadcast in place, on their own device, with Horovod's tensor broadcast: the
    model's ``state_dict`` (parameters and buffers) and every optimizer state tensor (momentum
    buffers, Adam moments, step counts). Only the small structure goes as one pickled object
    (``hvd.broadcast_object``): the param groups' options (``lr``, ``betas``, ...) and, per
    parameter, the state entries' names, shapes and dtypes, plus any non-tensor entries. Ranks
    other than ``root_rank`` allocate missing state tensors like their parameter (same device and
    memory format) and update their param-group dicts in place, so an LR scheduler built on the
    optimizer keeps driving the groups the optimizer uses. Host memory beyond the state itself
    stays small whatever the state's size (a whole ``state_dict`` through ``broadcast_object``
    is pickled and copied about three times, and Horovod sends its size as an int32, which
    fails above 2 GiB).

    Horovod's ``broadcast_optimizer_state`` is not used: on an optimizer with no state yet it
    takes a zero-gradient ``step()`` to create the state, which applies weight decay and
    advances Adam's step count, so training no longer matches a single process; and its
    non-tensor state entries are assigned to a copy of the state dict, not to the optimizer.

    Every rank must call this, in the same order relative to other collectives.

    Raises:
        ValueError: the ranks' optimizers hold different numbers of parameters or groups.
    """
    _broadcast_tensors_([(f"hvdtrain.model.{k}", v) for k, v in model.state_dict().items()],
                        root_rank)
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    spec = None
    if hvd.rank() == root_rank:
        spec = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                "state": []}
        for p in params:
            entry = {}
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    entry[key] = ("tensor", tuple(value.shape), str(value.dtype).split(".")[-1],
                                  value.device == p.device)
                else:
                    entry[key] = ("value", value)
            spec["state"].append(entry)
    spec = hvd.broadcast_object(spec, root_rank=root_rank, name="hvdtrain.optimizer_spec")
    if len(spec["groups"]) != len(groups) or len(spec["state"]) != len(params):
        raise ValueError(f"rank {hvd.rank()}'s optimizer has {len(groups)} param groups and "
                         f"{len(params)} parameters, rank {root_rank}'s has "
                         f"{len(spec['groups'])} and {len(spec['state'])}: build the same model "
                         "and optimizer on every rank")
    tensors = []
    for i, (p, entry) in enumerate(zip(params, spec["state"])):
        if hvd.rank() != root_rank:
            state = optimizer.state[p]
            for key in [k for k in state if k not in entry]:
                del state[key]
            for key, (kind, *rest) in entry.items():
                if kind == "value":
                    state[key] = rest[0]
                    continue
                shape, dtype, on_param_device = rest
                dtype = getattr(torch, dtype)
                have = state.get(key)
                if (not torch.is_tensor(have) or tuple(have.shape) != shape
                        or have.dtype != dtype):
                    device = p.device if on_param_device else torch.device("cpu")
                    state[key] = (torch.empty_like(p, dtype=dtype, device=device)
                                  if tuple(p.shape) == shape
                                  else torch.empty(shape, dtype=dtype, device=device))
        state = optimizer.state.get(p, {})
        tensors += [(f"hvdtrain.optimizer.{i}.{key}", state[key])
                    for key, (kind, *_) in entry.items() if kind == "tensor"]
    if hvd.rank() != root_rank:
        for group, options in zip(groups, spec["groups"]):
            for key in [k for k in group if k != "params" and k not in options]:
                del group[key]
            group.update(options)
    _broadcast_tensors_(tensors, root_rank)


def _scale_groups(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Set each group's ``lr`` to its base rate x ``factor`` and record both.

    The base rate is ``group["hvdtrain_base_lr"]`` when the groups come from an hvdtrain
    checkpoint (restored optimizers already hold a scaled, possibly warmed-up rate, which must not
    be scaled again), else the group's ``lr``.

    Raises:
        ValueError: ``factor`` != 1 and an LR scheduler was already built on the optimizer (its
            ``initial_lr`` is unscaled, so it would undo the scaling at its first step).
    """
    for group in optimizer.param_groups:
        if "hvdtrain_base_lr" in group:
            base = group["hvdtrain_base_lr"]
        elif "hvdtrain_lr_scale" in group:  # a checkpoint from before hvdtrain_base_lr existed
            base = group.get("initial_lr", group["lr"]) / group["hvdtrain_lr_scale"]
        elif "initial_lr" in group and factor != 1.0:
            raise ValueError(
                "an LR scheduler was already built on this optimizer (its param groups hold "
                "'initial_lr'), and distribute() is about to scale the learning rate by "
                f"{factor:g}, which that scheduler would undo: build the scheduler after "
                "hvdtrain.torch.distribute() (and pass it to hvdtrain.torch.warmup(..., "
                "scheduler=...) to combine it with the warmup), or use lr_scaling='none'")
        else:
            base = group["lr"]
        if "hvdtrain_base_lr" in group or "hvdtrain_lr_scale" in group:
            group.pop("initial_lr", None)  # schedulers built from here on start at the new rate
        group["lr"] = base * factor
        group["hvdtrain_base_lr"] = base
        group["hvdtrain_lr_scale"] = factor


def horovod_wrapped(optimizer) -> bool:
    """True for an optimizer that ``hvd.DistributedOptimizer`` returned (directly, or through
    :func:`distribute`): Horovod builds its class by copying the methods of its own wrapper
    (not ``step``, which torch.optim re-wraps for its profiler)."""
    method = type(optimizer).__dict__.get("set_backward_passes_per_step")
    return method is not None and method in (
        _hvd_optimizer._DistributedOptimizer.__dict__["set_backward_passes_per_step"],
        _hvd_optimizer._DistributedAdasumOptimizer.__dict__["set_backward_passes_per_step"])


def tensor_prefix(call: int) -> str:
    """The prefix of the parameter names that the ``call``-th :func:`distribute` in a process
    (0-based) gives Horovod: ``"model0."``, ``"model1."`` ..., so that all-reduces are named
    ``allreduce.model1.<parameter name>``. Two models' parameters, both called ``weight``,
    ``bias`` ..., then never share a name in flight (Horovod refuses that: "Requested to
    allreduce ... a tensor with the same name as another tensor that is currently being
    processed"), nor do they with a model wrapped by Horovod's own ``DistributedOptimizer``
    (``allreduce.<parameter name>``). Every rank must call :func:`distribute` for the same models
    in the same order, as for any collective."""
    return f"model{call}."


def distribute(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
               backward_passes_per_step: int = 1, lr_scaling: str | None = None,
               compression: str = "none", op: str = "average", root_rank: int = 0,
               gradient_predivide_factor: float = 1.0, sync_batchnorm: bool = False,
               broadcast: bool = True):
    """Turn a single-process model and optimizer into synchronous data-parallel ones.

    1. Sets each param group's ``lr`` to its base rate x ``schedule.scale_factor(lr_scaling, size,
       k)`` (Goyal et al. 2017 for ``linear``) and records ``hvdtrain_base_lr`` and
       ``hvdtrain_lr_scale`` in the group. The base rate is the group's ``lr``, or, for an
       optimizer restored from an hvdtrain checkpoint, the base rate saved in it: a restored
       optimizer is scaled for this run's world size, never twice.
    2. Wraps ``optimizer`` in ``hvd.DistributedOptimizer`` with ``named_parameters``,
       ``backward_passes_per_step=k``, ``compression`` and ``op``: gradients are all-reduced
       (averaged over ranks) once every k backward passes, at ``optimizer.step()``; gradients in
       any dense memory format (``torch.channels_last`` models) are all-reduced in place as a
       contiguous view of their own memory, their dimensions permuted, and keep their format
       (:class:`~hvdtrain.torch.optimizer.DenseLayout`). Scale each
       micro-batch loss by :class:`MicroBatch` ``.loss_weight`` (see :func:`micro_batches`) so that
       a step is the mean over the global batch of ``local batch x k x size`` samples. The
       wrapper shares the optimizer's param-group dicts (as plain Horovod does), so a scheduler
       built on either object drives the same learning rates.
    3. Keeps the optimizer's existing per-parameter state (Horovod's wrapper alone would start
       with none), then broadcasts parameters, buffers and optimizer state from ``root_rank``
       (:func:`broadcast_state`).

    Several models (a GAN's generator and discriminator, a teacher and a student): call
    ``distribute`` once per model and optimizer, in the same order on every rank; each call's
    gradients are all-reduced under names of their own (:func:`tensor_prefix`).

    Gradients between ``backward()`` and ``step()`` follow DDP's rules (op ``"average"``;
    :mod:`hvdtrain.torch.optimizer`): several backward passes before a step are all summed
    (DCGAN's ``errD_real.backward(); errD_fake.backward()``: each pass past the k-th all-reduces
    again, as under DDP; sum the losses for one all-reduce), and gradients may be zeroed while
    their all-reduce is in flight (``optimizer.zero_grad()``, ``module.zero_grad()``: a GAN's
    discriminator gets gradients in the generator step and zeroes them at its next step; no need
    to freeze it). Changing a gradient in place in that window raises ``RuntimeError`` (e.g.
    ``zero_grad(set_to_none=False)`` on the module, or clipping before
    ``optimizer.synchronize()``).

    With ``op="adasum"`` (Maleki et al. 2020) Horovod's Adasum optimizer combines each rank's
    *update* inside ``step()``; it has no ``synchronize()``/``skip_synchronize()``, so call
    ``optimizer.step()`` alone (and no step can be skipped once its backward ran).

    Args:
        model: the model, shape-agnostic; its parameters must be the optimizer's.
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters, with the single-process
            learning rate (or restored from an hvdtrain checkpoint).
        backward_passes_per_step: k >= 1 micro-batches per optimizer step.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``; None (default): ``"linear"`` with
            ``op="average"``, ``"none"`` with ``op="adasum"`` (Horovod's Adasum guidance).
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16, halving bytes on the
            wire).
        op: ``"average"`` or ``"adasum"``.
        root_rank: rank whose initial state every rank takes.
        gradient_predivide_factor: passed to Horovod (average op only).
        sync_batchnorm: replace the model's BatchNorm layers with ``hvd.SyncBatchNorm``
            (:func:`convert_sync_batchnorm`): batch statistics over the global batch. GPU only
            (Horovod's layer accepts CUDA tensors only). Without it, BatchNorm running
            statistics drift apart across ranks; call :func:`sync_buffers` before evaluating or
            saving.
        broadcast: broadcast parameters, buffers and optimizer state from ``root_rank``
            (default). False for Horovod Elastic, whose ``TorchState.sync()`` broadcasts on every
            rank at the start and at each reset.

    Returns:
        ``(model, optimizer)``: the same model (now equal on all ranks) and the wrapped optimizer,
        which has ``.backward_passes_per_step``.

    Raises:
        ValueError: an unknown ``lr_scaling``/``compression``/``op``, ``"linear"`` with
            ``"adasum"``, k < 1, an optimizer holding parameters that are not the model's (a subset,
            e.g. with frozen layers, is fine),
            a scheduler built before ``distribute`` while the rate is scaled, ``"adasum"`` on a
            number of ranks that is not a power of 2, ``sync_batchnorm=True`` for a model
            not on a GPU, or an optimizer that is already distributed (returned by
            ``distribute`` or ``hvd.DistributedOptimizer``); the message says what to change.
    """
    global _distribute_calls
    if horovod_wrapped(optimizer):
        raise ValueError(
            "this optimizer is already distributed (it came from hvdtrain.torch.distribute() or "
            "hvd.DistributedOptimizer): call distribute() once per model, with the "
            "torch.optim optimizer you built, and train with the optimizer it returns (to "
            "change backward_passes_per_step on it: optimizer.set_backward_passes_per_step(k))")
    check_distribute_args(backward_passes_per_step, compression, op, COMPRESSIONS, OPS)
    size = hvd.size()
    if op == "adasum" and not adasum_takes(size):
        raise ValueError(f"op='adasum' needs a power-of-2 number of ranks (Horovod 0.28.1 "
                         f"supports no other), got {size}; use op='average' or 2, 4, 8 ... ranks")
    lr_scaling = schedule.resolve_lr_scaling(lr_scaling, op)
    factor = schedule.scale_factor(lr_scaling, size, backward_passes_per_step)
    model_params = {id(p) for p in model.parameters()}
    opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if opt_params - model_params:
        raise ValueError("the optimizer holds parameters that are not the model's; build the "
                         "optimizer from model.parameters()")

    if sync_batchnorm:
        on_cpu = [n for n, p in model.named_parameters() if p.device.type != "cuda"]
        if on_cpu:
            raise ValueError(
                "sync_batchnorm=True needs the model on its GPU first (Horovod's SyncBatchNorm "
                f"runs on CUDA tensors only; {on_cpu[0]!r} is on {model.get_parameter(on_cpu[0]).device}): "
                "call model.to(info.device) before distribute(), or on the CPU keep "
                "sync_batchnorm=False and call hvdtrain.torch.sync_buffers(model) before "
                "evaluating and saving")
        convert_sync_batchnorm(model)
    _scale_groups(optimizer, factor)
    prefix = tensor_prefix(_distribute_calls)
    _distribute_calls += 1
    named = [(prefix + n, p) for n, p in model.named_parameters() if id(p) in opt_params]
    wrapped = hvd.DistributedOptimizer(
        optimizer, named_parameters=named,
        compression=DenseLayout(COMPRESSIONS[compression]),
        backward_passes_per_step=backward_passes_per_step, op=OPS[op],
        gradient_predivide_factor=gradient_predivide_factor)
    # Groups added later (add_param_group) take these options: the scaled rate, as the groups
    # above got, and all-reduce names of this call's own (Horovod's patched late parameters).
    wrapped.defaults = {**optimizer.defaults, "hvdtrain_lr_scale": factor}
    if "lr" in optimizer.defaults:
        wrapped.defaults["lr"] = optimizer.defaults["lr"] * factor
    wrapped.late_name_prefix = prefix
    if op == "average":  # Horovod's Adasum optimizer keeps its own rules
        accept_ddp_idioms(wrapped)
    # Horovod builds a new optimizer over the same param-group dicts but with empty
    # per-parameter state (momentum buffers, Adam moments, step counts), e.g. of an optimizer
    # just loaded from a checkpoint: carry it over. (load_state_dict would replace the group
    # dicts with copies and leave a scheduler built on them driving dicts no longer used.)
    for p, state in optimizer.state.items():
        wrapped.state[p] = state
    if broadcast:
        broadcast_state(model, wrapped, root_rank)
    return model, wrapped
