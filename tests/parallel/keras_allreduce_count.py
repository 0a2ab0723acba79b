"""Counts the gradient all-reduce operations Horovod executes in one Keras epoch, for
backward_passes_per_step k=1 and k=4, from Horovod's own timeline (``start_timeline`` /
``stop_timeline`` around the epoch; every executed ALLREDUCE of a gradient tensor).

Launch::

    horovodrun -np 2 python tests/parallel/keras_allreduce_count.py --out counts.json
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"  # allow start_timeline/stop_timeline

import numpy as np  # noqa: E402
import keras  # noqa: E402

import hvdtrain.keras as hk  # noqa: E402
from hvdtrain.keras.collectives import hvd  # noqa: E402
from hvdtrain.timeline import count_ops, load_events  # noqa: E402
from hvdtrain.keras.models import build_model  # noqa: E402



class Timeline(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_begin(self, epoch, logs=None):
        hvd.start_timeline(self.path, mark_cycles=False)

    def on_epoch_end(self, epoch, logs=None):
        hvd.stop_timeline()


def one_epoch(k: int, info, micro_batches: int, batch_size: int, timeline: str) -> dict:
    model = build_model()
    model, optimizer = hk.distribute(model, keras.optimizers.SGD(0.01, momentum=0.9),
                                     backward_passes_per_step=k)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    samples = micro_batches * batch_size * info.size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, samples)
    model.fit(hk.shard_dataset(x, y, batch_size=batch_size, info=info,
                               backward_passes_per_step=k), epochs=1,
              steps_per_epoch=micro_batches, verbose=0, callbacks=[Timeline(timeline)])
    count = count_ops(load_events(timeline)) if info.rank == 0 else None
    return {"timeline_allreduces": count, "micro_batches": hk.micro_batch_count(optimizer),
            "parameters": len(model.trainable_variables)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = hk.init(seed=0)
    result = {f"k{k}": one_epoch(k, info, 32, 8, f"{args.out}.k{k}.timeline") for k in (1, 4)}
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
