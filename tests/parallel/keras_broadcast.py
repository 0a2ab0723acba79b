"""Ranks that build their Keras models and optimizer state from different seeds hold rank 0's
weights and optimizer variables after ``hvdtrain.keras.distribute``, and still agree after the
first batch of ``fit``.

Launch::

    horovodrun -np 2 python tests/parallel/keras_broadcast.py --out result.json
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import hvdtrain.keras as hk  # noqa: E402
from hvdtrain.keras.collectives import allgather_object  # noqa: E402


def model_with_buffers() -> keras.Model:
    layers = keras.layers
    model = keras.Sequential([layers.Conv2D(4, 3), layers.BatchNormalization(), layers.ReLU(),
                                 layers.Flatten(), layers.Dense(10)])
    model.build((None, 8, 8, 1))
    return model


def snapshot(model, optimizer) -> dict:
    value = keras.ops.convert_to_numpy
    out = {f"model.{i}.{v.path}": np.asarray(value(v), np.float64).reshape(-1)
           for i, v in enumerate(model.variables)}
    # The learning rate is not state: distribute() replaces it with its schedule.
    out.update({f"opt.{v.path}": np.asarray(value(v), dtype=np.float64).reshape(-1)
                for v in optimizer.variables if "learning_rate" not in v.path})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert len(a) == len(b), (sorted(a), sorted(b))
    return max(float(np.abs(x - y).max()) for x, y in zip(a.values(), b.values()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = hk.init(seed=100)  # each rank gets a different seed
    model = model_with_buffers()
    optimizer = keras.optimizers.Adam(1e-3)
    # A local, rank-specific step: Adam moments, step count and BatchNorm statistics differ.
    x = np.random.standard_normal((16, 8, 8, 1)).astype(np.float32)
    y = np.random.randint(0, 10, 16)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)
    model.train_on_batch(x, y)
    before = snapshot(model, optimizer)
    model, optimizer = hk.distribute(model, optimizer, lr_scaling="none")
    after = snapshot(model, optimizer)
    # One batch of fit: ranks see different data but must still hold equal weights.
    model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    after_batch = {k: v for k, v in snapshot(model, optimizer).items() if k.startswith("model.")
                   and "moving" not in k}  # BatchNorm statistics are local by design
    gathered = [allgather_object(s) for s in (before, after, after_batch)]
    later = hk.rank_info()  # what init() set up, the same fields as hvdtrain.torch's
    infos = allgather_object({"same": repr(later) == repr(info), "seed": later.seed,
                                     "hosts": later.hosts})
    if info.rank == 0:
        all_before, all_after, all_batch = gathered
        result = {
            "size": info.size,
            "keys": sorted(after),
            "spread_before": max(max_diff(b, all_before[0]) for b in all_before),
            "spread_after": max(max_diff(a, all_after[0]) for a in all_after),
            "root_changed": max_diff(all_before[0], all_after[0]),
            "spread_after_first_batch": max(max_diff(a, all_batch[0]) for a in all_batch),
            "rank_info": infos,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
