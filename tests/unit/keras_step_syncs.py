"""Counts, per training step of Keras 3 on its PyTorch backend (run on the CPU), the ops that are
host synchronisations when the step runs on a GPU: a tensor made from a Python number or list
(``aten.lift_fresh``: ``torch.as_tensor(x, device="cuda")`` copies from the host and waits for
every queued kernel, PyTorch issues #120996 and #190217) and a number or bool read from a tensor
(``aten._local_scalar_dense``: ``.item()``, ``bool()``). The learning-rate schedule takes its
GPU path (its tensor rule, with a cosine decay), as it does where Keras's variables are on a GPU.

With ``--cuda`` (tests/gpu) the step runs on the GPU, the schedule takes the path it takes there
by itself, and the synchronisations PyTorch itself reports are counted too
(``torch.cuda.set_sync_debug_mode``: "called a synchronizing CUDA operation"), as ``"cuda"``.

Run by tests/unit/test_host_syncs.py in a fresh interpreter (KERAS_BACKEND=torch before Keras is
imported)::

    KERAS_BACKEND=torch python tests/unit/keras_step_syncs.py OUT.json [--cuda]

Writes ``{variant: {"lift_fresh": per step, "_local_scalar_dense": per step}}`` for the plain
Keras step and ``distribute``'s (alone, and with the non-finite guard and the preemption flags
that ``hvdtrain train`` installs), both again under a ``LossScaleOptimizer`` (fp16's; its
overflow check is all-reduced), and per call for ``hvdtrain train``'s loss against Keras's.
At one rank (no all-reduce: at np > 1 Horovod's all-reduce itself waits for the GPU).
"""
from __future__ import annotations

import collections
import json
import sys
import warnings

import keras
import numpy as np
from torch.utils._python_dispatch import TorchDispatchMode

import hvdtrain.keras as hk
from hvdtrain import schedule
from hvdtrain.keras import scheduler
from hvdtrain.keras.optimizer import PreemptFlags, schedule_of
from hvdtrain.keras.trainer import TrainLoss

OPS = ("aten.lift_fresh", "aten._local_scalar_dense")
STEPS = 6


CUDA = "--cuda" in sys.argv


class Count(TorchDispatchMode):
    """Counts the ops in :data:`OPS` run inside it, and on a GPU (:data:`CUDA`) the host
    synchronisations PyTorch reports (``counts["cuda"]``)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        if CUDA:
            import torch
            self._warnings = warnings.catch_warnings(record=True)
            self._seen = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if CUDA:
            import torch
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self.counts["cuda"] = sum("synchronizing CUDA operation" in str(w.message)
                                      for w in self._seen)
        return out


def per(counts: collections.Counter, n: int) -> dict:
    out = {name.split(".", 1)[1]: counts[name] / n for name in OPS}
    if CUDA:
        out["cuda"] = counts["cuda"] / n
    return out


def model_and_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = np.arange(64, dtype=np.int64) % 4
    return model, x, y


def steps(variant: str) -> dict:
    model, x, y = model_and_data()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if variant.endswith("loss scale"):  # fp16's optimizer (its float32 step here)
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    if not variant.startswith("plain"):
        model, optimizer = hk.distribute(
            model, optimizer, on_nonfinite="skip" if variant == "train" else None)
        schedule_of(optimizer).set_decay(schedule.decay("cosine", epochs=2, steps_per_epoch=50,
                                                        warmup_epochs=1))
        if variant == "train":  # what hvdtrain train adds (hvdtrain.keras.trainer)
            optimizer.hvdtrain_allreduce.preempt = PreemptFlags()
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)  # built, warm
    with Count() as mode:
        for _ in range(STEPS):
            model.train_on_batch(x[:16], y[:16])
    return per(mode.counts, STEPS)


def loss_calls() -> dict:
    model, x, y = model_and_data()
    logits, labels = model(x[:16]), keras.ops.convert_to_tensor(y[:16])  # as fit passes them
    base = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours = TrainLoss(keras.optimizers.SGD(0.01), 1, 0, None)
    out = {}
    for name, loss in (("keras loss", base), ("train loss", ours)):
        loss(labels, logits)
        with Count() as mode:
            for _ in range(STEPS):
                loss(labels, logits)
        out[name] = per(mode.counts, STEPS)
    return out


def main(path: str) -> None:
    assert keras.backend.backend() == "torch", "run with KERAS_BACKEND=torch"
    if CUDA:
        from keras.src.backend.torch.core import get_device
        assert str(get_device()).startswith("cuda"), f"Keras computes on {get_device()}"
    else:
        scheduler._torch_eager_on_cpu = lambda variable: False  # the schedule's GPU path
    hk.init(seed=0)
    out = {variant: steps(variant) for variant in (
        "plain", "distribute", "train", "plain, loss scale", "distribute, loss scale")}
    out.update(loss_calls())
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
