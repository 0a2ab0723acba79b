"""The Keras variants of ``benchmarks/gpu.py``: Keras 3 on its PyTorch backend (the GPU path: a
GPU build of Horovod has no TensorFlow ops), plain ``model.fit`` against the same ``fit`` through
``hvdtrain.keras`` (``init``, ``distribute``, k=1), on the benchmark models of
:func:`hvdtrain.keras.models.bench_model` with synthetic data.

These models are small: on a GPU their step is a few milliseconds of kernel launches, so what the
adapter adds to a step's Python shows up here first (a ResNet-50 step hides it). Variants are
named ``keras_<model>``: ``keras_mnist``, ``keras_cnn``, ``keras_dense``, ``keras_gpt``.
"""
from __future__ import annotations

import os
import time

import synthetic  # benchmarks/synthetic.py: the synthetic batches and Keras's endless dataset

PREFIX = "keras_"
MODELS = synthetic.MODELS
VARIANTS = tuple(PREFIX + m for m in MODELS)


def backend_problem() -> str | None:
    """Why the keras_* variants cannot run here, or None: they compare the PyTorch-backend loops
    (a GPU build of Horovod has no TensorFlow ops), so ``KERAS_BACKEND`` must be unset or
    ``torch``."""
    backend = os.environ.get("KERAS_BACKEND", "torch")
    if backend == "torch":
        return None
    return (f"the keras_* variants run Keras on its PyTorch backend, but KERAS_BACKEND is "
            f"{backend!r}: unset it or set KERAS_BACKEND=torch")


def use_torch_backend(device: str) -> None:
    """Make Keras run on PyTorch, on ``device`` (``"cuda"`` or ``"cpu"``,
    :func:`hvdtrain.runtime.use_keras_torch_device`); call before ``import keras`` (after
    :func:`backend_problem` found nothing)."""
    from hvdtrain import runtime
    os.environ["KERAS_BACKEND"] = "torch"
    runtime.use_keras_torch_device(device)


class KerasRunner:
    """One ``keras_<model>`` variant through one loop (``plain`` or ``hvdtrain``), with the
    interface of ``gpu.Runner``: ``block(args)`` returns the seconds of ``args.iters`` timed
    iterations of ``args.batches_per_iter`` steps each.

    A block is ONE ``model.fit`` call over an endless dataset of the same batch (as users train:
    ``fit``'s set-up once per block, not per step); a callback synchronises the device and takes
    the time at the iteration boundaries (the warmup's last step, then every
    ``batches_per_iter`` steps).
    """

    def __init__(self, args, variant: str, loop: str, device):
        import keras
        import torch

        import hvdtrain.keras as hk
        from hvdtrain.keras.models import bench_model

        name = variant[len(PREFIX):]
        keras.utils.set_random_seed(0)  # both loops start from the same weights
        model = bench_model(name, image_size=args.image_size)
        optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
        if loop == "hvdtrain":
            model, optimizer = hk.distribute(model, optimizer, backward_passes_per_step=1)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = synthetic.same_batch_forever(*synthetic.synthetic_batch(
            name, args.batch_size, args.image_size, channels_last=True))
        sync = ((lambda: torch.cuda.synchronize(device)) if device.type == "cuda"
                else (lambda: None))

        class Clock(keras.callbacks.Callback):
            def __init__(self, marks: set[int]):
                super().__init__()
                self.marks, self.times = marks, []

            def on_train_batch_end(self, batch, logs=None):
                if batch in self.marks:
                    sync()  # time what the device did, not what was queued
                    self.times.append(time.perf_counter())

        self.model, self.data, self.clock = model, data, Clock
        self.sync = sync

    def block(self, args) -> list[float]:
        """Warm up, then time ``args.iters`` iterations in the same ``fit``; their seconds."""
        warm, per = max(1, args.warmup), args.batches_per_iter
        clock = self.clock({warm - 1 + i * per for i in range(args.iters + 1)})
        self.model.fit(self.data, epochs=1, steps_per_epoch=warm + args.iters * per, verbose=0,
                       callbacks=[clock])
        return [b - a for a, b in zip(clock.times, clock.times[1:])]
