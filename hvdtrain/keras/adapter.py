"""The Keras adapter, for Keras 3 on its TensorFlow and PyTorch backends: a distributed optimizer
(one grouped all-reduce per optimizer step), rank-0 broadcast, LR scaling with warmup, and
accumulation of k micro-batches. Same concepts and names as :mod:`hvdtrain.torch`.

Horovod's own Keras layer (``horovod.tensorflow.keras``) was written for Keras 2 optimizers and
the TensorFlow backend (hvdtrain's Horovod build makes it all-reduce on Keras 3: patch 15); this
adapter is built on Horovod's collectives instead (:mod:`hvdtrain.keras.collectives`:
``horovod.tensorflow`` under ``KERAS_BACKEND=tensorflow``, ``horovod.torch`` under
``KERAS_BACKEND=torch``), so the same code runs on both backends.

Typical use (launched with ``horovodrun -np 2 python train.py``)::

    import keras
    import hvdtrain.keras as hk

    info = hk.init(seed=42)
    data = hk.shard_dataset(x, y, batch_size=16, seed=42, backward_passes_per_step=4)
    model = make_model(); model.build((None, 8, 8, 1))
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    model, optimizer = hk.distribute(model, optimizer, backward_passes_per_step=4)
    model.compile(optimizer=optimizer, loss=..., metrics=["accuracy"], jit_compile=False)
    model.fit(data, epochs=10, steps_per_epoch=data.steps_per_epoch,
              callbacks=hk.callbacks(optimizer, warmup_epochs=2,
                                     steps_per_epoch=data.steps_per_epoch // 4),
              verbose=1 if info.is_root else 0)
"""
from __future__ import annotations

import logging
import os

import keras
from keras import ops

from hvdtrain import runtime, schedule
from hvdtrain.launch import tuning
from hvdtrain.accumulation import check_distribute_args
from hvdtrain.keras import collectives as B
from hvdtrain.keras import xla
# Also importable from here (the trainers call adapter.allreduce_sums, ...).
from hvdtrain.keras.collectives import allreduce_sums, ranks_where  # noqa: F401
from hvdtrain.keras.optimizer import (GradientAllreduce, LossScaleHooks, NonFiniteGuard,
                                      inner, micro_batch_count,  # noqa: F401
                                      set_micro_batch_count, settable_learning_rate)
from hvdtrain.keras.scheduler import WarmupSchedule
from hvdtrain.keras.sharding import sharded_fit_defaults

OPS = {"average": "average"}
NONFINITE_MODES = ("skip", "stop")
log = logging.getLogger("hvdtrain")


def backend() -> str:
    """The Keras backend this process runs: ``"tensorflow"`` or ``"torch"`` (``KERAS_BACKEND``,
    read once at ``import keras``)."""
    return B.NAME


# ---- process set-up -------------------------------------------------------------------------

def init(seed: int | None = 42, threads: int | None = None, device: str = "auto"
         ) -> runtime.RankInfo:
    """Start Horovod for the Keras backend, pin this rank to its GPU (if any), give it its share
    of the cores, and seed it.

    TensorFlow backend: ``horovod.tensorflow.init()``; with a GPU per rank on this host
    (``device="auto"``) or ``device="cuda"``, only GPU ``local_rank`` is visible to TensorFlow,
    with memory growth (Horovod's documented pattern; ``"cpu"`` hides the GPUs); intra-op threads
    ``threads`` or ``max(1, cores // local_size)``, and as many inter-op threads. PyTorch backend:
    ``horovod.torch.init()``, ``torch.cuda.set_device(local_rank)`` for a GPU,
    ``torch.set_num_threads``. Both: ``keras.utils.set_random_seed(runtime.rank_seed(seed,
    rank))`` (Python, NumPy and the backend; rank 0 gets ``seed``, :func:`distribute` makes all
    models equal to rank 0's), and the hosts are counted with one all-reduce (every rank must
    call ``init``). Call it before the backend runs anything.

    Args:
        seed: base seed; None leaves the random generators as they are.
        threads: intra-op CPU threads for this rank, and on TensorFlow as many inter-op
            threads (default: ``OMP_NUM_THREADS`` when set, else its share of the cores;
            :func:`hvdtrain.runtime.thread_budget`).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (:func:`hvdtrain.runtime.choose_device`).

    Returns:
        The :class:`~hvdtrain.runtime.RankInfo` of this process (``.device``: ``"cpu"`` or
        ``"cuda:<local_rank>"``).

    Raises:
        ValueError: ``device="cuda"`` without a GPU, or fewer GPUs than ranks on this host;
            on Keras's PyTorch backend, Keras putting tensors on another device than the
            rank's (it chose when imported: ``KERAS_TORCH_DEVICE``, else a visible GPU).
    """
    hvd = B.hvd
    if B.NAME == "tensorflow":
        gpu_count = len(B.tf.config.list_physical_devices("GPU"))
    else:
        gpu_count = B.torch.cuda.device_count() if B.torch.cuda.is_available() else 0
    settings = tuning.rank_settings(on_gpu=device == "cuda" or (device == "auto" and gpu_count > 0))
    hvd.init()
    settings = tuning.settings_in_effect(settings, hvd.mpi_enabled(), hvd.size())
    threads = runtime.thread_budget(hvd.local_size()) if threads is None else int(threads)
    if B.NAME == "tensorflow":
        tf = B.tf
        gpus = tf.config.list_physical_devices("GPU")
        where = runtime.choose_device(device, len(gpus), hvd.local_rank(), hvd.local_size())
        try:
            if where != "cpu":
                gpu = gpus[hvd.local_rank()]
                tf.config.experimental.set_memory_growth(gpu, True)
                tf.config.set_visible_devices(gpu, "GPU")
            elif gpus:
                tf.config.set_visible_devices([], "GPU")
        except RuntimeError as exc:  # TensorFlow's runtime already started
            log.warning("GPU visibility could not be set (%s): call hvdtrain.keras.init() before "
                        "TensorFlow runs anything", exc)
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            # Inter-op threads = the same share: at one rank per host 2 (TensorFlow's default,
            # the cores), 10 % faster than 1 on the gpt here; at 2 ranks on 2 cores 1 (2 were
            # 7-15 % slower: 4 busy threads on 2 cores).
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # already started: threads can no longer change
            threads = tf.config.threading.get_intra_op_parallelism_threads() or threads
    else:
        torch = B.torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        where = runtime.choose_device(device, count, hvd.local_rank(), hvd.local_size())
        if where != "cpu":
            torch.cuda.set_device(hvd.local_rank())
        _check_keras_torch_device(where)
        torch.set_num_threads(threads)
    if seed is not None:  # None: the random generators as the caller left them
        seed = runtime.rank_seed(seed, hvd.rank())
        keras.utils.set_random_seed(seed)
    hosts = runtime.count_hosts(hvd.local_rank(), hvd.cross_size(),
                                lambda values: allreduce_sums(values, name="hvdtrain.hosts"))
    return runtime.remember_rank_info(runtime.RankInfo(
        hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), threads, seed, hosts, where,
        settings))


def _check_keras_torch_device(where: str) -> None:
    """Keras's PyTorch backend chooses its device when ``keras`` is imported
    (``KERAS_TORCH_DEVICE``, else a visible GPU; :func:`hvdtrain.runtime.use_keras_torch_device`),
    before :func:`init` runs: a rank meant for ``where`` whose Keras
    puts tensors elsewhere would compute there (on a GPU host, a CPU rank on the GPU).

    Raises:
        ValueError: Keras puts new tensors on another device than ``where``.
    """
    placed = B.torch.device(keras.ops.zeros(()).device)  # "cuda" is the current device here
    wanted = B.torch.device(where)
    if placed != wanted:
        hide = ", or hide the GPUs with CUDA_VISIBLE_DEVICES=''" if wanted.type == "cpu" else ""
        raise ValueError(
            f"this rank computes on {where}, but Keras's PyTorch backend puts tensors on "
            f"{placed} (chosen when keras was imported: KERAS_TORCH_DEVICE="
            f"{os.environ.get('KERAS_TORCH_DEVICE', '(unset)')}, else a visible GPU); set "
            f"KERAS_TORCH_DEVICE={wanted.type} before importing keras (hvdtrain train does it "
            f"for --device){hide}")


def rank_info() -> runtime.RankInfo:
    """What :func:`init` returned for this process (rank, sizes, threads, seed, hosts).

    Raises:
        RuntimeError: :func:`init` has not been called.
    """
    return runtime.remembered_rank_info("hvdtrain.keras.init()")


# ---- model state ----------------------------------------------------------------------------


def _require_built(model: keras.Model) -> None:
    if not model.built or not model.weights:
        raise ValueError("the model has no weights yet: build it first, e.g. "
                         "model.build((None, 8, 8, 1)) or call it on one batch, then distribute")


def _is_float(var) -> bool:
    return "float" in str(var.dtype)


def _is_seed_state(var) -> bool:
    """A ``keras.random.SeedGenerator``'s state (Dropout, augmentation layers): per-rank
    randomness that :func:`init` seeded differently on each rank, so never broadcast or
    averaged (equal states would give every rank the same dropout masks)."""
    return "seed_generator_state" in str(getattr(var, "path", var.name))


def sync_buffers(model: keras.Model, op: str = "average", root_rank: int = 0) -> int:
    """Make the model's non-trainable variables (BatchNormalization ``moving_mean``/
    ``moving_variance``, any other non-trainable state) equal on every rank, in place.

    The Keras counterpart of :func:`hvdtrain.torch.sync_buffers`, with the same rule:
    ``"average"`` (default) sets floating-point variables to their mean over ranks (each rank's
    moving statistics estimate its own shard; the mean uses every shard's data) in one grouped
    all-reduce and takes integer ones from ``root_rank``; ``"broadcast"`` copies all of them from
    ``root_rank`` (as PyTorch DDP does with buffers). Trainable weights are not touched (the
    all-reduced gradients keep them equal). Every rank must call it at the same point;
    :class:`SyncBuffersCallback` does so at each epoch's end.

    Returns:
        The number of variables synchronised.

    Raises:
        ValueError: an unknown ``op``, or the model is not built.
    """
    runtime.check_buffer_sync_op(op)
    _require_built(model)
    variables = [v for v in model.non_trainable_variables if not _is_seed_state(v)]
    if B.hvd.size() == 1 or not variables:
        return len(variables)
    averaged = [v for v in variables if op == "average" and _is_float(v)]
    copied = [v for v in variables if not (op == "average" and _is_float(v))]
    if averaged:
        means = B.grouped_average([B.native(v) for v in averaged], name="hvdtrain.buffers")
        for v, mean in zip(averaged, means):
            v.assign(mean)
    if copied:
        B.broadcast_variables(copied, root_rank, "hvdtrain.buffers.root")
    return len(variables)


def broadcast_state(model: keras.Model, optimizer: keras.optimizers.Optimizer,
                    root_rank: int = 0) -> None:
    """Make every rank's model variables (trainable and not) and optimizer variables (step
    counters, momentum/moment slots, accumulators, loss scale) equal to ``root_rank``'s, before
    the first step. Random-number generator states of the model's layers (Dropout's
    ``SeedGenerator``) stay per rank.

    The optimizer is built on the model's trainable variables first (so its slots exist), then
    every variable goes through Horovod's broadcast, in order.

    Raises:
        ValueError: the model is not built yet.
    """
    _require_built(model)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    model_state = [v for v in model.variables if not _is_seed_state(v)]
    B.broadcast_variables(model_state + list(optimizer.variables), root_rank, "hvdtrain.state")


def _can_overlap(model, owner, optimizer, k: int) -> bool:
    """Whether the gradients' all-reduces may start during backward
    (:mod:`hvdtrain.keras.overlap`): one backward pass per step, no loss-scale optimizer, and
    nothing in Keras's ``apply`` that reads the gradients before ``_clip_gradients`` (a
    ``loss_scale_factor`` divides them, a variable with ``overwrite_with_gradient`` takes its
    gradient as its value): those would read a gradient while its all-reduce writes it."""
    return (k == 1 and owner is optimizer and owner.loss_scale_factor is None
            and not any(getattr(v, "overwrite_with_gradient", False)
                        for v in model.trainable_variables))


def distribute(model: keras.Model, optimizer: keras.optimizers.Optimizer, *,
               backward_passes_per_step: int = 1, lr_scaling: str | None = None,
               compression: str = "none", op: str = "average", root_rank: int = 0,
               gradient_predivide_factor: float = 1.0, broadcast: bool = True,
               on_nonfinite: str | None = None):
    """Turn a single-process Keras 3 model and optimizer into synchronous data-parallel ones.

    1. Accumulation: with k = ``backward_passes_per_step`` > 1 the optimizer gets Keras's own
       ``gradient_accumulation_steps=k``: each micro-batch's gradients are added up locally and
       every k-th micro-batch applies their mean, so the all-reduce below runs once per k
       micro-batches. ``optimizer.iterations`` counts optimizer steps (Keras 3's meaning); the
       micro-batch count is ``optimizer.iterations * k`` plus the micro-batches of an unfinished
       group. Give ``fit`` a whole number of groups per epoch (:func:`shard_dataset` does), or
       the last group of an epoch is carried into the next one.
    2. All-reduce: the optimizer's gradients go through one grouped all-reduce per step (average
       over ranks, optional fp16 compression; :class:`GradientAllreduce`), before clipping, weight decay
       and the update. A ``LossScaleOptimizer`` (fp16) keeps its loss scale equal on every rank:
       its overflow check is all-reduced (one ``size + 1``-float all-reduce per micro-batch),
       and overflows are counted apart from non-finite losses (:class:`LossScaleHooks`,
       ``optimizer.hvdtrain_loss_scale.overflows``).
    3. Learning rate: the optimizer's rate (a float or a ``LearningRateSchedule``) becomes a
       :class:`WarmupSchedule` multiplied by ``schedule.scale_factor(lr_scaling, size, k)``
       (Goyal et al. 2017 for ``linear``); ``optimizer.hvdtrain_lr_scale`` holds the factor
       distribute applied (elastic resets change the schedule's ``scale`` variable later).
    4. Broadcast: the optimizer is built and model and optimizer variables are broadcast from
       ``root_rank`` (:func:`broadcast_state`).
    5. With ``on_nonfinite="skip"`` or ``"stop"``: non-finite gradients on any rank skip that
       optimizer step on every rank (:class:`NonFiniteGuard`); ``"stop"`` then ends ``fit``
       with :class:`~hvdtrain.runtime.NonFiniteLossError` (raised by the callback that
       :func:`callbacks` adds).

    Compile the model with the returned optimizer, with any ``jit_compile``: on the TensorFlow
    backend ``jit_compile=True`` XLA-compiles the forward and backward pass and keeps the
    all-reduce outside the XLA cluster (Horovod's operations have no XLA kernels;
    :func:`hvdtrain.keras.xla.split_train_step`); ``"auto"``, Keras's default, is Keras's own
    choice (no XLA on a CPU-only host; the same split where it picks XLA). Embedding
    gradients (``tf.IndexedSlices``) are all-reduced dense (Horovod's ``sparse_as_dense``).

    Args:
        model: a built ``keras.Model``.
        optimizer: a Keras 3 optimizer, or a ``keras.optimizers.LossScaleOptimizer`` around one;
            not yet built when k > 1 (unless created with ``gradient_accumulation_steps=k``).
        backward_passes_per_step: k >= 1 micro-batches per optimizer step.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``; None (default): ``"linear"``.
        compression: ``"none"`` or ``"fp16"``.
        op: ``"average"``.
        root_rank: rank whose initial state every rank takes.
        gradient_predivide_factor: as Horovod's (divide before the sum, the rest after).
        on_nonfinite: ``None`` (no check), ``"skip"`` or ``"stop"``.
        broadcast: broadcast the model and optimizer from ``root_rank`` (default). False for
            Horovod Elastic, whose state's ``sync()`` broadcasts on every rank at the start and
            at each reset (a worker that joins later must not start a broadcast of its own); the
            non-finite guard then sends one flag per rank instead of a vector as long as the
            size, which changes at a reset.

    Returns:
        ``(model, optimizer)``: the same model (now equal on all ranks) and the same optimizer
        object, now distributed, with ``.backward_passes_per_step`` and ``.hvdtrain_lr_scale``.

    Raises:
        ValueError: unknown ``lr_scaling``/``compression``/``op``/``on_nonfinite``, k < 1, an
            unbuilt model, a ``mixed_float16`` model without a ``LossScaleOptimizer``, one with
            ``compression="fp16"``, an optimizer distributed twice, a model compiled with another
            optimizer, an optimizer built already without accumulation
            when k > 1, or created with another ``gradient_accumulation_steps``, or a
            learning rate that is a plain callable.
    """
    check_distribute_args(backward_passes_per_step, compression, op, B.COMPRESSIONS, OPS)
    if on_nonfinite is not None and on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be None, 'skip' or 'stop'; got {on_nonfinite!r}")
    _require_built(model)
    k = int(backward_passes_per_step)
    owner = inner(optimizer)
    if owner is optimizer and str(getattr(model.dtype_policy, "name", "")) == "mixed_float16":
        raise ValueError("the model computes in mixed_float16: wrap the optimizer in "
                         "keras.optimizers.LossScaleOptimizer before distribute(), or compile() "
                         "would add one whose overflow check is per rank (ranks would hang)")
    if owner is not optimizer and compression == "fp16":
        raise ValueError("compression='fp16' with a LossScaleOptimizer would all-reduce the "
                         "unscaled gradients in float16, where small ones underflow; use "
                         "compression='none'")
    if getattr(optimizer, "hvdtrain_lr_scale", None) is not None:
        raise ValueError("this optimizer is distributed already; give distribute() a new one")
    if getattr(model, "compiled", False) and getattr(model, "optimizer", None) is not None \
            and model.optimizer is not optimizer:
        raise ValueError("the model was compiled with another optimizer, which would train "
                         "without any all-reduce: compile (again) with the optimizer that "
                         "distribute() returns")
    want = k if k > 1 else None
    have = owner.gradient_accumulation_steps or None
    if have != want:
        if have is not None:
            raise ValueError(f"the optimizer was created with gradient_accumulation_steps={have}"
                             f" but backward_passes_per_step is {k}: leave "
                             "gradient_accumulation_steps out (distribute sets it)")
        if owner.built:
            raise ValueError("with backward_passes_per_step > 1 the optimizer must not be built "
                             "yet (its gradient accumulators are made when it is built): pass a "
                             "new optimizer, distribute() builds it")
        owner.gradient_accumulation_steps = want
    base = owner._learning_rate
    if isinstance(base, WarmupSchedule):  # saved by a distributed run and loaded (load_model)
        base = base.base
    if isinstance(base, keras.Variable):
        base = float(ops.convert_to_numpy(base))
    elif not isinstance(base, (float, keras.optimizers.schedules.LearningRateSchedule)):
        raise ValueError("the optimizer's learning_rate must be a float or a keras "
                         "LearningRateSchedule (hvdtrain composes it with the scaling and warmup)")
    lr_scaling = schedule.resolve_lr_scaling(lr_scaling, op)
    factor = schedule.scale_factor(lr_scaling, B.hvd.size(), k)
    owner.learning_rate = WarmupSchedule(base, factor, k)
    settable_learning_rate(owner)  # Keras's LR callbacks set a float
    guard = (NonFiniteGuard(on_nonfinite, B.hvd.size() if broadcast else None)
             if on_nonfinite else None)
    # Under a loss-scale optimizer only finite gradients reach the inner optimizer: the global
    # check happens before it (LossScaleHooks), which also feeds the guard.
    hooks = GradientAllreduce(owner, compression, float(gradient_predivide_factor),
                       guard if owner is optimizer else None, B.hvd.rank(), B.hvd.size(),
                       elastic=not broadcast, overlap=_can_overlap(model, owner, optimizer, k))
    if owner is not optimizer:
        optimizer.hvdtrain_loss_scale = LossScaleHooks(optimizer, guard, B.hvd.rank(),
                                                        B.hvd.size())
    if broadcast:
        broadcast_state(model, optimizer, root_rank)
    elif not optimizer.built:
        optimizer.build(model.trainable_variables)
    if hooks.overlap is not None:  # every rank's first step arms them too (elastic newcomers)
        hooks.overlap.register(owner._trainable_variables)
    optimizer.hvdtrain_lr_scale = factor
    optimizer.backward_passes_per_step = k
    optimizer.hvdtrain_allreduce = hooks
    if guard is not None:
        optimizer.hvdtrain_nonfinite = guard
    if B.NAME == "tensorflow":
        xla.split_train_step(model)
    # A model that already ran fit/evaluate keeps its compiled functions, traced before the
    # all-reduce existed (TensorFlow backend): the next fit would train without it.
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    sharded_fit_defaults(model)
    return model, optimizer


os.environ.setdefault("KERAS_BACKEND", B.NAME)  # child processes get the same backend
