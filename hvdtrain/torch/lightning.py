"""A Horovod strategy for PyTorch Lightning 2.x, built on :func:`hvdtrain.torch.distribute`.

Lightning 1.x had ``Trainer(strategy="horovod")``; Lightning 2.0 removed it. Importing this module
registers the name again, so a LightningModule and its Trainer run under ``horovodrun``,
``mpirun``, ``srun`` or :func:`hvdtrain.spark.run` unchanged::

    import lightning.pytorch as L
    import hvdtrain.torch.lightning  # noqa: F401  (registers strategy="horovod")

    trainer = L.Trainer(strategy="horovod", accelerator="cpu", devices=1, max_epochs=3,
                        accumulate_grad_batches=2)
    trainer.fit(model, train_loader)          # horovodrun -np 2 python train.py

One process per device, as Horovod runs (``devices=1``; on GPUs each rank takes GPU
``local_rank``). The learning rate is the one ``configure_optimizers`` sets, as under Lightning's
DDP strategy; for Goyal et al. (2017)'s linear rule multiply it by ``self.trainer.world_size``
there. Importing this module also gives Lightning's ``rank_zero_only`` helpers the launcher's
rank (Lightning looks for ``RANK`` or ``SLURM_PROCID``, which horovodrun does not set). Needs
``lightning`` (``pip install hvdtrain[lightning]``); ``import hvdtrain.torch`` does not import it.
"""
from __future__ import annotations

import functools
import os
import weakref

import horovod.torch as hvd
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from hvdtrain import runtime
from hvdtrain.accumulation import check_distribute_args
from hvdtrain.torch import adapter
from hvdtrain.torch.adapter import distribute, horovod_wrapped, init

__all__ = ["HorovodEnvironment", "HorovodStrategy", "allgather_by_rank", "metric_sync"]

_REDUCE_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
               "min": hvd.Min}


def _started(device: str = "auto") -> None:
    """Horovod started in this process: :func:`hvdtrain.torch.init` with ``seed=None`` (the
    random generators stay as ``seed_everything`` left them), unless it already ran."""
    if not hvd.is_initialized():
        init(seed=None, device=device)


class HorovodEnvironment(ClusterEnvironment):
    """Lightning's view of a Horovod job: the launcher (horovodrun, mpirun, srun, an engine)
    started the processes; rank, local rank, size and node rank are Horovod's (``hvd.rank()``,
    ``hvd.local_rank()``, ``hvd.size()``, ``hvd.cross_rank()``), which Lightning cannot set."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        """Horovod's rendezvous address, unused by Lightning (Horovod connects the ranks)."""
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """Horovod's rendezvous port, which Lightning does not use (Horovod connects the ranks)."""
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """True in a process a Horovod launcher started (``HOROVOD_RANK`` or Open MPI's rank)."""
        return "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ

    def world_size(self) -> int:
        _started()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher decides the world size."""

    def global_rank(self) -> int:
        _started()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher decides the ranks."""

    def local_rank(self) -> int:
        _started()
        return hvd.local_rank()

    def node_rank(self) -> int:
        _started()
        return hvd.cross_rank()


def _reduce_op(reduce_op) -> str:
    """A Lightning/torch.distributed reduce op (``"mean"``, ``"sum"``, ``ReduceOp.SUM``) as a key
    of :data:`_REDUCE_OPS`."""
    if reduce_op is None:
        return "mean"
    name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    name = name.lower().rsplit(".", 1)[-1]
    if name not in _REDUCE_OPS:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by Horovod's all-reduce: use "
                         f"one of {sorted(_REDUCE_OPS)}")
    return name


def _tell_schedulers_of_steps(optimizer) -> None:
    """torch's LR schedulers learn that the optimizer stepped through a wrapper they put on the
    step of the optimizer they were built with (without it they warn at every run, "Detected
    call of lr_scheduler.step() before optimizer.step()" or "optimizer.step() has been
    overridden"): ``_wrapped_by_lr_sched``, ``_opt_called`` (torch.optim.lr_scheduler
    .LRScheduler). The same wrapper on the distributed optimizer, the one that steps now."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)
    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


class HorovodStrategy(ParallelStrategy):
    """Synchronous data-parallel training with Horovod's ring all-reduce (``strategy="horovod"``).

    At ``fit``: the model goes to this rank's device, each optimizer is wrapped by
    :func:`hvdtrain.torch.distribute` (``backward_passes_per_step`` = the Trainer's
    ``accumulate_grad_batches``, ``lr_scaling="none"``), and rank 0's parameters, buffers and
    optimizer state are broadcast to every rank. Each optimizer step runs Lightning's closure
    (forward and backward), waits for the all-reduce (``optimizer.synchronize()``), then lets the
    precision plugin unscale, clip and step: gradient clipping and AMP's ``GradScaler`` see the
    averaged gradients. ``self.log(..., sync_dist=True)``, ``self.all_gather``, the Trainer's
    barriers and broadcasts, and ``DistributedSampler`` (``num_replicas=size``, ``rank``) use
    Horovod.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as Lightning's strategies
            (the Trainer fills them).
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16).
        gradient_predivide_factor: passed to Horovod.

    Horovod's Adasum is not offered here: it applies the update in the backward hooks, where
    Lightning's clipping and AMP's unscale cannot act.

    Raises:
        ValueError: at once, an unknown ``compression``; at ``fit``, before any hook of the
            module runs, a ``GradientAccumulationScheduler`` callback (Horovod's
            ``backward_passes_per_step`` is fixed: use ``Trainer(accumulate_grad_batches=k)``);
            a second ``fit`` of the same module in one process (Horovod's hooks stay on its
            parameters); what :func:`hvdtrain.torch.distribute` refuses; a reduce op Horovod
            has not.
    """

    strategy_name = "horovod"

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None,
                 precision_plugin=None, *, compression: str = "none",
                 gradient_predivide_factor: float = 1.0):
        check_distribute_args(1, compression, "average", adapter.COMPRESSIONS, adapter.OPS)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=HorovodEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._distribute_args = dict(compression=compression,
                                     gradient_predivide_factor=gradient_predivide_factor)

    def _device_kind(self) -> str:
        devices = self.parallel_devices or [torch.device("cpu")]
        return "cuda" if devices[0].type == "cuda" else "cpu"

    def set_world_ranks(self) -> None:
        """Start Horovod (the Trainer calls this once it knows the accelerator) and tell
        Lightning's ``rank_zero_only`` helpers this process's rank."""
        _started(self._device_kind())
        rank_zero_only.rank = fabric_rank_zero_only.rank = hvd.rank()

    @property
    def root_device(self) -> torch.device:
        if self._device_kind() == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def optimizers(self) -> list:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list) -> None:
        # Lightning's LightningOptimizer is an instance of a subclass of the optimizer's class:
        # Horovod's methods (super(self.__class__, self)) would call themselves forever on it,
        # and hvdtrain's zero_grad and synchronize are the optimizer instance's own. Each time
        # Lightning makes its wrappers (here), they get the distributed optimizer's methods.
        ParallelStrategy.optimizers.fset(self, optimizers)
        for facade, optimizer in zip(self._lightning_optimizers, optimizers):
            for name in ("zero_grad", "synchronize", "skip_synchronize",
                         "set_backward_passes_per_step"):
                if horovod_wrapped(optimizer) and hasattr(optimizer, name):
                    setattr(facade, name, getattr(optimizer, name))

    def setup_environment(self) -> None:
        _started(self._device_kind())
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and any(isinstance(c, GradientAccumulationScheduler)
                                       for c in trainer.callbacks):
            raise ValueError("strategy='horovod' takes a fixed accumulation: replace the "
                             "GradientAccumulationScheduler callback with "
                             "Trainer(accumulate_grad_batches=k)")
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer) -> None:
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and module in _FITTED:
            raise ValueError(
                "this LightningModule was already trained with strategy='horovod' in this "
                "process, and Horovod's gradient hooks stay on its parameters (a second fit "
                "would all-reduce every gradient twice): fit a new module, e.g. one loaded with "
                "this one's state_dict() or a checkpoint (trainer.fit(model, ckpt_path=...))")
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        k, wrapped = trainer.accumulate_grad_batches, []
        for optimizer in self.optimizers:
            if type(optimizer).__name__ == "_MockOptimizer":  # configure_optimizers gave none
                wrapped.append(optimizer)
                continue
            _, distributed = distribute(module, optimizer, backward_passes_per_step=k,
                                        lr_scaling="none", **self._distribute_args)
            _keep_param_groups_on_load(distributed)
            for config in self.lr_scheduler_configs:  # the wrapper shares the param groups
                if getattr(config.scheduler, "optimizer", None) is optimizer:
                    config.scheduler.optimizer = distributed
                    _tell_schedulers_of_steps(distributed)
            wrapped.append(distributed)
        _FITTED.add(module)
        self.optimizers = wrapped

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's closure (forward, backward) and the all-reduce's end first, then the
        precision plugin's step (unscale, clip, ``optimizer.step()`` without a second
        synchronize)."""
        if not horovod_wrapped(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize():
            result = closure()
            optimizer.synchronize()
            return result
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """All-reduce ``tensor`` (any shape) over the ranks: ``"mean"`` (default), ``"sum"``,
        ``"max"`` or ``"min"``; an integer mean comes back as float64. Anything but a tensor is
        returned as it is (as Lightning's DDP strategy does)."""
        if group is not None:
            raise ValueError("strategy='horovod' reduces over all ranks: group must be None")
        name = _reduce_op(reduce_op)
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if name in ("mean", "avg") and not tensor.is_floating_point():
            tensor = tensor.double()
        return hvd.allreduce(tensor, op=_REDUCE_OPS[name])

    def all_gather(self, tensor: torch.Tensor, group=None, sync_grads: bool = False):
        """Every rank's ``tensor`` stacked: shape ``(size, *tensor.shape)``. With ``sync_grads``
        the gradient flows back summed over the ranks, as torch.distributed's all_gather does
        (Horovod's own averages it)."""
        if group is not None:
            raise ValueError("strategy='horovod' gathers from all ranks: group must be None")
        if not sync_grads:
            with torch.no_grad():
                return hvd.allgather(tensor.contiguous().unsqueeze(0))
        gathered = hvd.allgather(tensor.contiguous().unsqueeze(0))
        return _GradientTimes.apply(gathered, float(hvd.size()))

    def barrier(self, name: str | None = None) -> None:
        if hvd.is_initialized():
            hvd.barrier()

    def broadcast(self, obj, src: int = 0):
        """``obj`` (any picklable object) from rank ``src`` to every rank."""
        return hvd.broadcast_object(obj, root_rank=src)


_FITTED: "weakref.WeakSet" = weakref.WeakSet()  # modules whose parameters carry Horovod's hooks


def _keep_param_groups_on_load(optimizer) -> None:
    """``load_state_dict`` (Lightning's resume) puts the saved groups' values into the existing
    param-group dicts instead of new ones: the optimizer ``distribute`` wrapped and every
    scheduler built on it (a ``SequentialLR``'s own schedulers too) share those dicts, and would
    otherwise drive groups the wrapper no longer uses."""
    load = optimizer.load_state_dict

    def load_state_dict(state_dict):
        groups = optimizer.param_groups
        load(state_dict)
        for old, new in zip(groups, optimizer.param_groups):
            old.clear()
            old.update(new)
        optimizer.param_groups = groups
    optimizer.load_state_dict = load_state_dict


class _GradientTimes(torch.autograd.Function):
    """The identity forward; the gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def allgather_by_rank(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` as a list by rank, the first dimension free to differ between
    ranks (other dimensions equal): torchmetrics' ``dist_sync_fn`` over Horovod.

    Raises:
        ValueError: a ``group`` (Horovod gathers from all ranks here).
    """
    if group is not None:
        raise ValueError("allgather_by_rank gathers from all ranks: group must be None")
    tensor = tensor.contiguous()
    scalar = tensor.dim() == 0
    rows = tensor.reshape(1) if scalar else tensor
    counts = hvd.allgather(torch.tensor([rows.shape[0]])).tolist()
    parts = list(hvd.allgather(rows).split(counts))
    return [p.reshape(()) for p in parts] if scalar else parts


def metric_sync() -> dict:
    """Keyword arguments that make a torchmetrics ``Metric`` synchronise its state over the
    Horovod ranks (it uses ``torch.distributed``, which a Horovod job does not start).

    Example::

        accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10, **metric_sync())

    Returns:
        ``{"dist_sync_fn": allgather_by_rank, "distributed_available_fn": ...}`` (the latter
        true with more than one rank).
    """
    return {"dist_sync_fn": allgather_by_rank, "distributed_available_fn": _several_ranks}


def _several_ranks() -> bool:
    """More than one Horovod rank (a function of the module: metrics stay picklable)."""
    return hvd.is_initialized() and hvd.size() > 1


# Lightning's rank_zero_only helpers read RANK, SLURM_PROCID, ... when Lightning is imported,
# none of which horovodrun sets: until Horovod starts, the launcher's rank, so that what Lightning
# prints while the Trainer is made comes from rank 0 only.
rank_zero_only.rank = fabric_rank_zero_only.rank = runtime.launcher_rank()
if "horovod" not in StrategyRegistry:
    StrategyRegistry.register("horovod", HorovodStrategy,
                              description="hvdtrain's Horovod strategy (ring all-reduce)")
