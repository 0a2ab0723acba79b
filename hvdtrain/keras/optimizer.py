"""The pieces :func:`hvdtrain.keras.distribute` puts into a Keras 3 optimizer: the learning-rate
schedule (:class:`~hvdtrain.keras.scheduler.WarmupSchedule`) made settable, the grouped all-reduce
of the gradients on the optimizer instance, the non-finite guard, and the loss-scale hooks for
fp16. Backend-neutral (``keras.ops`` and :mod:`hvdtrain.keras.collectives`)."""
from __future__ import annotations

import keras
import numpy as np
from keras import ops

from hvdtrain.keras import collectives as B
from hvdtrain.keras.scheduler import WarmupSchedule, torch_eager


def _set_learning_rate(optimizer, value) -> None:
    """``optimizer.learning_rate = value`` on a distributed optimizer: a float or a variable
    sets the current rate through :meth:`WarmupSchedule.set_rate`; anything else goes to
    Keras's own setter."""
    lr = optimizer.__dict__.get("_learning_rate")
    if isinstance(lr, WarmupSchedule) and not callable(value):
        lr.set_rate(float(ops.convert_to_numpy(value)), optimizer._iterations)
        return
    keras.optimizers.Optimizer.learning_rate.fset(optimizer, value)


def settable_learning_rate(optimizer) -> None:
    """Let Keras code set ``optimizer.learning_rate`` to a number after :func:`distribute`
    replaced the rate with a :class:`WarmupSchedule` (Keras's setter refuses a number once the
    rate is a schedule: "This optimizer was created with a `LearningRateSchedule`"). The
    optimizer's class becomes a subclass of its own (same name and module, so saved models load
    it as the original class) whose setter goes through :func:`_set_learning_rate`."""
    cls = type(optimizer)
    if cls.__dict__.get("hvdtrain_settable_rate"):
        return
    optimizer.__class__ = type(cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "hvdtrain_settable_rate": True,
        "learning_rate": property(cls.learning_rate.fget, _set_learning_rate,
                                  doc=cls.learning_rate.__doc__)})


def schedule_of(optimizer) -> WarmupSchedule:
    """The :class:`WarmupSchedule` a distributed optimizer runs on.

    Raises:
        ValueError: the optimizer did not come from :func:`hvdtrain.keras.distribute`.
    """
    lr = getattr(inner(optimizer), "_learning_rate", None)
    if not isinstance(lr, WarmupSchedule):
        raise ValueError("warmup() and callbacks() need the optimizer returned by "
                         "hvdtrain.keras.distribute()")
    return lr


def zero_accumulators(optimizer) -> None:
    """Set the gradient accumulators of Keras's ``gradient_accumulation_steps`` to 0 (an open
    group is dropped); nothing without accumulation."""
    for acc in getattr(inner(optimizer), "_accumulated_gradients", None) or []:
        if acc is not None:
            acc.assign(ops.zeros_like(acc))


def inner(optimizer):
    """The optimizer that owns the learning rate and the slots (a ``LossScaleOptimizer``'s
    ``inner_optimizer``, else the optimizer itself)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def own_rank_vector(rank: int, size: int, name: str):
    """A non-trainable float32 variable ``(size,)``: 1 at ``rank``, 0 elsewhere (a rank's flag
    in a vector that an all-reduce sums over ranks)."""
    flags = np.zeros(size, np.float32)
    flags[rank] = 1.0
    return keras.Variable(flags, dtype="float32", trainable=False, name=name)


class NonFiniteGuard:
    """Skips, on every rank together, an optimizer step whose gradients were NaN/Inf on any rank.

    Installed by :func:`distribute` (``on_nonfinite=``). In the step's grouped all-reduce each
    rank also sends a vector of ``size`` flags (1 at its own rank when its local gradients are
    not finite), so every rank learns which ranks were bad from the same all-reduce. The decision
    is taken on the all-reduced gradients, which are identical on every rank: when they are not
    finite, no rank applies the step (weights, slots and weight decay stay as they were; the
    gradient accumulators are zeroed; an EMA of the weights, if the optimizer keeps one, still
    moves), the optimizer's step counter still advances (the LR schedule follows the step, as in
    the PyTorch trainer) and ``skipped`` grows by one. Ranks never diverge. Under a
    ``LossScaleOptimizer`` (:class:`LossScaleHooks`) it counts skipped micro-batches instead.

    With ``size=None`` (elastic training, where ranks are renumbered and the size changes at
    each reset while the traced step stays as it was) each rank sends one number instead, "my
    gradients were not finite", whose shape does not depend on the size: ``bad_ranks`` then holds
    only the number of bad ranks as the step was traced, and the caller names the ranks eagerly
    after a skipped step (:func:`hvdtrain.keras.adapter.ranks_where`).

    Attributes:
        mode: ``"skip"`` or ``"stop"`` (stop is carried out by the callback of :func:`callbacks`).
        size: ranks the flag vector has (None: one flag, see above).
        skipped: variable (int64), steps skipped so far.
        bad_ranks: variable ``(size,)`` float32, 1 for the ranks of the last skipped step
            (``(1,)`` with ``size=None``).
        bad_step: variable (int64), the optimizer step last skipped (-1: none).
    """

    def __init__(self, mode: str, size: int | None):
        self.mode, self.size = mode, size
        self.skipped = keras.Variable(0, dtype="int64", trainable=False, name="hvdtrain_skipped")
        self.bad_ranks = keras.Variable(np.zeros(size or 1, np.float32), trainable=False,
                                        name="hvdtrain_bad_ranks")
        self.bad_step = keras.Variable(-1, dtype="int64", trainable=False,
                                       name="hvdtrain_bad_step")

    def record(self, flags, step) -> None:
        self.skipped.assign(self.skipped + 1)
        self.bad_ranks.assign(flags)
        self.bad_step.assign(ops.cast(step, "int64"))


class PreemptFlags:
    """The preemption flags that ride in every optimizer step's grouped gradient all-reduce
    (:mod:`hvdtrain.run.preempt`): each rank puts ``[SIGTERM seen, SIGUSR1 seen]`` into
    ``requested`` (the trainer's callback does, when a signal came), and after the step
    ``agreed`` holds the sum over ranks, kept once set. ``agreed`` is equal on every rank after
    every step, so all ranks stop after the same one. Two numbers more in an all-reduce the step
    runs anyway: no extra collective. ``hvdtrain train`` installs them
    (``optimizer.hvdtrain_allreduce.preempt = PreemptFlags()``, before ``fit`` traces the step).

    Attributes:
        requested: variable ``(2,)`` float32, this rank's flags.
        agreed: variable ``(2,)`` float32, the all-reduced flags (sums over ranks).
    """

    def __init__(self):
        self.requested = keras.Variable(np.zeros(2, np.float32), trainable=False,
                                        name="hvdtrain_preempt_requested")
        self.agreed = keras.Variable(np.zeros(2, np.float32), trainable=False,
                                     name="hvdtrain_preempt_agreed")


class GradientAllreduce:
    """The hooks :func:`distribute` puts on a Keras 3 optimizer (the instance only, so its class,
    config and saved files stay the optimizer's own).

    Keras calls ``_clip_gradients`` exactly once per optimizer step, with the step's gradients
    (with ``gradient_accumulation_steps=k``: the mean of the k micro-batch gradients), before the
    weight decay and the update. There the gradients go through one grouped all-reduce (average
    over ranks), so clipping then sees the global gradient, as in single-process training. With a
    :class:`NonFiniteGuard`, the weight decay and the update run only when the all-reduced
    gradients are finite.

    With ``overlap`` on Keras's torch backend (one backward pass per step, no loss-scale
    optimizer) the gradients' all-reduces start during the backward pass instead
    (:class:`~hvdtrain.keras.overlap.BackwardAllreduce`); ``clip_gradients`` waits for them and
    reduces only what is left (the guard's and the preemption flags, gradients no hook saw) in
    the grouped all-reduce.
    """

    def __init__(self, optimizer, compression: str, predivide: float,
                 guard: NonFiniteGuard | None, rank: int, size: int, elastic: bool = False,
                 overlap: bool = False):
        self.opt, self.compression, self.predivide = optimizer, compression, predivide
        self.guard, self.rank, self.size = guard, rank, size
        # One rank, for good (not elastic, where workers may join): the average over ranks is
        # the tensor itself, so the step makes no collective (np=1 costs what the plain loop does).
        self.alone = size == 1 and not elastic
        self.preempt: PreemptFlags | None = None  # set before the step is traced (the trainer)
        cls = type(optimizer)
        self._clip, self._decay = cls._clip_gradients, cls._apply_weight_decay
        self._update = cls._backend_update_step
        self._finite = None
        # This rank's one-hot flag vector, made once: ops.one_hot(rank, size) in the step would
        # make a tensor from the Python rank every step (on a GPU, a host synchronisation).
        self._own = (own_rank_vector(rank, size, "hvdtrain_own_rank")
                     if guard is not None and guard.size is not None else None)
        optimizer._clip_gradients = self.clip_gradients
        optimizer._apply_weight_decay = self.apply_weight_decay
        optimizer._backend_update_step = self.backend_update_step
        self.overlap = None
        if overlap and not self.alone and B.NAME == "torch":
            from hvdtrain.keras.overlap import BackwardAllreduce
            self.overlap = BackwardAllreduce(compression, predivide, guard is not None)
            self._scale_loss = cls.scale_loss
            optimizer.scale_loss = self.scale_loss

    def clip_gradients(self, grads):
        if self.alone and self.guard is None and self.preempt is None:
            return self._clip(self.opt, grads)  # nothing to reduce or check: Keras's own step
        grads = [None if g is None else B.native(g) for g in grads]
        pending, early_bad = range(len(grads)), None
        if self.overlap is not None:  # torch backend: all-reduces started during backward
            if self.overlap.armed:
                done, pending = self.overlap.collect(grads)
                early_bad = self.overlap.local_bad
                grads = [g if d is None else d for g, d in zip(grads, done)]
            else:
                self.overlap.register(self.opt._trainable_variables)  # (distribute did)
        index = [i for i in pending if grads[i] is not None]
        dense = [grads[i] for i in index]
        every = [g for g in grads if g is not None]
        dtype = every[0].dtype if every else "float32"
        extra = []
        if self.guard is not None:
            checks = [B.finite(g) for g in dense]
            if early_bad is not None:
                checks.append(ops.logical_not(early_bad))
            bad = ops.cast(ops.logical_not(ops.all(ops.stack(checks))), dtype)
            flags = (ops.reshape(bad, (1,)) if self._own is None else
                     ops.cast(self._own, dtype) * bad)
            extra = [B.native(flags)]
        if self.preempt is not None:
            extra.append(B.native(ops.cast(self.preempt.requested, dtype)))
        reduced = dense + extra if self.alone else B.grouped_average(
            dense + extra, self.compression, self.predivide, name="hvdtrain.gradients")
        if self.preempt is not None:
            summed = ops.cast(reduced[-1], "float32") * float(self.size)
            self.preempt.agreed.assign(ops.maximum(self.preempt.agreed, summed))
            reduced = reduced[:-1]
        if self.guard is not None:
            self._flags = ops.cast(reduced[-1], "float32") * float(self.size)
            reduced = reduced[:-1]
        for i, g in zip(index, reduced):
            grads[i] = g
        if self.guard is not None:
            self._finite = ops.all(ops.stack([B.finite(g)
                                              for g in grads if g is not None]))
            # Read once here on torch eager, where ops.cond is a Python `if` (which takes the
            # bool as it is): the decay's and the update's cond would each read the tensor.
            if torch_eager():
                self._finite = bool(self._finite)
        return self._clip(self.opt, grads)

    def scale_loss(self, loss):
        """Keras's ``scale_loss``, called by the torch trainer right before ``backward``: arm
        the backward-pass all-reduces (:class:`~hvdtrain.keras.overlap.BackwardAllreduce`)."""
        self.overlap.arm()
        return self._scale_loss(self.opt, loss)

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
            # Keras then resets the accumulators; the torch backend does it by multiplying them
            # by 0, which leaves NaN as NaN: set them to 0 here, so the next group starts clean.
            zero_accumulators(self.opt)

        return ops.cond(finite,
                        lambda: self._update(self.opt, grads, trainable_variables, learning_rate),
                        skip)


class LossScaleHooks:
    """What :func:`distribute` adds to a ``LossScaleOptimizer`` (fp16): its overflow check made
    global, and overflows told apart from failures.

    Keras calls the optimizer's ``scale_loss(loss)`` with each micro-batch's loss; the hook notes
    whether this rank's loss was finite. ``check_finite(grads)`` (called by the loss-scale
    optimizer for every micro-batch) then all-reduces ``size + 1`` numbers: this rank's
    "gradients finite" flag and a vector with 1 at its rank when its loss was not finite. The step
    is applied only when every rank's gradients were finite, so the ranks take the same branch
    (the same collectives) and keep the same loss scale. A skipped micro-batch whose losses were
    all finite is an fp16 overflow (``overflows`` grows); one with a non-finite loss on some rank
    is a failure, recorded in the :class:`NonFiniteGuard` when there is one (``on_nonfinite``).
    Either way Keras halves the loss scale. Skipped micro-batches do not advance
    ``optimizer.iterations`` (Keras's loss-scale optimizer does not apply them).

    Attributes:
        overflows: variable (int64), micro-batches skipped for an fp16 overflow.
    """

    def __init__(self, lso, guard: NonFiniteGuard | None, rank: int, size: int):
        self.lso, self.guard, self.rank, self.size = lso, guard, rank, size
        self._check, self._scale = type(lso).check_finite, type(lso).scale_loss
        self.overflows = keras.Variable(0, dtype="int64", trainable=False,
                                        name="hvdtrain_overflows")
        self.loss_finite = keras.Variable(1.0, dtype="float32", trainable=False,
                                          name="hvdtrain_loss_finite")
        self._own = own_rank_vector(rank, size, "hvdtrain_loss_scale_own_rank")
        lso.scale_loss = self.scale_loss
        lso.check_finite = self.check_finite

    def scale_loss(self, loss):
        self.loss_finite.assign(ops.cast(ops.all(ops.isfinite(loss)), "float32"))
        return self._scale(self.lso, loss)

    def check_finite(self, grads):
        local = ops.cast(self._check(self.lso, grads), "float32")
        # Python numbers only in native arithmetic and comparisons (no tensor made from them
        # each step; on a GPU that is a host synchronisation).
        bad_loss = B.native(self._own) * (1.0 - B.native(self.loss_finite))
        flags = ops.concatenate([ops.reshape(local, (1,)), bad_loss])
        mean = B.grouped_average([B.native(flags)], name="hvdtrain.finite")[0]
        finite = mean[0] * float(self.size) > float(self.size) - 0.5  # on all ranks
        bad_ranks = ops.cast(mean[1:], "float32") * float(self.size)
        failed = ops.sum(bad_ranks) > 0.5
        if torch_eager():  # read once: this branch and the LossScaleOptimizer's reuse it
            finite = bool(finite)

        def not_finite():
            if self.guard is not None:
                ops.cond(failed, lambda: self.guard.record(bad_ranks, self.lso.iterations),
                         lambda: None)
            self.overflows.assign(self.overflows + ops.cast(ops.logical_not(failed), "int64"))

        ops.cond(finite, lambda: None, not_finite)
        return finite  # a bool on torch eager: Keras's LossScaleOptimizer branches on it alike


def micro_batch_count(optimizer) -> int:
    """Micro-batches the distributed optimizer has applied or accumulated (Keras's internal
    counter; with k > 1 ``optimizer.iterations`` counts optimizer steps; under a
    ``LossScaleOptimizer`` skipped micro-batches are not counted)."""
    return int(ops.convert_to_numpy(inner(optimizer)._iterations))


def set_micro_batch_count(optimizer, count: int, reset_groups: bool = False) -> None:
    """Set the micro-batch counter (a resumed run's position; the LR schedule follows it);
    ``reset_groups``: also empty the gradient accumulators (an open group does not carry over)."""
    inner(optimizer)._iterations.assign(int(count))
    if reset_groups:
        zero_accumulators(optimizer)
