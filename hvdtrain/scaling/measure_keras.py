"""Keras 3 compute profiles for :mod:`hvdtrain.scaling.model` (the backend ``KERAS_BACKEND``
names).

A Keras profile times whole optimizer steps (``model.fit`` over one in-memory batch repeated, a
callback taking ``time.perf_counter()`` at each step's end, the mean of the steps after
``warmup``). On the TensorFlow backend ``model.fit`` computes all gradients and applies them at
once, and ``hvdtrain.keras`` all-reduces them together in the optimizer's ``apply``: the step is
split 1 : 2 between forward and backward and every gradient is ready at the end of the backward
pass (nothing overlaps, which is what happens). On the PyTorch backend ``hvdtrain.keras``
all-reduces each gradient as autograd finishes it (:mod:`hvdtrain.keras.overlap`), so the
profile is measured as the PyTorch one is: the backward pass starts at the optimizer's
``scale_loss`` (Keras's torch trainer calls it right before ``backward``), each gradient is
ready when its post-accumulate-grad hook fires, and the optimizer step is the rest.

A user model is ``module:function``; ``function(batch_size)`` (or ``function()``) returns
``(model, loss, (inputs, targets))`` with a Keras model and a Keras loss (object or name).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import time

from hvdtrain.scaling.measure import (BUILTIN, background_copies, load_builder, mean_time,
                                      robust_std, timed_profile)
from hvdtrain.scaling.model import ComputeProfile, Gradient


def builtin_keras(name: str, batch_size: int):
    """``(model, loss, (x, y))`` of a benchmark model (:func:`hvdtrain.keras.models.bench_model`,
    channels-last) on a random batch, as ``benchmarks/synthetic.py`` makes it."""
    import keras
    import numpy as np

    from hvdtrain.keras.models import bench_model
    from hvdtrain.torch.models import GPT_CONTEXT, GPT_VOCAB
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "gpt":
        x = rng.integers(0, GPT_VOCAB, (batch_size, GPT_CONTEXT)).astype("int32")
        y = rng.integers(0, GPT_VOCAB, (batch_size, GPT_CONTEXT)).astype("int32")
    else:
        shape = (batch_size, 28, 28, 1) if name == "mnist" else (batch_size, 32, 32, 3)
        x = rng.standard_normal(shape).astype("float32")
        y = rng.integers(0, 10, (batch_size,)).astype("int32")
    return (bench_model(name), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            (x, y))


def _build(spec: str, batch_size: int, threads: int | None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    if threads:
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        elif keras.backend.backend() == "torch":
            import torch
            torch.set_num_threads(threads)
    if spec in BUILTIN:
        model, loss, (x, y) = builtin_keras(spec, batch_size)
    else:
        model, loss, (x, y) = load_builder(spec)(batch_size)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss,
                  jit_compile=False)

    class Same(keras.utils.PyDataset):
        """The same batch, endlessly."""

        @property
        def num_batches(self):
            return None

        def __getitem__(self, i):
            return x, y

    return keras, model, Same()


def measure_keras(spec: str, batch_size: int, threads: int | None = None, warmup: int = 5,
                  repeats: int = 20) -> ComputeProfile:
    """Time one rank's optimizer step of ``spec`` with ``model.fit`` on this machine.

    Returns:
        a :class:`ComputeProfile`: on TensorFlow every gradient ready at the end of the
        backward pass; on PyTorch each when autograd finished it (the module docstring).
    """
    keras, model, data = _build(spec, batch_size, threads)
    times: list[float] = []
    marks = _torch_marks(model) if keras.backend.backend() == "torch" else None

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())
            if marks is not None:
                marks.append({})

    model.fit(data, epochs=1, steps_per_epoch=warmup + repeats + 1, verbose=0,
              callbacks=[Clock()])
    steps = [b - a for a, b in zip(times[warmup:], times[warmup + 1:])]
    if marks is not None:  # marks[i + 1]: the step that ended at times[i + 1]
        return _torch_profile(model, batch_size, times, marks, warmup, steps,
                              f"measured here: Keras torch {spec}, batch {batch_size}, "
                              f"{threads or 'default'} threads, fit steps with hooks")
    step = mean_time(steps)
    forward, backward = step / 3, step - step / 3
    grads = tuple(Gradient(v.path, math.prod(v.shape) * 4, backward)
                  for v in reversed(model.trainable_variables))
    return ComputeProfile(batch_size, forward, backward, 0.0, grads,
                          f"measured here: Keras {keras.backend.backend()} {spec}, batch "
                          f"{batch_size}, {threads or 'default'} threads, whole fit steps "
                          "(split 1:2, gradients ready at the end)", robust_std(steps))


def _torch_marks(model) -> list[dict]:
    """Hooks that note, per step, when the backward pass starts (the optimizer's
    ``scale_loss``, key None) and when each trainable variable's gradient is final."""
    marks: list[dict] = [{}]
    opt = model.optimizer
    scale = opt.scale_loss

    def scale_loss(loss):
        marks[-1][None] = time.perf_counter()
        return scale(loss)

    opt.scale_loss = scale_loss
    for v in model.trainable_variables:
        def hook(_p, path=v.path):
            marks[-1][path] = time.perf_counter()
        v.value.register_post_accumulate_grad_hook(hook)
    return marks


def _torch_profile(model, batch_size: int, times: list[float], marks: list[dict], warmup: int,
                   steps: list[float], source: str) -> ComputeProfile:
    """The profile of Keras torch steps from :func:`_torch_marks`, over the steps after
    ``warmup`` (:func:`~hvdtrain.scaling.measure.timed_profile`): forward (step start to
    backward start), backward (to the last gradient), the optimizer (the rest) and each
    gradient's ready time."""
    fwd, bwd, opt, ready = [], [], [], {v.path: [] for v in model.trainable_variables}
    for i in range(warmup, len(times) - 1):
        m, start, end = marks[i + 1], times[i], times[i + 1]
        t0 = m.get(None)
        if t0 is None:
            continue
        last = max((t for k, t in m.items() if k is not None), default=t0)
        fwd.append(t0 - start)
        bwd.append(last - t0)
        opt.append(end - last)
        for path in ready:
            ready[path].append(m.get(path, last) - t0)
    return timed_profile(batch_size, fwd, bwd, opt,
                         {v.path: (math.prod(v.shape) * 4, ready[v.path])
                          for v in model.trainable_variables}, steps, source)


def keras_gradient_sizes(spec: str) -> list[tuple[str, int]]:
    """``[(path, bytes)]`` of the Keras model's trainable variables, output end first."""
    _, model, _ = _build(spec, 1, None)
    return [(v.path, math.prod(v.shape) * 4) for v in reversed(model.trainable_variables)]


def _load(spec, batch_size, threads, started, stop) -> None:
    """A background copy of the fit step, until ``stop``."""
    _, model, data = _build(spec, batch_size, threads)
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    started.release()
    while not stop.is_set():
        model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)


def _measure_child(spec, batch_size, threads, warmup, repeats, queue) -> None:
    try:
        queue.put(measure_keras(spec, batch_size, threads, warmup, repeats))
    except BaseException as e:  # noqa: BLE001 - handed to the parent as text
        queue.put(f"{type(e).__name__}: {e}")


def measure_keras_side_by_side(spec: str, batch_size: int, threads: int, copies: int,
                               warmup: int = 5, repeats: int = 20) -> ComputeProfile:
    """:func:`measure_keras` while ``copies - 1`` other processes run the same fit step. Every
    copy, the measured one included, runs in a process of its own: TensorFlow fixes its thread
    pools once per process.

    Raises:
        RuntimeError: a copy failed or did not start in 300 s.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with background_copies(_load, (spec, batch_size, threads), copies - 1):
        child = ctx.Process(target=_measure_child,
                            args=(spec, batch_size, threads, warmup, repeats, queue), daemon=True)
        child.start()
        profile = queue.get(timeout=600)
        child.join(timeout=60)
    if isinstance(profile, str):
        raise RuntimeError(f"measuring {spec} failed: {profile}")
    suffix = f", {copies} copies side by side" if copies > 1 else ""
    return ComputeProfile(profile.batch_size, profile.forward_s, profile.backward_s,
                          profile.optimizer_s, profile.gradients, profile.source + suffix,
                          profile.jitter_s)
