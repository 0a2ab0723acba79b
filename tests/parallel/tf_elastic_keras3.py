"""Horovod's own TF2 elastic state, ``hvd.elastic.TensorFlowKerasState``, with the Keras that
``tf.keras`` is: Keras 3 by default, Keras 2 (tf-keras) under ``TF_USE_LEGACY_KERAS=1``. The loop
has the shape of Horovod's examples/elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py
(a ``tf.function`` step with ``hvd.DistributedGradientTape``, one step before the state exists,
``hvd.elastic.run``, a commit per batch, a reset callback that rescales the learning rate), on a
small dense model with dropout and SGD with momentum, so the optimizer has slots to restore.

What it checks, on every rank:

1. commit, then uncommitted work (two more steps, the first kernel zeroed, ``state.batch`` moved
   on), then a collective failure (``HorovodInternalError`` raised on every rank): Horovod's loop
   restores the state, re-initialises Horovod and calls the reset callbacks, which see each model
   and optimizer variable back at its committed value (compared exactly, before the sync's
   broadcast could hide a rank's bad restore) and ``state.batch`` committed;
2. a second state made before its optimizer's first step (Keras builds optimizers lazily):
   save, train, ``restore()`` gives back every variable, the momentum slots at zero;
3. the ranks end with the same variables (the sync broadcast from rank 0, then all-reduced steps;
   each rank starts from its own random initial weights).

Each rank writes ``<out>/rank<r>.json``.

Launch (one host, two workers; the discovery script prints ``localhost:2``)::

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh \\
        --network-interfaces lo python tests/parallel/tf_elastic_keras3.py OUT
    TF_USE_LEGACY_KERAS=1 horovodrun ... (the same)   # Keras 2
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402

LR = 0.01
COMMITTED_STEPS = 3
UNCOMMITTED_STEPS = 2


def optimizer_variables(optimizer):
    """The optimizer's variables: a method in Keras 2, a list in Keras 3."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def values(model, optimizer):
    """The values (numpy copies) of the model's variables (weights, dropout's seed state) and of
    the optimizer's: ``{"model": [...], "optimizer": [...]}``."""
    return {"model": [np.array(v.numpy()) for v in model.variables],
            "optimizer": [np.array(v.numpy()) for v in optimizer_variables(optimizer)]}


def _largest(a, b):
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    return max((float(np.abs(x.astype("float64") - y.astype("float64")).max(initial=0.0))
                for x, y in zip(a, b)), default=0.0)


def max_difference(a, b):
    """Largest absolute difference between two :func:`values`, per part: ``model``,
    ``optimizer`` (all its variables; inf when the count or a shape differs) and ``slots`` (its
    floating-point variables but the learning rate: the momentum buffers)."""
    def slots(vals):
        return [v for v in vals if v.dtype.kind == "f" and v.shape != ()]
    return {"model": _largest(a["model"], b["model"]),
            "optimizer": _largest(a["optimizer"], b["optimizer"]),
            "slots": _largest(slots(a["optimizer"]), slots(b["optimizer"]))}


def make_model():
    keras = tf.keras
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dropout(0.25), keras.layers.Dense(2,
                                                                            activation="softmax")])


def main() -> None:
    out = sys.argv[1]
    hvd.init()
    start_rank = hvd.rank()
    tf.keras.utils.set_random_seed(start_rank)  # ranks start apart; the sync's broadcast fixes it
    model = make_model()
    opt = tf.keras.optimizers.SGD(LR * hvd.size(), momentum=0.9)
    data = tf.random.uniform([16, 4])
    target = tf.one_hot(tf.random.uniform([16], maxval=2, dtype=tf.int64), 2)

    @tf.function
    def train_one_batch():
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.reduce_mean(tf.keras.losses.categorical_crossentropy(target, probs))
        tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))

    # As Horovod's example: one step (before any collective of the elastic loop) to create the
    # optimizer's variables. Locally here: a DistributedGradientTape step would all-reduce.
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.categorical_crossentropy(target, model(data)))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables))

    record = {"optimizer_module": type(opt).__module__,  # keras.* (3) or tf_keras.* (2)
              "start_rank": start_rank, "entries": 0, "resets": 0}
    drill = {"committed": None, "raised": False}

    def on_state_reset():
        # After the restore and Horovod's re-init, before the sync's broadcast: this rank's own
        # restored values.
        record["resets"] += 1
        record["restored_vs_committed"] = max_difference(values(model, opt), drill["committed"])
        record["batch_after_restore"] = state.batch
        opt.learning_rate = LR * hvd.size()  # the example's callback (Keras 2 and 3 alike)

    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        record["entries"] += 1
        if not drill["raised"]:
            for _ in range(COMMITTED_STEPS):
                train_one_batch()
                state.batch += 1
                state.commit()
            drill["committed"] = values(model, opt)
            record["committed_batch"] = state.batch
            for _ in range(UNCOMMITTED_STEPS):
                train_one_batch()
            model.layers[0].kernel.assign(tf.zeros_like(model.layers[0].kernel))
            state.batch += UNCOMMITTED_STEPS
            record["uncommitted_vs_committed"] = max_difference(values(model, opt),
                                                                drill["committed"])
            drill["raised"] = True
            raise HorovodInternalError("drill: a collective failed on every rank")
        for _ in range(2):  # training goes on after the reset
            train_one_batch()
            state.batch += 1
            state.commit()

    train(state)
    record["size"] = hvd.size()
    record["final_batch"] = state.batch
    record["iterations"] = int(opt.iterations.numpy())

    # 2. a state made before the optimizer's first step.
    model_b = make_model()
    opt_b = tf.keras.optimizers.SGD(LR, momentum=0.9)
    state_b = hvd.elastic.TensorFlowKerasState(model_b, opt_b, epoch=0)
    saved = values(model_b, opt_b)
    record["unbuilt_optimizer_variables_saved"] = len(saved["optimizer"])
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.categorical_crossentropy(target, model_b(data)))
        opt_b.apply_gradients(zip(tape.gradient(loss, model_b.trainable_variables),
                                  model_b.trainable_variables))
    state_b.epoch = 7
    record["unbuilt_trained_vs_saved"] = max_difference(values(model_b, opt_b), saved)
    state_b.restore()
    record["unbuilt_restored_vs_saved"] = max_difference(values(model_b, opt_b), saved)
    record["unbuilt_epoch_after_restore"] = state_b.epoch

    # 3. the ranks agree.
    final = values(model, opt)
    mine = np.concatenate([v.ravel().astype("float64")
                           for v in final["model"] + final["optimizer"]])
    everyone = hvd.allgather_object(mine)
    record["rank_spread"] = max(float(np.abs(v - everyone[0]).max()) for v in everyone)
    with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
