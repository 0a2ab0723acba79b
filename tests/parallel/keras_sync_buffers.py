"""hvdtrain.keras.sync_buffers on real ranks: a BatchNormalization model trained on each rank's
own data (moving statistics drift apart), then averaged / broadcast. Rank 0 writes JSON.

Launch::

    horovodrun -np 2 python tests/parallel/keras_sync_buffers.py --out result.json
"""
import argparse
import json

import numpy as np
import keras

import hvdtrain.keras as hk
from hvdtrain.keras.collectives import allgather_object


def stats(model):
    return np.concatenate([keras.ops.convert_to_numpy(v).ravel()
                           for v in model.non_trainable_variables])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = hk.init(seed=3)
    rng = np.random.default_rng(10 + info.rank)  # each rank its own data
    x = rng.normal(size=(64, 6, 6, 2)).astype("float32") * (1 + info.rank)
    y = rng.integers(0, 3, size=64)
    result = {"size": info.size, "device": info.device}
    for op in ("average", "broadcast"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Conv2D(4, 3),
                                     keras.layers.BatchNormalization(),
                                     keras.layers.Flatten(), keras.layers.Dense(3)])
        model.build((None, 6, 6, 2))
        model, optimizer = hk.distribute(model, keras.optimizers.SGD(0.05),
                                         lr_scaling="none")
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        before = allgather_object(stats(model).tolist(), name=f"before.{op}")
        count = hk.sync_buffers(model, op=op)
        after = allgather_object(stats(model).tolist(), name=f"after.{op}")
        before, after = np.array(before), np.array(after)
        expected = before.mean(0) if op == "average" else before[0]
        result[op] = {"variables": count,
                      "spread_before": float(np.abs(before[0] - before[1]).max()),
                      "spread_after": float(np.abs(after[0] - after[1]).max()),
                      "diff_to_expected": float(np.abs(after[0] - expected).max())}
    logs = {"loss": float(info.rank), "accuracy": 2.0 * info.rank}  # each rank its own numbers
    hk.MetricAverageCallback().on_epoch_end(0, logs)
    result["averaged_logs"] = logs
    callback_ops = [type(c).__name__ for c in hk.callbacks(optimizer)]
    result["callbacks"] = callback_ops
    if info.is_root:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
