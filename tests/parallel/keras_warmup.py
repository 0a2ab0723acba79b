"""Records the learning rate the optimizer holds at every step of a Keras ``fit`` with
``hvdtrain.keras.warmup``, for SGD with momentum and for Adam.

Launch::

    horovodrun -np 2 python tests/parallel/keras_warmup.py --out lrs.json
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import hvdtrain.keras as hk  # noqa: E402
from hvdtrain.keras.models import build_model  # noqa: E402


class Record(keras.callbacks.Callback):
    """Reads (micro-batches so far, learning rate) when a batch begins: the rate the optimizer's
    schedule gives for the coming step."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer
        self.rows = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rows.append([hk.micro_batch_count(self.optimizer_),
                          float(keras.ops.convert_to_numpy(self.optimizer_.learning_rate))])


def run(make_optimizer, info, k, warmup_epochs, epochs, batch_size, samples) -> dict:
    model = build_model()
    model, optimizer = hk.distribute(model, make_optimizer(), backward_passes_per_step=k,
                                     lr_scaling="linear")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, samples)
    micro = hk.micro_batches_per_epoch(samples, batch_size, info.size, k)
    record = Record(optimizer)
    model.fit(hk.shard_dataset(x, y, batch_size=batch_size, info=info,
                               backward_passes_per_step=k), epochs=epochs,
              steps_per_epoch=micro, verbose=0,
              callbacks=[*hk.callbacks(optimizer, warmup_epochs=warmup_epochs,
                                       steps_per_epoch=micro // k), record])
    return {"rows": record.rows, "steps_per_epoch": micro // k,
            "final_iterations": hk.micro_batch_count(optimizer)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--warmup-epochs", type=float, default=2)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    info = hk.init(seed=0)
    optimizers = {"sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
                  "adam": lambda: keras.optimizers.Adam(0.001)}
    result = {name: run(make, info, args.k, args.warmup_epochs, args.epochs, 8, 160)
              for name, make in optimizers.items()}
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"size": info.size, "k": args.k, "warmup_epochs": args.warmup_epochs,
                       "base_lr": {"sgd_momentum": 0.01, "adam": 0.001}, **result}, f)


if __name__ == "__main__":
    main()
