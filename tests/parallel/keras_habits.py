"""Keras users' own code around hvdtrain.keras.distribute, on real ranks and either backend:
a model saved by a distributed run and loaded with keras.models.load_model, distribute() after
fit() already ran, steps_per_execution, Keras's LearningRateScheduler and ReduceLROnPlateau, and
fit()/evaluate() of a sharded dataset without steps_per_epoch. Rank 0 writes what it saw as
JSON; tests/parallel/test_existing_code.py asserts on it.

Launch::

    KERAS_BACKEND=torch horovodrun -np 2 python tests/parallel/keras_habits.py --out r.json
"""
import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvdtrain.keras as hk  # noqa: E402
from hvdtrain.keras import collectives as B  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(0)
X = rng.standard_normal((96, 6)).astype("float32")  # 48 a rank: 6 batches of 8 an epoch
Y = rng.integers(0, 3, 96)


def build(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    return model


def flat(model):
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])


def spread(model):
    values = flat(model)
    return float(max(np.abs(v - values).max() for v in B.allgather_object(values)))


def lr(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def data():
    return hk.shard_dataset(X, Y, batch_size=8, seed=1)


def saved_and_loaded(rank):
    """Distributed run -> model.save -> load_model -> distribute again: the rate stays."""
    model, optimizer = hk.distribute(build(), keras.optimizers.SGD(0.02, momentum=0.9))
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(data(), epochs=1, verbose=0)  # no steps_per_epoch: one epoch of the shard
    path = os.path.join(tempfile.mkdtemp(), f"rank{rank}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_lr = lr(loaded.optimizer)
    loaded, optimizer = hk.distribute(loaded, loaded.optimizer)
    loaded.fit(data(), epochs=1, verbose=0)
    return {"saved": lr(model.optimizer), "loaded": loaded_lr, "distributed": lr(optimizer),
            "class": type(loaded.optimizer).__mro__[1].__name__, "spread": spread(loaded)}


def distribute_after_fit(rank):
    """fit() on each rank's own data, then distribute() and fit() again, no compile between."""
    model = build(seed=rank)
    optimizer = keras.optimizers.SGD(0.02)
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(X[rank::2], Y[rank::2], batch_size=8, epochs=1, verbose=0)
    model, optimizer = hk.distribute(model, optimizer)
    model.fit(data(), epochs=1, verbose=0)
    other = {}
    try:
        hk.distribute(build(), keras.optimizers.SGD(0.1))  # fine: not compiled yet
        compiled = build()
        compiled.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
        hk.distribute(compiled, keras.optimizers.SGD(0.1))
    except ValueError as exc:
        other = str(exc)
    return {"spread": spread(model), "other_optimizer": other}


def steps_per_execution(chunk):
    """Two epochs of the sharded dataset with steps_per_execution=chunk: the micro-batches run
    and the weights (or the error)."""
    model, optimizer = hk.distribute(build(), keras.optimizers.SGD(0.02, momentum=0.9))
    model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=chunk)
    try:
        model.fit(data(), epochs=2, steps_per_epoch=6, verbose=0)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"micro_batches": hk.micro_batch_count(optimizer), "weights": flat(model).tolist()}


def lr_callbacks():
    """Keras's own rate callbacks on the distributed optimizer (0.01 x 2 ranks = 0.02)."""
    seen = {}
    for name, callback in (
            ("scheduler", keras.callbacks.LearningRateScheduler(
                lambda epoch, rate: rate if epoch == 0 else rate * 0.5)),
            ("plateau", keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5,
                                                          patience=0, min_delta=1e9))):
        model, optimizer = hk.distribute(build(), keras.optimizers.SGD(0.01, momentum=0.9))
        model.compile(optimizer=optimizer, loss=LOSS)
        rates = []
        record = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: rates.append(lr(optimizer)))
        model.fit(data(), epochs=3, verbose=0, callbacks=[callback, record])
        seen[name] = {"rates": rates, "spread": spread(model)}
    return seen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = hk.init(seed=0)
    result = {"size": info.size, "backend": hk.backend(),
              "loaded": saved_and_loaded(info.rank),
              "after_fit": distribute_after_fit(info.rank),
              "chunks": {str(c): steps_per_execution(c) for c in (1, 3, 4)},
              "lr_callbacks": lr_callbacks()}
    model, optimizer = hk.distribute(build(), keras.optimizers.SGD(0.02))
    model.compile(optimizer=optimizer, loss=LOSS)
    data_ = data()
    history = model.fit(data_, epochs=1, validation_data=data(), verbose=0)
    result["no_steps"] = {"micro_batches": hk.micro_batch_count(optimizer),
                          "steps_per_epoch": data_.steps_per_epoch,
                          "evaluated": float(model.evaluate(data_, verbose=0)),
                          "val_loss": float(history.history["val_loss"][0])}
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
