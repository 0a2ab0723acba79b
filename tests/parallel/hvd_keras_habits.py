"""Horovod's own Keras layer (horovod.tensorflow.keras) with Keras 3 on real ranks: the canonical
Horovod Keras script (hvd.DistributedOptimizer, BroadcastGlobalVariablesCallback,
MetricAverageCallback, the learning-rate callbacks) through model.fit; backward_passes_per_step;
horovod.tensorflow.DistributedOptimizer given a Keras optimizer; horovod.keras and its
PartialDistributedOptimizer; a saved model loaded with and without Horovod; and what is refused.
Before scripts/horovod_patches/15-* the optimizer never all-reduced on Keras 3 (the ranks drifted
apart without a word) and the callbacks failed. Trained cases are compared with one process
training on the whole global batch. Rank 0 writes what it saw as JSON;
tests/parallel/test_existing_code.py asserts on it.

Launch::

    KERAS_BACKEND=tensorflow horovodrun -np 2 python tests/parallel/hvd_keras_habits.py \\
        --out result.json --dir DIR
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.keras as hvd_keras  # noqa: E402  (Horovod's layer for standalone Keras)
import horovod.tensorflow.keras as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

LOCAL = 8  # samples per rank and micro-batch
STEPS = 3  # optimizer updates per epoch
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def global_batches(size, passes=1):
    """STEPS global batches of LOCAL x passes x size samples, the same on every rank:
    (STEPS x LOCAL x passes x size, 6) inputs and their labels."""
    rng = np.random.default_rng(11)
    n = STEPS * LOCAL * passes * size
    return rng.standard_normal((n, 6)).astype("float32") * 2 + 1, rng.integers(0, 3, n)


def mine(x, y, rank, size, passes=1):
    """This rank's part of each global batch, in step order (``passes`` micro-batches each)."""
    block = LOCAL * passes
    pick = np.concatenate([np.arange(t * block * size + rank * block,
                                     t * block * size + (rank + 1) * block)
                           for t in range(STEPS)])
    return x[pick], y[pick]


class MySGD(keras.optimizers.SGD):
    """A user's own optimizer class (saved with its module's name; loaded through
    ``custom_optimizers``)."""


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


def flat(variables):
    return np.concatenate([np.asarray(v).ravel() for v in variables])


def fit(model, optimizer, x, y, batch, epochs=1, callbacks=()):
    model.compile(optimizer=optimizer, loss=LOSS)
    return model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks)).history


def refusal(make):
    try:
        make()
    except ValueError as e:
        return str(e)
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True, help="a folder both ranks can read (saved models)")
    args = p.parse_args()
    hvd.init()
    size, rank = hvd.size(), hvd.rank()

    def spread(values):
        everyone = hvd_tf.allgather_object(np.asarray(values))
        return float(max(np.abs(v - values).max() for v in everyone))

    def sgd(lr=0.1):
        return keras.optimizers.SGD(lr, momentum=0.9)

    def reference(lr=0.1, passes=1):
        x, y = global_batches(size, passes)
        model = build(0)
        fit(model, sgd(lr), x, y, LOCAL * passes * size)
        return flat(model.trainable_variables)

    result = {"size": size}
    x, y = global_batches(size)
    xm, ym = mine(x, y, rank, size)

    # 1. The canonical script: DistributedOptimizer and the broadcast callback, same weights.
    def trained(seed, optimizer, callbacks=(), data=(xm, ym)):
        model = build(seed)
        fit(model, optimizer, *data, LOCAL, callbacks=callbacks)
        return model, flat(model.trainable_variables)

    one = reference()  # one process, the same model and data, at the same rate
    model, w = trained(0, hvd.DistributedOptimizer(sgd()),
                       [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    result["fit"] = {"vs_reference": float(np.abs(w - one).max()), "rank_spread": spread(w),
                     "optimizer": type(model.optimizer).__name__}
    # The same through horovod.tensorflow's DistributedOptimizer (it hands Keras optimizers over).
    _, w = trained(0, hvd_tf.DistributedOptimizer(sgd()))
    result["tf_entry"] = {"vs_reference": float(np.abs(w - one).max()),
                          "rank_spread": spread(w)}
    # The same through horovod.keras, written for the standalone keras package.
    _, w = trained(0, hvd_keras.DistributedOptimizer(sgd()),
                   [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                    hvd_keras.callbacks.MetricAverageCallback()])
    result["standalone"] = {"vs_reference": float(np.abs(w - one).max()),
                            "rank_spread": spread(w)}
    # horovod.keras.PartialDistributedOptimizer: a rank-local head trains on this rank's
    # gradients alone (both ranks start from the same weights).
    model = build(0)
    head = model.layers[-1]
    fit(model, hvd_keras.PartialDistributedOptimizer(sgd(), local_layers=[head]), xm, ym, LOCAL)
    result["partial"] = {"shared_spread": spread(flat(model.layers[0].trainable_variables)),
                         "local_spread": spread(flat(head.trainable_variables))}
    # Different initial weights: the callback makes them rank 0's (after the first batch).
    _, w = trained(rank, hvd.DistributedOptimizer(sgd()),
                   [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    _, w_without = trained(rank, hvd.DistributedOptimizer(sgd()))
    result["broadcast"] = {"rank_spread": spread(w), "without_callback": spread(w_without)}

    # 2. backward_passes_per_step=2: Horovod sums the passes by default (the update of one
    #    process at twice the rate), or averages them with average_aggregated_gradients=True.
    xa, ya = global_batches(size, passes=2)
    data = mine(xa, ya, rank, size, passes=2)
    # The broadcast after the first batch (not an update) leaves each rank's accumulated pass.
    opt = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2)
    model, w = trained(0, opt, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)], data=data)
    summing = model
    result["passes_sum"] = {"vs_reference": float(np.abs(w - reference(0.2, 2)).max()),
                            "rank_spread": spread(w), "updates": int(opt.iterations)}
    opt = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    _, w = trained(0, opt, data=data)
    result["passes_mean"] = {"vs_reference": float(np.abs(w - reference(0.1, 2)).max()),
                             "rank_spread": spread(w), "updates": int(opt.iterations)}

    # 3. The callbacks: metric averaging (each rank's own loss without it), warmup and schedule.
    def history(callbacks, epochs=1):
        model = build(0)
        return fit(model, hvd.DistributedOptimizer(sgd(0.1 * size)), xm, ym, LOCAL, epochs,
                   callbacks)

    averaged = [float(v) for v in history([hvd.callbacks.MetricAverageCallback()])["loss"]]
    own = [float(v) for v in history([])["loss"]]
    result["metric_average"] = {"averaged": averaged, "averaged_spread": spread(averaged),
                                "own_mean": np.mean(hvd_tf.allgather_object(own), axis=0).tolist(),
                                "own_spread": spread(own)}
    lrs = history([hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * size,
                                                            warmup_epochs=2, steps_per_epoch=STEPS),
                   hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1 * size,
                                                              multiplier=lambda epoch: 0.5,
                                                              start_epoch=2)],
                  epochs=3)["lr"]
    result["lr_callbacks"] = {"lr": [float(v) for v in lrs], "initial_lr": 0.1 * size}

    # 4. Saved with model.save: plain Keras loads Keras's own optimizer, hvd.load_model Horovod's
    #    (a custom optimizer class given as custom_optimizers; k=2 still summed).
    path = os.path.join(args.dir, "model.keras")
    model, _ = trained(0, hvd.DistributedOptimizer(sgd()))
    custom = build(0)
    fit(custom, hvd.DistributedOptimizer(MySGD(0.1)), xm, ym, LOCAL)
    if rank == 0:
        model.save(path)
        custom.save(os.path.join(args.dir, "custom.keras"))
        summing.save(os.path.join(args.dir, "summing.keras"))
    hvd_tf.broadcast_object(path)  # the others wait until rank 0 has saved
    plain = keras.models.load_model(path)
    loaded = hvd.load_model(path)
    loaded_state = flat(loaded.optimizer.variables)  # iterations, rate, momentums as saved
    before = flat(loaded.trainable_variables)
    loaded.fit(xm, ym, batch_size=LOCAL, epochs=1, shuffle=False, verbose=0)
    after = flat(loaded.trainable_variables)
    result["saved"] = {
        "plain_optimizer": f"{type(plain.optimizer).__module__}.{type(plain.optimizer).__name__}",
        "plain_is_keras": type(plain.optimizer) is keras.optimizers.SGD,
        "plain_lr": float(np.asarray(plain.optimizer.learning_rate)),
        "loaded_distributed": hasattr(loaded.optimizer, "_allreduce"),
        "loaded_state": float(np.abs(loaded_state - flat(model.optimizer.variables)).max()),
        "saved_variables": len(model.optimizer.variables),
        "loaded_trains": float(np.abs(after - before).max()), "loaded_spread": spread(after)}
    again = hvd.load_model(os.path.join(args.dir, "custom.keras"), custom_optimizers=[MySGD])
    result["saved"]["custom_optimizer"] = [type(again.optimizer).__name__,
                                           hasattr(again.optimizer, "_allreduce")]
    again = hvd.load_model(os.path.join(args.dir, "summing.keras"))
    result["saved"]["summing"] = [again.optimizer.gradient_accumulation_steps,
                                  again.optimizer._hvd_sum_of_passes]

    # 5. Refused, with what to do.
    keras.mixed_precision.set_global_policy("mixed_float16")  # compile() would add loss scaling
    fp16 = refusal(lambda: hvd.DistributedOptimizer(sgd()))
    keras.mixed_precision.set_global_policy("float32")
    result["refused"] = {
        "loss_scale": refusal(lambda: hvd.DistributedOptimizer(
            keras.optimizers.LossScaleOptimizer(sgd()))),
        "mixed_float16": fp16,
        "multi": refusal(lambda: hvd.DistributedOptimizer(keras.optimizers.MultiOptimizer(
            lambda variable: sgd()))),
        "accumulation": refusal(lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
            backward_passes_per_step=2))}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
