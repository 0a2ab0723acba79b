"""The Keras learning-rate schedule of a distributed optimizer: :class:`WarmupSchedule`
(world-size scaling, gradual warmup after Goyal et al. 2017 and the decay after it, evaluated
inside the train step), which :func:`hvdtrain.keras.distribute` puts into the optimizer and
:func:`hvdtrain.keras.warmup` sets. (PyTorch: :class:`hvdtrain.torch.Warmup` in
:mod:`hvdtrain.torch.scheduler`.)
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
from keras import ops

from hvdtrain import schedule

NO_BOUNDARY = 3.0e38  # a padded boundary no step reaches


def torch_eager() -> bool:
    """Keras runs on its PyTorch backend and the step is not being compiled: the step's Python
    runs every step, op by op (``jit_compile``: torch.compile traces it, and a Python number or
    bool read from a tensor would break the graph; ``torch.compiler.is_compiling`` exists from
    torch 2.3, and before it the check is skipped: such a read only costs a graph break)."""
    if keras.backend.backend() != "torch":
        return False
    import torch
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return not (compiling and compiling())


def _torch_eager_on_cpu(variable) -> bool:
    """:func:`torch_eager` and ``variable`` lives on the CPU. On a GPU the tensor rule stays:
    there each read of a number is a host synchronisation, where its ops are asynchronous kernel
    launches (Keras's Adam keeps the rate on the device)."""
    return torch_eager() and variable.value.device.type == "cpu"


@keras.saving.register_keras_serializable(package="hvdtrain")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate of a distributed optimizer, evaluated inside the training step (works
    with ``steps_per_execution``; traced on TensorFlow, with no host synchronisation; on the
    PyTorch backend on the CPU, which runs the step eagerly, a float base rate is computed in
    Python from one read of the step and returned as a float, :meth:`_eager_rate`):

    ``lr(step) = base(step) x factor x warmup_multiplier(step)``, with ``step`` the optimizer step
    (Keras's micro-batch counter ``// backward_passes_per_step``), ``base`` the user's float or
    ``LearningRateSchedule`` (called with the optimizer step, as in single-process training on
    the global batch), ``factor`` the world-size scaling (:func:`hvdtrain.schedule.scale_factor`)
    and the multiplier rising linearly from ``1/factor`` to 1 over ``warmup_steps`` optimizer
    steps (Goyal et al. 2017, gradual warmup; :func:`hvdtrain.schedule.warmup_multiplier`), then
    the decay after it (:class:`hvdtrain.schedule.Decay`, :meth:`set_decay`; constant by default).

    ``warmup_steps`` and the factor (``scale``) are variables: :func:`warmup` and elastic
    training's resets change them after the step has been compiled. So is a float base rate
    (``base_rate``): :meth:`set_rate` changes it (Keras's ``ReduceLROnPlateau`` and
    ``LearningRateScheduler`` set ``optimizer.learning_rate``, which lands there).
    """

    def __init__(self, base_lr, factor: float, backward_passes_per_step: int = 1,
                 warmup_steps: float = 0.0, decay: schedule.Decay | dict | None = None):
        if isinstance(base_lr, dict):
            base_lr = keras.saving.deserialize_keras_object(base_lr)
        # A schedule is called with the step; a float lives in a variable (set_rate changes it).
        self.base_lr = base_lr if callable(base_lr) else None
        self.base_rate = (None if callable(base_lr) else
                          keras.Variable(float(base_lr), dtype="float32", trainable=False,
                                         name="hvdtrain_base_lr"))
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.scale = keras.Variable(float(factor), dtype="float32", trainable=False,
                                    name="hvdtrain_lr_scale")
        self.warmup_steps = keras.Variable(float(warmup_steps), dtype="float32",
                                           trainable=False, name="hvdtrain_warmup_steps")
        # The decay after warmup (hvdtrain.schedule.Decay) as numbers the step reads: kind (0
        # constant, 1 cosine, 2 step), its steps, floor, factor and boundaries (padded).
        self.decay_numbers = keras.Variable(np.zeros(5, np.float32), trainable=False,
                                            name="hvdtrain_decay")
        self.decay_boundaries = keras.Variable(
            np.full(schedule.MAX_LR_STEPS, NO_BOUNDARY, np.float32), trainable=False,
            name="hvdtrain_decay_steps")
        self.decay = None
        self.set_decay(schedule.Decay(**decay) if isinstance(decay, dict) else decay)

    def set_decay(self, decay: schedule.Decay | None) -> None:
        """Decay the rate after warmup by ``decay`` (None: constant); a variable change, so it
        works after the step was compiled.

        Raises:
            ValueError: more than :data:`schedule.MAX_LR_STEPS` step boundaries.
        """
        if decay is not None and len(decay.boundaries) > schedule.MAX_LR_STEPS:
            raise ValueError(f"at most {schedule.MAX_LR_STEPS} --lr-steps; "
                             f"got {len(decay.boundaries)}")
        self.decay = decay
        d = decay or schedule.Decay()
        kind = float(schedule.LR_SCHEDULES.index(d.kind))
        self.decay_numbers.assign(np.array([kind, d.total_steps, d.warmup_steps, d.min_ratio,
                                            d.gamma], np.float32))
        padded = list(d.boundaries) + [NO_BOUNDARY] * (schedule.MAX_LR_STEPS - len(d.boundaries))
        self.decay_boundaries.assign(np.array(padded, np.float32))

    def _decay_multiplier(self, step):
        """:meth:`hvdtrain.schedule.Decay.multiplier` in the backend's ops (``step`` a float
        tensor)."""
        numbers = ops.convert_to_tensor(self.decay_numbers)
        kind, total, warm, floor, gamma = (numbers[i] for i in range(5))
        # Constants as tensors made from tensors (ones_like), never from Python numbers: on
        # Keras's PyTorch backend ops.maximum(x, 1.0) makes a tensor of 1.0 on the device each
        # call, and on a GPU that copy waits for every queued kernel (torch.as_tensor of a
        # number: a host synchronisation). Arithmetic with a number (x - 1.0) makes no tensor.
        one = ops.ones_like(step)
        span = ops.maximum(total - 1.0 - warm, one)
        p = ops.minimum(ops.maximum((step - warm) / span, one - one), one)
        cosine = floor + (1.0 - floor) * 0.5 * (1.0 + ops.cos(np.float32(np.pi) * p))
        cosine = ops.where(step < warm, one, cosine)
        passed = ops.sum(ops.cast(ops.greater_equal(step, ops.convert_to_tensor(
            self.decay_boundaries)), "float32"))
        stepped = ops.power(gamma, passed)
        return ops.where(ops.equal(kind, one), cosine,
                         ops.where(ops.equal(kind, one + one), stepped, one))

    @property
    def factor(self) -> float:
        """The world-size scaling factor (a variable, which elastic training changes on a reset)."""
        return float(ops.convert_to_numpy(self.scale))

    def __call__(self, iterations):
        if self.base_rate is not None and _torch_eager_on_cpu(self.scale):
            return self._eager_rate(iterations)
        step = ops.cast(ops.floor_divide(iterations, self.backward_passes_per_step), "float32")
        base = (self.base_lr(step) if self.base_rate is None
                else ops.convert_to_tensor(self.base_rate))
        w = ops.convert_to_tensor(self.warmup_steps)
        f = ops.convert_to_tensor(self.scale)
        ramp = (1.0 + (f - 1.0) * step / ops.maximum(w, ops.ones_like(w) * 1e-12)) / f
        multiplier = ops.where(step < w, ramp, ops.ones_like(ramp))
        return ops.cast(base, "float32") * f * multiplier * self._decay_multiplier(step)

    def _eager_rate(self, iterations) -> float:
        """The rate on Keras's PyTorch backend on the CPU, which runs the step eagerly (Python
        each step): the step and the three variables read as numbers, then the rule in Python
        (:func:`hvdtrain.schedule.scheduled_lr`); on the CPU a read is a memory load, no synchronisation. The decay comes
        from :attr:`decay`, which :meth:`set_decay` keeps with its variables (assigning
        ``decay_numbers`` directly would not reach this path). The tensor rule was 14 eager ops
        a step without a decay and 30 with one.

        Args:
            iterations: Keras's micro-batch counter (a variable, tensor or int).

        Returns:
            float: the learning rate, as the tensor rule computes it (in float64 here, the
            tensor rule in float32: they differ in the last bits).
        """
        base, warmup_steps, factor = (v.value.item() for v in
                                      (self.base_rate, self.warmup_steps, self.scale))
        count = int(getattr(iterations, "value", iterations))
        return schedule.scheduled_lr(count // self.backward_passes_per_step, base, factor,
                                     warmup_steps, 1, self.decay)

    @property
    def base(self):
        """The user's base rate now (the ``LearningRateSchedule``, or the float as
        :meth:`set_rate` last left it)."""
        return self.base_lr if self.base_rate is None else float(
            ops.convert_to_numpy(self.base_rate))

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (Python float)."""
        base = self.base
        if callable(base):
            base = float(ops.convert_to_numpy(base(float(step))))
        return schedule.scheduled_lr(step, float(base), self.factor,
                                     float(ops.convert_to_numpy(self.warmup_steps)), 1, self.decay)

    def set_rate(self, rate: float, iterations) -> None:
        """Make the rate of the current step ``rate``, keeping the warmup's shape: the base rate
        becomes ``rate / (factor x warmup multiplier now)`` (so ``rate x 0.1`` divides every
        later step's rate by 10, and a rate set to its current value changes nothing).

        Args:
            rate: the learning rate from now on, as ``optimizer.learning_rate`` reads it (scaled
                for the world size, in the warmup's current proportion).
            iterations: Keras's micro-batch counter (``optimizer.iterations`` of the inner
                optimizer's ``_iterations``).

        Raises:
            TypeError: the base rate is a ``LearningRateSchedule`` (as Keras refuses a float
                for an optimizer created with a schedule).
        """
        if self.base_rate is None:
            raise TypeError("this optimizer's base learning rate is a LearningRateSchedule, so "
                            "its rate is not settable (as in Keras): give distribute() an "
                            "optimizer created with a float learning_rate to set it from a "
                            "callback")
        now = float(ops.convert_to_numpy(self(iterations)))
        base = float(ops.convert_to_numpy(self.base_rate))
        self.base_rate.assign(float(rate) * base / now if now else float(rate))

    def get_config(self):
        base = self.base
        if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
            base = keras.saving.serialize_keras_object(base)
        return {"base_lr": base, "factor": self.factor,
                "backward_passes_per_step": self.backward_passes_per_step,
                "warmup_steps": float(ops.convert_to_numpy(self.warmup_steps)),
                "decay": dataclasses.asdict(self.decay) if self.decay is not None else None}
