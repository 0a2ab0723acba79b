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
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.standard_normal((64, 8, 8, 1)).astype("float32"), rng.integers(0, 10, 64)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    # Horovod's MetricAverageCallback does not run here: horovod.tensorflow.keras takes its
    # backend from `import keras`, which is Keras 3 whatever TF_USE_LEGACY_KERAS says (README).
    try:
        hvd.callbacks.MetricAverageCallback().on_epoch_end(0, {"loss": 1.0})
        metric_average = "works"
    except AttributeError as exc:
        metric_average = f"AttributeError: {exc}"
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    import horovod.tensorflow as hvd_tf
    weights = hvd_tf.allgather_object(flat)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"keras_module": tf.keras.__name__, "size": hvd.size(),
                       "optimizer_module": type(optimizer).__mro__[1].__module__,
                       "rank_spread": float(max(np.abs(w - weights[0]).max() for w in weights)),
                       "losses": history.history["loss"], "metric_average": metric_average}, f)


if __name__ == "__main__":
    main()
