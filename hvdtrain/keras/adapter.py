"""The Keras adapter: Horovod's DistributedOptimizer, rank-0 broadcast, LR scaling, accumulation,
for tf.keras (Keras 2, TensorFlow 2.15). Same concepts and names as :mod:`hvdtrain.torch`.

Typical use (launched with ``horovodrun -np 2 python train.py``)::

    import hvdtrain.keras as hk

    info = hk.init(seed=42)
    dataset = hk.shard_dataset(x, y, batch_size=16, seed=42)   # shard by rank, reshuffle per epoch
    model = make_model(); model.build((None, 8, 8, 1))
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    model, optimizer = hk.distribute(model, optimizer, backward_passes_per_step=4,
                                     lr_scaling="linear")
    model.compile(optimizer=optimizer, loss=..., metrics=["accuracy"])
    model.fit(dataset, epochs=10, steps_per_epoch=optimizer_steps * 4,
              callbacks=hk.callbacks(optimizer, warmup_epochs=2, steps_per_epoch=optimizer_steps),
              verbose=1 if info.is_root else 0)
"""
from __future__ import annotations

import logging

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

from hvdtrain import runtime, schedule
from hvdtrain.accumulation import check_distribute_args

_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
_OPS = {"average": hvd.Average}
NONFINITE_MODES = ("skip", "stop")
log = logging.getLogger("hvdtrain")


def init(seed: int = 42, threads: int | None = None, device: str = "auto") -> runtime.RankInfo:
    """Start Horovod, pin this rank to its GPU (if any), give it its share of the cores, and seed it.

    Calls ``hvd.init()``; with a GPU per rank on this host (``device="auto"``) or
    ``device="cuda"``, makes only GPU ``local_rank`` visible to TensorFlow, with memory growth
    (Horovod's documented pattern; ``device="cpu"`` hides the GPUs); sets TensorFlow's intra-op threads to ``threads`` or
    ``max(1, cores // local_size)`` and inter-op threads to 1; seeds TensorFlow, NumPy and
    ``random`` (``tf.keras.utils.set_random_seed``) with ``runtime.rank_seed(seed, rank)`` (rank 0
    gets ``seed``; :func:`distribute` makes all models equal to rank 0's). Counts the hosts with
    one all-reduce (every rank must call ``init``; :func:`hvdtrain.runtime.count_hosts`).
    Call it before TensorFlow runs anything (device visibility and threads are fixed then).

    Args:
        seed: base seed.
        threads: intra-op CPU threads for this rank (default: its share of the cores).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (:func:`hvdtrain.runtime.choose_device`).

    Returns:
        The :class:`~hvdtrain.runtime.RankInfo` of this process (``.device``: ``"cpu"`` or
        ``"cuda:<local_rank>"``, the physical GPU TensorFlow sees as its only one).

    Raises:
        ValueError: ``device="cuda"`` without a GPU, or fewer GPUs than ranks on this host.
    """
    hvd.init()
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
    threads = runtime.thread_budget(hvd.local_size()) if threads is None else int(threads)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # TensorFlow's runtime already started: threads can no longer change
        threads = tf.config.threading.get_intra_op_parallelism_threads() or threads
    seed = runtime.rank_seed(seed, hvd.rank())
    tf.keras.utils.set_random_seed(seed)
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
    """Sum scalar values over all ranks, in float64, in one all-reduce.

    Every rank must pass the same keys (sorted before the all-reduce).

    Returns:
        ``{key: global sum}``.
    """
    keys = sorted(values)
    tensor = tf.constant([float(values[k]) for k in keys], dtype=tf.float64)
    summed = hvd_tf.allreduce(tensor, op=hvd.Sum, name=name)
    return dict(zip(keys, summed.numpy().tolist()))


def ranks_where(flag: bool, name: str = "hvdtrain.flag") -> list[int]:
    """The ranks on which ``flag`` is true, known to every rank after one all-reduce (a vector of
    ``size`` numbers). Every rank must call it at the same point.

    Returns:
        Sorted ranks (empty when the flag is false everywhere).
    """
    return runtime.ranks_where(flag, hvd.rank(), hvd.size(),
                               lambda values: allreduce_sums(values, name=name))


def sync_buffers(model: tf.keras.Model, op: str = "average", root_rank: int = 0) -> int:
    """Make the model's non-trainable variables (BatchNormalization ``moving_mean``/
    ``moving_variance``, any other non-trainable state) equal on every rank, in place.

    The Keras counterpart of :func:`hvdtrain.torch.sync_buffers`, with the same rule:
    ``"average"`` (default) sets floating-point variables to their mean over ranks (each rank's
    moving statistics estimate its own shard; the mean uses every shard's data) and takes integer
    ones from ``root_rank``; ``"broadcast"`` copies all of them from ``root_rank`` (as PyTorch DDP
    does with buffers). Trainable weights are not touched (the all-reduced gradients keep them
    equal). Every rank must call it at the same point; :class:`SyncBuffersCallback` does so at
    each epoch's end.

    Returns:
        The number of variables synchronised.

    Raises:
        ValueError: an unknown ``op``, or the model is not built.
    """
    runtime.check_buffer_sync_op(op)
    _require_built(model)
    variables = list(model.non_trainable_variables)
    if hvd.size() == 1 or not variables:
        return len(variables)
    averaged = [v for v in variables if op == "average" and v.dtype.is_floating]
    copied = [v for v in variables if not (op == "average" and v.dtype.is_floating)]
    if averaged:
        means = hvd_tf.grouped_allreduce([v.read_value() for v in averaged], op=hvd.Average,
                                         name="hvdtrain.buffers")
        for v, mean in zip(averaged, means):
            v.assign(mean)
    if copied:
        hvd_tf.broadcast_variables(copied, root_rank)
    return len(variables)


class SyncBuffersCallback(tf.keras.callbacks.Callback):
    """:func:`sync_buffers` on the model at the end of every epoch (before evaluation and
    checkpoints made by later callbacks) and at the end of training, so all ranks hold the same
    BatchNormalization statistics."""

    def __init__(self, op: str = "average"):
        super().__init__()
        runtime.check_buffer_sync_op(op)
        self.op = op

    def on_epoch_end(self, epoch, logs=None):
        sync_buffers(self.model, self.op)


def _require_built(model: tf.keras.Model) -> None:
    if not model.built:
        raise ValueError("the model has no weights yet: build it first, e.g. "
                         "model.build((None, 8, 8, 1)) or call it on one batch, then distribute")


def broadcast_state(model: tf.keras.Model, optimizer: tf.keras.optimizers.Optimizer,
                    root_rank: int = 0) -> None:
    """Make every rank's model weights (trainable and not) and optimizer variables (iterations,
    learning rate, momentum/moment slots) equal to ``root_rank``'s, before the first step.

    The optimizer is built on the model's trainable variables first, so its slots exist; then all
    variables go through ``horovod.tensorflow.broadcast_variables``. (Horovod's
    ``BroadcastGlobalVariablesCallback`` does this after the first batch instead, so the first step
    is taken from unequal weights and differs from single-process training.)

    Raises:
        ValueError: the model is not built yet.
    """
    _require_built(model)
    optimizer.build(model.trainable_variables)
    hvd_tf.broadcast_variables(list(model.variables) + list(optimizer.variables), root_rank)


def distribute(model: tf.keras.Model, optimizer: tf.keras.optimizers.Optimizer, *,
               backward_passes_per_step: int = 1, lr_scaling: str | None = None,
               compression: str = "none", op: str = "average", root_rank: int = 0,
               gradient_predivide_factor: float = 1.0, on_nonfinite: str | None = None):
    """Turn a single-process Keras model and optimizer into synchronous data-parallel ones.

    1. Multiplies the optimizer's learning rate by ``schedule.scale_factor(lr_scaling, size, k)``
       (Goyal et al. 2017 for ``linear``); the factor is kept as ``optimizer.hvdtrain_lr_scale``.
    2. Wraps the optimizer in ``hvd.DistributedOptimizer`` with ``backward_passes_per_step=k``,
       ``average_aggregated_gradients=True`` (the k summed micro-batch gradients are divided by
       k, so a step is the mean over the global batch), ``compression`` and ``op``. Keras's
       ``optimizer.iterations`` then counts micro-batches; optimizer steps are
       ``iterations // k``. Gradients of a group that is not complete when ``fit`` ends are not
       applied: give ``fit`` a ``steps_per_epoch`` that is a multiple of k over a repeated
       dataset (:func:`shard_dataset` repeats; :func:`micro_batches_per_epoch` rounds).
    3. Keeps the optimizer's existing variables (Horovod's wrapper alone rebuilds the optimizer
       from its config and drops them), then broadcasts model and optimizer variables from
       ``root_rank`` (:func:`broadcast_state`).

    4. With ``on_nonfinite="skip"`` or ``"stop"``: a NaN/Inf loss on any rank skips that
       optimizer step on every rank (see :class:`NonFiniteGuard`); ``"stop"`` then ends ``fit``
       with :class:`~hvdtrain.runtime.NonFiniteLossError` (raised by the callback that
       :func:`callbacks` adds).

    Compile the model with the returned optimizer: ``model.compile(optimizer=optimizer, ...)``.

    Args:
        model: a built ``tf.keras.Model``.
        optimizer: a Keras (2.11+) optimizer with a float learning rate (the single-process rate).
        backward_passes_per_step: k >= 1 micro-batches per optimizer step.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``; None (default): the default for
            ``op`` (``"linear"`` for ``"average"``, as in :func:`hvdtrain.torch.distribute`).
        compression: ``"none"`` or ``"fp16"``.
        op: ``"average"`` (Horovod's Keras optimizer has no Adasum).
        root_rank: rank whose initial state every rank takes.
        gradient_predivide_factor: passed to Horovod.
        on_nonfinite: ``None`` (no check), ``"skip"`` or ``"stop"``.

    Returns:
        ``(model, optimizer)``: the same model (now equal on all ranks) and the wrapped optimizer,
        which has ``.backward_passes_per_step`` and ``.hvdtrain_lr_scale``.

    Raises:
        ValueError: unknown ``lr_scaling``/``compression``/``op``/``on_nonfinite``, k < 1, an
            unbuilt model, or a
            learning-rate schedule object as the optimizer's rate (use a float and
            :func:`warmup`).
    """
    check_distribute_args(backward_passes_per_step, compression, op, _COMPRESSIONS, _OPS)
    if on_nonfinite is not None and on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be None, 'skip' or 'stop'; got {on_nonfinite!r}")
    _require_built(model)
    if isinstance(optimizer._learning_rate, tf.keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError("the optimizer's learning_rate is a schedule object; give it a float and "
                         "use hvdtrain.keras.warmup() for the warmup")
    lr_scaling = schedule.resolve_lr_scaling(lr_scaling, op)
    factor = schedule.scale_factor(lr_scaling, hvd.size(), backward_passes_per_step)
    built = getattr(optimizer, "_built", False)
    old_values = [v.numpy() for v in optimizer.variables] if built else None
    base_lr = float(optimizer.learning_rate.numpy())

    wrapped = hvd.DistributedOptimizer(
        optimizer, compression=_COMPRESSIONS[compression], op=_OPS[op],
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=True,
        gradient_predivide_factor=gradient_predivide_factor)
    wrapped.build(model.trainable_variables)
    if old_values is not None:
        if len(old_values) != len(wrapped.variables):
            raise ValueError("the optimizer was built for other variables than the model's "
                             "trainable variables; build it from model.trainable_variables")
        for var, value in zip(wrapped.variables, old_values):
            var.assign(value)
    wrapped.learning_rate = base_lr * factor
    wrapped.hvdtrain_lr_scale = factor
    wrapped.backward_passes_per_step = backward_passes_per_step
    broadcast_state(model, wrapped, root_rank)
    if on_nonfinite is not None:
        wrapped.hvdtrain_nonfinite = NonFiniteGuard(wrapped, on_nonfinite)
    return model, wrapped


class NonFiniteGuard:
    """Skips, on every rank together, an optimizer step whose loss was NaN/Inf on any rank.

    Installed by :func:`distribute` (``on_nonfinite=``) as the wrapped optimizer's ``minimize``,
    which Keras's ``Model.train_step`` calls with the micro-batch loss. Per micro-batch it runs
    Horovod's ``compute_gradients`` (local accumulation, and the gradient all-reduce on the k-th
    micro-batch) and notes whether this rank's loss was finite. On the k-th micro-batch of a group
    the per-rank flags go through one all-reduce (a vector of ``size`` float64 numbers, so every
    rank learns which ranks were bad); if any is set, no rank applies the gradients (weights and
    optimizer slots stay as they were), ``optimizer.iterations`` still advances (the LR schedule
    follows the step, as in the PyTorch trainer) and ``skipped`` grows by one. The decision is the
    same on every rank, so ranks never diverge.

    Attributes:
        mode: ``"skip"`` or ``"stop"`` (stop is carried out by the callback of :func:`callbacks`).
        skipped: ``tf.Variable`` (int64), steps skipped so far.
        bad_ranks: ``tf.Variable`` ``(size,)`` float64, 1 for the ranks of the last skipped step.
        bad_step: ``tf.Variable`` (int64), the optimizer step last skipped (-1: none).
    """

    def __init__(self, optimizer, mode: str):
        self.optimizer, self.mode = optimizer, mode
        self.k = int(optimizer.backward_passes_per_step)
        self.rank, self.size = hvd.rank(), hvd.size()
        with tf.init_scope():
            self._group_bad = tf.Variable(False, trainable=False, name="hvdtrain_group_bad")
            self.skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdtrain_skipped")
            self.bad_ranks = tf.Variable(tf.zeros([self.size], tf.float64), trainable=False,
                                         name="hvdtrain_bad_ranks")
            self.bad_step = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                        name="hvdtrain_bad_step")
        optimizer.minimize = self.minimize

    def minimize(self, loss, var_list, tape=None):
        """Keras's ``Optimizer.minimize`` with the check (``loss``: scalar tensor)."""
        grads_and_vars = list(self.optimizer.compute_gradients(loss, var_list, tape))
        finite = tf.reduce_all(tf.math.is_finite(loss))
        self._group_bad.assign(tf.logical_or(self._group_bad, tf.logical_not(finite)))
        if self.k == 1:
            self._end_of_group(grads_and_vars)
        else:
            last = tf.equal((self.optimizer.iterations + 1) % self.k, 0)
            tf.cond(last, lambda: self._end_of_group(grads_and_vars),
                    lambda: self._apply(grads_and_vars))

    def _apply(self, grads_and_vars):
        self.optimizer.apply_gradients(grads_and_vars)
        return tf.constant(0)

    def _end_of_group(self, grads_and_vars):
        flags = tf.one_hot(self.rank, self.size, dtype=tf.float64) * tf.cast(self._group_bad,
                                                                              tf.float64)
        flags = hvd_tf.allreduce(flags, op=hvd.Sum, name="hvdtrain.nonfinite")
        self._group_bad.assign(False)

        def skip():
            self.skipped.assign_add(1)
            self.bad_ranks.assign(flags)
            self.bad_step.assign(self.optimizer.iterations // self.k)
            self.optimizer.iterations.assign_add(1)
            return tf.constant(0)

        return tf.cond(tf.reduce_sum(flags) > 0, skip, lambda: self._apply(grads_and_vars))


class _NonFiniteCallback(tf.keras.callbacks.Callback):
    """Reports each step a :class:`NonFiniteGuard` skipped; with ``mode="stop"`` raises
    :class:`~hvdtrain.runtime.NonFiniteLossError` (on every rank at the same batch)."""

    def __init__(self, guard: NonFiniteGuard):
        super().__init__()
        self.guard, self.seen, self.epoch = guard, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        skipped = int(self.guard.skipped.numpy())
        if skipped == self.seen:
            return
        self.seen = skipped
        bad = [r for r, v in enumerate(self.guard.bad_ranks.numpy()) if v > 0]
        message = runtime.nonfinite_message(bad, int(self.guard.bad_step.numpy()), self.epoch + 1)
        if self.guard.mode == "stop":
            raise runtime.nonfinite_stop(message)
        log.warning("%s: step skipped on all ranks", message)


class WarmupCallback(tf.keras.callbacks.Callback):
    """Sets the optimizer's learning rate before every batch to
    ``scaled_lr x schedule.warmup_multiplier(step, factor, warmup_epochs, steps_per_epoch)``:
    linear from the base lr to the scaled lr over ``warmup_epochs`` (Goyal et al. 2017, gradual
    warmup), then constant. ``step = optimizer.iterations // backward_passes_per_step`` is the
    optimizer step the batch belongs to, so a resumed run continues the schedule.

    Unlike ``hvd.callbacks.LearningRateWarmupCallback`` it does not crash on Keras >= 2.11
    optimizers (that one's default ``momentum_correction=True`` raises ``AttributeError: 'float'
    object has no attribute 'dtype'``).
    """

    def __init__(self, optimizer, warmup_epochs: float, steps_per_epoch: int):
        super().__init__()
        if not hasattr(optimizer, "hvdtrain_lr_scale"):
            raise ValueError("warmup() needs the optimizer returned by hvdtrain.keras.distribute()")
        self._optimizer = optimizer
        self.factor = float(optimizer.hvdtrain_lr_scale)
        self.k = int(optimizer.backward_passes_per_step)
        self.scaled_lr = float(optimizer.learning_rate.numpy())
        self.warmup_epochs, self.steps_per_epoch = warmup_epochs, steps_per_epoch
        self._apply(0)

    def lr_at(self, step: int) -> float:
        """The learning rate for optimizer step ``step``."""
        return self.scaled_lr * schedule.warmup_multiplier(step, self.factor, self.warmup_epochs,
                                                           self.steps_per_epoch)

    def _apply(self, step: int) -> None:
        self._optimizer.learning_rate.assign(self.lr_at(step))

    def on_train_batch_begin(self, batch, logs=None):
        self._apply(int(self._optimizer.iterations.numpy()) // self.k)


def warmup(optimizer, *, warmup_epochs: float, steps_per_epoch: int) -> WarmupCallback:
    """A Keras callback that follows :func:`hvdtrain.schedule.lr_at`: from the base lr to the
    scaled lr over ``warmup_epochs``, then constant (see :class:`WarmupCallback`).

    Args:
        optimizer: the optimizer returned by :func:`distribute`.
        warmup_epochs: epochs of warmup, >= 0 (0: no warmup).
        steps_per_epoch: optimizer steps per epoch (micro-batches per epoch // k).

    Raises:
        ValueError: the optimizer did not come from :func:`distribute`.
    """
    return WarmupCallback(optimizer, warmup_epochs, steps_per_epoch)


def micro_batches_per_epoch(samples: int, batch_size: int, size: int,
                            backward_passes_per_step: int) -> int:
    """Micro-batches one rank runs per Keras epoch: its shard's batches rounded down to a
    multiple of k, so every epoch ends on a complete accumulation group (at least one group).

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


def shard_dataset(x: np.ndarray, y: np.ndarray, *, batch_size: int, seed: int = 0,
                  shuffle: bool = True, info: runtime.RankInfo | None = None) -> tf.data.Dataset:
    """A ``tf.data`` pipeline for this rank: ``shard(size, rank)`` first (each rank its own
    samples), then a shuffle that changes on every pass (same seed on every rank), repeated
    forever, in full batches of ``batch_size`` (give ``fit`` a ``steps_per_epoch``, e.g.
    :func:`micro_batches_per_epoch`).

    Args:
        x: inputs ``(N, ...)``; y: labels ``(N,)``.
        batch_size: local batch.
        seed: shuffle seed.
        shuffle: reshuffle every epoch.
        info: rank and size; defaults to Horovod's.
    """
    rank, size = (info.rank, info.size) if info else (hvd.rank(), hvd.size())
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(size, rank)
    if shuffle:
        ds = ds.shuffle(len(x) // size + 1, seed=seed, reshuffle_each_iteration=True)
    return ds.repeat().batch(batch_size).prefetch(tf.data.AUTOTUNE)


def callbacks(optimizer, *, warmup_epochs: float = 0.0, steps_per_epoch: int = 1) -> list:
    """The callbacks a data-parallel ``fit`` needs, in order: ``MetricAverageCallback`` (epoch
    logs and History hold averages over all ranks), :class:`SyncBuffersCallback` (equal
    BatchNormalization statistics on every rank at each epoch's end), the report of skipped
    non-finite steps when :func:`distribute` installed a :class:`NonFiniteGuard`, and the warmup
    (:func:`warmup`, last). Put callbacks that evaluate or save after these."""
    guard = getattr(optimizer, "hvdtrain_nonfinite", None)
    return [hvd.callbacks.MetricAverageCallback(), SyncBuffersCallback(),
            *([_NonFiniteCallback(guard)] if guard is not None else []),
            warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch)]
