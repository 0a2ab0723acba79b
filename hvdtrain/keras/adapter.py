"""The Keras adapter, for Keras 3 on its TensorFlow and PyTorch backends: a distributed optimizer
(one grouped all-reduce per optimizer step), rank-0 broadcast, LR scaling with warmup, and
accumulation of k micro-batches. Same concepts and names as :mod:`hvdtrain.torch`.

Horovod's own Keras layer (``horovod.tensorflow.keras``) is written for Keras 2 optimizers; this
adapter is built on Horovod's collectives instead (:mod:`hvdtrain.keras._backend`:
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
import numpy as np
from keras import ops

from hvdtrain import runtime, schedule
from hvdtrain.accumulation import check_distribute_args
from hvdtrain.keras import _backend as B

_OPS = {"average": "average"}
NONFINITE_MODES = ("skip", "stop")
log = logging.getLogger("hvdtrain")


def backend() -> str:
    """The Keras backend this process runs: ``"tensorflow"`` or ``"torch"`` (``KERAS_BACKEND``,
    read once at ``import keras``)."""
    return B.NAME


# ---- process set-up -------------------------------------------------------------------------

def init(seed: int = 42, threads: int | None = None, device: str = "auto") -> runtime.RankInfo:
    """Start Horovod for the Keras backend, pin this rank to its GPU (if any), give it its share
    of the cores, and seed it.

    TensorFlow backend: ``horovod.tensorflow.init()``; with a GPU per rank on this host
    (``device="auto"``) or ``device="cuda"``, only GPU ``local_rank`` is visible to TensorFlow,
    with memory growth (Horovod's documented pattern; ``"cpu"`` hides the GPUs); intra-op threads
    ``threads`` or ``max(1, cores // local_size)``, inter-op threads 1. PyTorch backend:
    ``horovod.torch.init()``, ``torch.cuda.set_device(local_rank)`` for a GPU,
    ``torch.set_num_threads``. Both: ``keras.utils.set_random_seed(runtime.rank_seed(seed,
    rank))`` (Python, NumPy and the backend; rank 0 gets ``seed``, :func:`distribute` makes all
    models equal to rank 0's), and the hosts are counted with one all-reduce (every rank must
    call ``init``). Call it before the backend runs anything.

    Args:
        seed: base seed.
        threads: intra-op CPU threads for this rank (default: its share of the cores).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (:func:`hvdtrain.runtime.choose_device`).

    Returns:
        The :class:`~hvdtrain.runtime.RankInfo` of this process (``.device``: ``"cpu"`` or
        ``"cuda:<local_rank>"``).

    Raises:
        ValueError: ``device="cuda"`` without a GPU, or fewer GPUs than ranks on this host.
    """
    hvd = B.hvd
    hvd.init()
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
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # already started: threads can no longer change
            threads = tf.config.threading.get_intra_op_parallelism_threads() or threads
    else:
        torch = B.torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        where = runtime.choose_device(device, count, hvd.local_rank(), hvd.local_size())
        if where != "cpu":
            torch.cuda.set_device(hvd.local_rank())
        torch.set_num_threads(threads)
    seed = runtime.rank_seed(seed, hvd.rank())
    keras.utils.set_random_seed(seed)
    hosts = runtime.count_hosts(hvd.local_rank(), hvd.cross_size(),
                                lambda values: allreduce_sums(values, name="hvdtrain.hosts"))
    return runtime.remember_rank_info(runtime.RankInfo(
        hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), threads, seed, hosts, where))


def rank_info() -> runtime.RankInfo:
    """What :func:`init` returned for this process (rank, sizes, threads, seed, hosts).

    Raises:
        RuntimeError: :func:`init` has not been called.
    """
    return runtime.remembered_rank_info("hvdtrain.keras.init()")


def allreduce_sums(values: dict[str, float], name: str = "hvdtrain.metrics") -> dict[str, float]:
    """Sum scalar values over all ranks, in float64, in one all-reduce (eager).

    Every rank must pass the same keys (sorted before the all-reduce).

    Returns:
        ``{key: global sum}``.
    """
    keys = sorted(values)
    summed = B.allreduce_numpy(np.array([float(values[k]) for k in keys], np.float64), "sum",
                               name)
    return dict(zip(keys, summed.tolist()))


def ranks_where(flag: bool, name: str = "hvdtrain.flag") -> list[int]:
    """The ranks on which ``flag`` is true, known to every rank after one all-reduce (a vector of
    ``size`` numbers). Every rank must call it at the same point.

    Returns:
        Sorted ranks (empty when the flag is false everywhere).
    """
    return runtime.ranks_where(flag, B.hvd.rank(), B.hvd.size(),
                               lambda values: allreduce_sums(values, name=name))


# ---- model state ----------------------------------------------------------------------------

def _require_built(model: keras.Model) -> None:
    if not model.built or not model.weights:
        raise ValueError("the model has no weights yet: build it first, e.g. "
                         "model.build((None, 8, 8, 1)) or call it on one batch, then distribute")


def _is_float(var) -> bool:
    return "float" in str(var.dtype)


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
    variables = list(model.non_trainable_variables)
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


class SyncBuffersCallback(keras.callbacks.Callback):
    """:func:`sync_buffers` on the model at the end of every epoch (before evaluation and
    checkpoints made by later callbacks), so all ranks hold the same BatchNormalization
    statistics."""

    def __init__(self, op: str = "average"):
        super().__init__()
        runtime.check_buffer_sync_op(op)
        self.op = op

    def on_epoch_end(self, epoch, logs=None):
        sync_buffers(self.model, self.op)


def _inner(optimizer):
    """The optimizer that owns the learning rate and the slots (a ``LossScaleOptimizer``'s
    ``inner_optimizer``, else the optimizer itself)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def broadcast_state(model: keras.Model, optimizer: keras.optimizers.Optimizer,
                    root_rank: int = 0) -> None:
    """Make every rank's model variables (trainable and not) and optimizer variables (step
    counters, momentum/moment slots, accumulators, loss scale) equal to ``root_rank``'s, before
    the first step.

    The optimizer is built on the model's trainable variables first (so its slots exist), then
    every variable goes through Horovod's broadcast, in order.

    Raises:
        ValueError: the model is not built yet.
    """
    _require_built(model)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    B.broadcast_variables(list(model.variables) + list(optimizer.variables), root_rank,
                          "hvdtrain.state")


# ---- learning rate ----------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="hvdtrain")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate of a distributed optimizer, evaluated inside the training step (no host
    synchronisation, works with ``steps_per_execution``):

    ``lr(step) = base(step) x factor x warmup_multiplier(step)``, with ``step`` the optimizer step
    (Keras's micro-batch counter ``// backward_passes_per_step``), ``base`` the user's float or
    ``LearningRateSchedule`` (called with the optimizer step, as in single-process training on
    the global batch), ``factor`` the world-size scaling (:func:`hvdtrain.schedule.scale_factor`)
    and the multiplier rising linearly from ``1/factor`` to 1 over ``warmup_steps`` optimizer
    steps (Goyal et al. 2017, gradual warmup; :func:`hvdtrain.schedule.warmup_multiplier`).

    ``warmup_steps`` and the factor (``scale``) are variables: :func:`warmup` and elastic
    training's resets change them after the step has been compiled.
    """

    def __init__(self, base_lr, factor: float, backward_passes_per_step: int = 1,
                 warmup_steps: float = 0.0):
        if isinstance(base_lr, dict):
            base_lr = keras.saving.deserialize_keras_object(base_lr)
        self.base_lr = base_lr
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.scale = keras.Variable(float(factor), dtype="float32", trainable=False,
                                    name="hvdtrain_lr_scale")
        self.warmup_steps = keras.Variable(float(warmup_steps), dtype="float32",
                                           trainable=False, name="hvdtrain_warmup_steps")

    @property
    def factor(self) -> float:
        """The world-size scaling factor (a variable: elastic training changes it on a reset)."""
        return float(ops.convert_to_numpy(self.scale))

    def __call__(self, iterations):
        step = ops.cast(ops.floor_divide(iterations, self.backward_passes_per_step), "float32")
        base = self.base_lr(step) if callable(self.base_lr) else self.base_lr
        w = ops.convert_to_tensor(self.warmup_steps)
        f = ops.convert_to_tensor(self.scale)
        ramp = (1.0 + (f - 1.0) * step / ops.maximum(w, 1e-12)) / f
        multiplier = ops.where(step < w, ramp, ops.ones_like(ramp))
        return ops.cast(base, "float32") * f * multiplier

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (Python float)."""
        base = self.base_lr
        if callable(base):
            base = float(ops.convert_to_numpy(base(float(step))))
        warmup_steps = float(ops.convert_to_numpy(self.warmup_steps))
        warmup_epochs, per_epoch = (warmup_steps, 1) if warmup_steps else (0.0, 1)
        return float(base) * self.factor * schedule.warmup_multiplier(
            step, self.factor, warmup_epochs, per_epoch)

    def get_config(self):
        base = self.base_lr
        if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
            base = keras.saving.serialize_keras_object(base)
        return {"base_lr": base, "factor": self.factor,
                "backward_passes_per_step": self.backward_passes_per_step,
                "warmup_steps": float(ops.convert_to_numpy(self.warmup_steps))}


def _schedule_of(optimizer) -> WarmupSchedule:
    lr = getattr(_inner(optimizer), "_learning_rate", None)
    if not isinstance(lr, WarmupSchedule):
        raise ValueError("warmup() and callbacks() need the optimizer returned by "
                         "hvdtrain.keras.distribute()")
    return lr


class WarmupCallback(keras.callbacks.Callback):
    """Sets the gradual warmup (Goyal et al. 2017) of a distributed optimizer's
    :class:`WarmupSchedule` when training begins: the rate rises linearly from the base lr to the
    scaled lr over ``warmup_epochs x steps_per_epoch`` optimizer steps, then stays there. The
    schedule runs inside the training step; this callback reads nothing per batch. A resumed run
    continues the schedule (the step is the optimizer's). Calling :func:`warmup` again (a second
    ``fit`` phase) keeps the base and the scaling: both live in the schedule, not in the current
    rate."""

    def __init__(self, optimizer, warmup_epochs: float, steps_per_epoch: int):
        super().__init__()
        self.schedule = _schedule_of(optimizer)
        schedule.warmup_multiplier(0, self.schedule.factor, warmup_epochs, steps_per_epoch)
        self._optimizer = optimizer
        self.factor = self.schedule.factor
        self.k = self.schedule.backward_passes_per_step
        self.warmup_epochs, self.steps_per_epoch = float(warmup_epochs), int(steps_per_epoch)
        self._apply()

    def _apply(self) -> None:
        self.schedule.warmup_steps.assign(self.warmup_epochs * self.steps_per_epoch)

    def lr_at(self, step: int) -> float:
        """The learning rate for optimizer step ``step``."""
        return self.schedule.lr_at(step)

    def on_train_begin(self, logs=None):
        self._apply()


def warmup(optimizer, *, warmup_epochs: float, steps_per_epoch: int) -> WarmupCallback:
    """A Keras callback that gives the distributed optimizer the schedule of
    :func:`hvdtrain.schedule.lr_at`: from the base lr to the scaled lr over ``warmup_epochs``,
    then constant (see :class:`WarmupCallback` and :class:`WarmupSchedule`).

    Args:
        optimizer: the optimizer returned by :func:`distribute`.
        warmup_epochs: epochs of warmup, >= 0 (0: no warmup).
        steps_per_epoch: optimizer steps per epoch (micro-batches per epoch // k), >= 1.

    Raises:
        ValueError: the optimizer did not come from :func:`distribute`, a negative
            ``warmup_epochs`` or ``steps_per_epoch`` < 1.
    """
    return WarmupCallback(optimizer, warmup_epochs, steps_per_epoch)


# ---- the distributed optimizer ------------------------------------------------------------------

class NonFiniteGuard:
    """Skips, on every rank together, an optimizer step whose gradients were NaN/Inf on any rank.

    Installed by :func:`distribute` (``on_nonfinite=``). In the step's grouped all-reduce each
    rank also sends a vector of ``size`` flags (1 at its own rank when its local gradients are
    not finite), so every rank learns which ranks were bad from the same all-reduce. The decision
    is taken on the all-reduced gradients, which are identical on every rank: when they are not
    finite, no rank applies the step (weights, slots and weight decay stay as they were), the
    optimizer's step counter still advances (the LR schedule follows the step, as in the PyTorch
    trainer) and ``skipped`` grows by one. Ranks never diverge.

    Attributes:
        mode: ``"skip"`` or ``"stop"`` (stop is carried out by the callback of :func:`callbacks`).
        skipped: variable (int64), steps skipped so far.
        bad_ranks: variable ``(size,)`` float32, 1 for the ranks of the last skipped step.
        bad_step: variable (int64), the optimizer step last skipped (-1: none).
    """

    def __init__(self, mode: str, size: int):
        self.mode, self.size = mode, size
        self.skipped = keras.Variable(0, dtype="int64", trainable=False, name="hvdtrain_skipped")
        self.bad_ranks = keras.Variable(np.zeros(size, np.float32), trainable=False,
                                        name="hvdtrain_bad_ranks")
        self.bad_step = keras.Variable(-1, dtype="int64", trainable=False,
                                       name="hvdtrain_bad_step")

    def record(self, flags, step) -> None:
        self.skipped.assign(self.skipped + 1)
        self.bad_ranks.assign(flags)
        self.bad_step.assign(ops.cast(step, "int64"))


class _Allreduce:
    """The hooks :func:`distribute` puts on a Keras 3 optimizer (the instance only, so its class,
    config and saved files stay the optimizer's own).

    Keras calls ``_clip_gradients`` exactly once per optimizer step, with the step's gradients
    (with ``gradient_accumulation_steps=k``: the mean of the k micro-batch gradients), before the
    weight decay and the update. There the gradients go through one grouped all-reduce (average
    over ranks), so clipping then sees the global gradient, as in single-process training. With a
    :class:`NonFiniteGuard`, the weight decay and the update run only when the all-reduced
    gradients are finite.
    """

    def __init__(self, optimizer, compression: str, predivide: float,
                 guard: NonFiniteGuard | None, rank: int, size: int):
        self.opt, self.compression, self.predivide = optimizer, compression, predivide
        self.guard, self.rank, self.size = guard, rank, size
        self.allreduces = 0  # grouped all-reduces built (traced graphs count once)
        cls = type(optimizer)
        self._clip, self._decay = cls._clip_gradients, cls._apply_weight_decay
        self._update = cls._backend_update_step
        self._finite = None
        optimizer._clip_gradients = self.clip_gradients
        optimizer._apply_weight_decay = self.apply_weight_decay
        optimizer._backend_update_step = self.backend_update_step

    def clip_gradients(self, grads):
        grads = [None if g is None else B.native(g) for g in grads]
        dense = [g for g in grads if g is not None]
        extra = []
        if self.guard is not None:
            local_ok = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in dense]))
            bad = ops.cast(ops.logical_not(local_ok), dense[0].dtype)
            extra = [B.native(ops.one_hot(self.rank, self.size, dtype=dense[0].dtype) * bad)]
        reduced = B.grouped_average(dense + extra, self.compression, self.predivide,
                                    name="hvdtrain.gradients")
        self.allreduces += 1
        if self.guard is not None:
            self._flags = ops.cast(reduced[-1], "float32") * float(self.size)
            reduced = reduced[:-1]
            self._finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in reduced]))
        it = iter(reduced)
        grads = [None if g is None else next(it) for g in grads]
        return self._clip(self.opt, grads)

    def apply_weight_decay(self, variables):
        if self._finite is None:
            return self._decay(self.opt, variables)
        return ops.cond(self._finite, lambda: self._decay(self.opt, variables), lambda: None)

    def backend_update_step(self, grads, trainable_variables, learning_rate):
        if self._finite is None:
            return self._update(self.opt, grads, trainable_variables, learning_rate)
        finite, flags = self._finite, self._flags
        self._finite = None
        step = self.opt.iterations

        def skip():
            self.guard.record(flags, step)

        return ops.cond(finite,
                        lambda: self._update(self.opt, grads, trainable_variables, learning_rate),
                        skip)


def _global_check_finite(lso):
    """A ``LossScaleOptimizer``'s finite check made global: the step is skipped (and the loss
    scale lowered) on every rank when any rank's scaled gradients overflowed, so the ranks run the
    same collectives and keep the same loss scale."""
    own = type(lso).check_finite

    def check_finite(grads):
        local = ops.cast(own(lso, grads), "float32")
        return ops.greater(B.grouped_average([B.native(ops.reshape(local, (1,)))],
                                             name="hvdtrain.finite")[0][0], 0.999)

    lso.check_finite = check_finite


def distribute(model: keras.Model, optimizer: keras.optimizers.Optimizer, *,
               backward_passes_per_step: int = 1, lr_scaling: str | None = None,
               compression: str = "none", op: str = "average", root_rank: int = 0,
               gradient_predivide_factor: float = 1.0, on_nonfinite: str | None = None):
    """Turn a single-process Keras 3 model and optimizer into synchronous data-parallel ones.

    1. Accumulation: with k = ``backward_passes_per_step`` > 1 the optimizer gets Keras's own
       ``gradient_accumulation_steps=k``: each micro-batch's gradients are added up locally and
       every k-th micro-batch applies their mean, so the all-reduce below runs once per k
       micro-batches. ``optimizer.iterations`` counts optimizer steps (Keras 3's meaning); the
       micro-batch count is ``optimizer.iterations * k`` plus the micro-batches of an unfinished
       group. Give ``fit`` a whole number of groups per epoch (:func:`shard_dataset` does), or
       the last group of an epoch is carried into the next one.
    2. All-reduce: the optimizer's gradients go through one grouped all-reduce per step (average
       over ranks, optional fp16 compression; :class:`_Allreduce`), before clipping, weight decay
       and the update. A ``LossScaleOptimizer`` (fp16) keeps its loss scale equal on every rank
       (its overflow check is all-reduced).
    3. Learning rate: the optimizer's rate (a float or a ``LearningRateSchedule``) becomes a
       :class:`WarmupSchedule` multiplied by ``schedule.scale_factor(lr_scaling, size, k)``
       (Goyal et al. 2017 for ``linear``), kept as ``optimizer.hvdtrain_lr_scale``.
    4. Broadcast: the optimizer is built and model and optimizer variables are broadcast from
       ``root_rank`` (:func:`broadcast_state`).
    5. With ``on_nonfinite="skip"`` or ``"stop"``: non-finite gradients on any rank skip that
       optimizer step on every rank (:class:`NonFiniteGuard`); ``"stop"`` then ends ``fit``
       with :class:`~hvdtrain.runtime.NonFiniteLossError` (raised by the callback that
       :func:`callbacks` adds).

    Compile the model with the returned optimizer and without XLA (Horovod's operations have no
    XLA kernels): ``model.compile(optimizer=optimizer, ..., jit_compile=False)``. Embedding
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

    Returns:
        ``(model, optimizer)``: the same model (now equal on all ranks) and the same optimizer
        object, now distributed, with ``.backward_passes_per_step`` and ``.hvdtrain_lr_scale``.

    Raises:
        ValueError: unknown ``lr_scaling``/``compression``/``op``/``on_nonfinite``, k < 1, an
            unbuilt model, an optimizer distributed twice, built already without accumulation
            when k > 1, or created with another ``gradient_accumulation_steps``, or a
            learning rate that is a plain callable.
    """
    return _distribute(model, optimizer, backward_passes_per_step, lr_scaling, compression, op,
                       root_rank, gradient_predivide_factor, on_nonfinite, broadcast=True)


def _distribute(model, optimizer, backward_passes_per_step, lr_scaling, compression, op,
                root_rank, gradient_predivide_factor, on_nonfinite, broadcast: bool):
    """:func:`distribute`; ``broadcast=False`` builds the optimizer without broadcasting (elastic
    training, where ``KerasState.sync`` broadcasts on every rank at each reset, and a worker that
    joins later must not start a broadcast of its own)."""
    check_distribute_args(backward_passes_per_step, compression, op, B.COMPRESSIONS, _OPS)
    if on_nonfinite is not None and on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be None, 'skip' or 'stop'; got {on_nonfinite!r}")
    _require_built(model)
    k = int(backward_passes_per_step)
    inner = _inner(optimizer)
    if getattr(optimizer, "hvdtrain_lr_scale", None) is not None:
        raise ValueError("this optimizer is distributed already; give distribute() a new one")
    want = k if k > 1 else None
    have = inner.gradient_accumulation_steps or None
    if have != want:
        if have is not None:
            raise ValueError(f"the optimizer was created with gradient_accumulation_steps={have}"
                             f" but backward_passes_per_step is {k}: leave "
                             "gradient_accumulation_steps out (distribute sets it)")
        if inner.built:
            raise ValueError("with backward_passes_per_step > 1 the optimizer must not be built "
                             "yet (its gradient accumulators are made when it is built): pass a "
                             "new optimizer, distribute() builds it")
        inner.gradient_accumulation_steps = want
    base = inner._learning_rate
    if isinstance(base, keras.Variable):
        base = float(ops.convert_to_numpy(base))
    elif not isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError("the optimizer's learning_rate must be a float or a keras "
                         "LearningRateSchedule (hvdtrain composes it with the scaling and warmup)")
    lr_scaling = schedule.resolve_lr_scaling(lr_scaling, op)
    factor = schedule.scale_factor(lr_scaling, B.hvd.size(), k)
    inner.learning_rate = WarmupSchedule(base, factor, k)
    guard = NonFiniteGuard(on_nonfinite, B.hvd.size()) if on_nonfinite else None
    hooks = _Allreduce(inner, compression, float(gradient_predivide_factor), guard,
                       B.hvd.rank(), B.hvd.size())
    if inner is not optimizer:
        _global_check_finite(optimizer)
    if broadcast:
        broadcast_state(model, optimizer, root_rank)
    elif not optimizer.built:
        optimizer.build(model.trainable_variables)
    optimizer.hvdtrain_lr_scale = factor
    optimizer.backward_passes_per_step = k
    optimizer.hvdtrain_allreduce = hooks
    if guard is not None:
        optimizer.hvdtrain_nonfinite = guard
    return model, optimizer


def micro_batch_count(optimizer) -> int:
    """Micro-batches the distributed optimizer has seen (Keras's internal counter; with k > 1
    ``optimizer.iterations`` counts optimizer steps)."""
    return int(ops.convert_to_numpy(_inner(optimizer)._iterations))


def set_micro_batch_count(optimizer, count: int) -> None:
    """Set the micro-batch counter (a resumed run's position; the LR schedule follows it)."""
    _inner(optimizer)._iterations.assign(int(count))


# ---- callbacks -------------------------------------------------------------------------------

class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every numeric value in the epoch's logs (``loss``, metrics, ``val_*``) by its mean
    over ranks, in one all-reduce, so ``History`` and later callbacks see global values (Horovod's
    ``MetricAverageCallback`` for Keras 3). Every rank must produce the same log keys."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or B.hvd.size() == 1:
            return
        numeric = {k: float(ops.convert_to_numpy(v)) for k, v in logs.items()
                   if np.size(ops.convert_to_numpy(v)) == 1}
        sums = allreduce_sums(numeric, name="hvdtrain.logs")
        logs.update({k: v / B.hvd.size() for k, v in sums.items()})


class _NonFiniteCallback(keras.callbacks.Callback):
    """Reports the steps a :class:`NonFiniteGuard` skipped: with ``mode="stop"`` after each batch
    (raising :class:`~hvdtrain.runtime.NonFiniteLossError` on every rank at the same batch), with
    ``"skip"`` once per epoch (no host synchronisation per batch)."""

    def __init__(self, guard: NonFiniteGuard):
        super().__init__()
        self.guard, self.seen, self.epoch = guard, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _check(self):
        skipped = int(ops.convert_to_numpy(self.guard.skipped))
        if skipped == self.seen:
            return
        self.seen = skipped
        bad = [r for r, v in enumerate(ops.convert_to_numpy(self.guard.bad_ranks)) if v > 0.5]
        message = runtime.nonfinite_message(bad, int(ops.convert_to_numpy(self.guard.bad_step)),
                                            self.epoch + 1)
        if self.guard.mode == "stop":
            raise runtime.nonfinite_stop(message)
        log.warning("%s: step skipped on all ranks", message)

    def on_train_batch_end(self, batch, logs=None):
        if self.guard.mode == "stop":
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()


def callbacks(optimizer, *, warmup_epochs: float = 0.0, steps_per_epoch: int = 1) -> list:
    """The callbacks a data-parallel ``fit`` needs, in order: :class:`MetricAverageCallback`
    (epoch logs and History hold averages over all ranks), :class:`SyncBuffersCallback` (equal
    BatchNormalization statistics on every rank at each epoch's end), the report of skipped
    non-finite steps when :func:`distribute` installed a :class:`NonFiniteGuard`, and the warmup
    (:func:`warmup`, last). Put callbacks that evaluate or save after these. Calling it again
    (another ``fit`` phase) is safe: the scaled rate lives in the optimizer's schedule."""
    guard = getattr(optimizer, "hvdtrain_nonfinite", None)
    return [MetricAverageCallback(), SyncBuffersCallback(),
            *([_NonFiniteCallback(guard)] if guard is not None else []),
            warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch)]


# ---- data ------------------------------------------------------------------------------------

def micro_batches_per_epoch(samples: int, batch_size: int, size: int,
                            backward_passes_per_step: int) -> int:
    """Micro-batches one rank runs per Keras epoch: its shard's batches (the last one completed
    by wrapping around) rounded down to a multiple of k, so every epoch ends on a complete
    accumulation group (at least one group).

    Args:
        samples: training samples in the whole dataset.
        batch_size: local batch.
        size: world size.
        backward_passes_per_step: k.

    Raises:
        ValueError: a rank's shard holds fewer than ``batch_size x k`` samples.
    """
    per_rank = samples // size
    groups = per_rank // (batch_size * backward_passes_per_step)
    if groups < 1:
        raise ValueError(f"{samples} samples over {size} ranks leave {per_rank} per rank, fewer "
                         f"than one optimizer step needs (batch {batch_size} x k "
                         f"{backward_passes_per_step}); lower --batch-size or "
                         "--backward-passes-per-step")
    return -(-per_rank // batch_size) // backward_passes_per_step * backward_passes_per_step


class ShardedDataset(keras.utils.PyDataset):
    """This rank's endless stream of micro-batches ``(x (B, ...), y (B,))`` for ``fit``, the
    counterpart of PyTorch's ``DistributedSampler``: every epoch visits a new global permutation
    of all samples (``numpy.random.default_rng((seed, epoch))``, the same on every rank) and rank
    r takes its entries ``r, r + size, ...`` (``samples // size`` of them), so the ranks' shards
    change every epoch and together cover the data. An epoch is :attr:`steps_per_epoch`
    micro-batches (:func:`micro_batches_per_epoch`: a whole number of accumulation groups; the
    last batch is completed by wrapping around the shard).

    Batch ``i`` of the stream is a pure function of ``(start_batch + i)``, so a resumed run
    starts at its position directly (``start_batch``) instead of replaying the stream. Works with
    both Keras backends; pass ``steps_per_epoch=data.steps_per_epoch`` to ``fit``.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, *, batch_size: int, rank: int, size: int,
                 seed: int = 0, shuffle: bool = True, backward_passes_per_step: int = 1,
                 start_batch: int = 0, **kwargs):
        super().__init__(**kwargs)
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x, self.y, self.batch_size = x, y, int(batch_size)
        self.rank, self.size, self.seed, self.shuffle = rank, size, seed, shuffle
        self.per_rank = len(x) // size
        self.steps_per_epoch = micro_batches_per_epoch(len(x), batch_size, size,
                                                       backward_passes_per_step)
        self.start_batch = int(start_batch)
        self._epoch, self._shard = None, None

    @property
    def num_batches(self):
        return None  # endless: fit() takes steps_per_epoch

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's sample indices in ``epoch`` (``samples // size`` of them)."""
        if self._epoch != epoch:
            n = len(self.x)
            order = (np.random.default_rng((self.seed, epoch)).permutation(n) if self.shuffle
                     else np.arange(n))
            self._epoch, self._shard = epoch, order[self.rank::self.size][:self.per_rank]
        return self._shard

    def __getitem__(self, i):
        epoch, j = divmod(self.start_batch + int(i), self.steps_per_epoch)
        shard = self.shard(epoch)
        idx = shard[(j * self.batch_size + np.arange(self.batch_size)) % len(shard)]
        return self.x[idx], self.y[idx]


def shard_dataset(x: np.ndarray, y: np.ndarray, *, batch_size: int, seed: int = 0,
                  shuffle: bool = True, info: runtime.RankInfo | None = None,
                  backward_passes_per_step: int = 1, start_batch: int = 0) -> ShardedDataset:
    """This rank's micro-batches of ``(x (N, ...), y (N,))`` for ``fit``, reshuffled globally
    every epoch (:class:`ShardedDataset`; ``steps_per_epoch`` attribute for ``fit``).

    Args:
        x: inputs ``(N, ...)``; y: labels ``(N,)``.
        batch_size: local batch.
        seed: shuffle seed (the same on every rank).
        shuffle: a new permutation every epoch (False: strided shards of the data in order).
        info: rank and size; defaults to Horovod's.
        backward_passes_per_step: k (an epoch is a whole number of groups of k).
        start_batch: micro-batches of the stream already trained (``--resume``).

    Raises:
        ValueError: ``x`` and ``y`` differ in length, or a shard is too small for one step.
    """
    rank, size = (info.rank, info.size) if info else (B.hvd.rank(), B.hvd.size())
    return ShardedDataset(x, y, batch_size=batch_size, rank=rank, size=size, seed=seed,
                          shuffle=shuffle, backward_passes_per_step=backward_passes_per_step,
                          start_batch=start_batch)


os.environ.setdefault("KERAS_BACKEND", B.NAME)  # child processes get the same backend
