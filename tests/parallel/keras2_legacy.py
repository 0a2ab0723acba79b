"""Keras 2 code on the Keras 3 stack: a tf.keras program written for TensorFlow <= 2.15 (Horovod's
own Keras-2 layer, horovod.tensorflow.keras) run unchanged under TF_USE_LEGACY_KERAS=1 with the
tf-keras package. Rank 0 writes what it saw as JSON.

Launch::

    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 python tests/parallel/keras2_legacy.py --out r.json
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    hvd.init()
    tf.keras.utils.set_random_seed(hvd.rank())  # ranks start apart; the broadcast fixes that
    model = tf.keras.Sequential([tf.keras.layers.Flatten(input_shape=(8, 8, 1)),
                                 tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size(),
                                                                 momentum=0.9))
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.standard_normal((64, 8, 8, 1)).astype("float32"), rng.integers(0, 10, 64)
    # Horovod's Keras-2 callbacks as its examples use them: the broadcast, metric averaging over
    # the ranks, a warmup over the first epoch, then x0.5 per epoch after the second.
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=1,
                                                 steps_per_epoch=4),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.01 * hvd.size(), multiplier=0.5,
                                                   start_epoch=1)])
    import horovod.tensorflow as hvd_tf
    losses = [float(v) for v in history.history["loss"]]
    local_losses = hvd_tf.allgather_object(losses)  # each rank's history
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    weights = hvd_tf.allgather_object(flat)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"keras_module": tf.keras.__name__, "size": hvd.size(),
                       "optimizer_module": type(optimizer).__mro__[1].__module__,
                       "rank_spread": float(max(np.abs(w - weights[0]).max() for w in weights)),
                       "losses": losses, "local_losses": local_losses,
                       "lr": [float(v) for v in history.history["lr"]]}, f)


if __name__ == "__main__":
    main()
