"""Horovod's own TensorFlow API with Keras 3 models, on real ranks: the canonical TF2 loop
(hvd.DistributedGradientTape + hvd.broadcast_variables), the partial tape with a rank-local layer
(hvd.PartialDistributedGradientTape, Horovod's model-parallel recipe) and hvd.SyncBatchNormalization.
Each rank trains on its shard of a global batch; the results are compared with one process
training on the whole global batch. Rank 0 writes what it saw as JSON;
tests/parallel/test_existing_code.py asserts on it.

Launch::

    KERAS_BACKEND=tensorflow horovodrun -np 2 python tests/parallel/tf_habits.py --out result.json
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LOCAL = 8  # samples per rank and step
STEPS = 3


def batches(size):
    """STEPS global batches, the same on every rank: (LOCAL x size, 6) inputs, labels."""
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((LOCAL * size, 6)).astype("float32") * 2 + 1,
             rng.integers(0, 3, LOCAL * size)) for _ in range(STEPS)]


def build(seed, batch_norm=None):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(5)]
    if batch_norm is not None:
        layers.append(batch_norm(momentum=0.5))
    layers += [keras.layers.Activation("tanh"), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def flat(variables):
    return np.concatenate([np.asarray(v).ravel() for v in variables])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train(model, data, tape_of, head=None, before=None):
    """STEPS steps of the TF2 custom loop; ``tape_of`` wraps the tape (Horovod's or none),
    ``before(model)`` runs first."""
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    variables = model.trainable_variables + (head.trainable_variables if head else [])
    if before is not None:
        before(model)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = LOSS(y, head(out) if head else out)
        grads = tape_of(tape).gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    for x, y in data:
        step(x, y)
    return model


def bf16_collectives(size, rank):
    """Horovod's TensorFlow collectives on bfloat16 tensors, eager and in a tf.function, each
    result compared bit for bit with what it should be: reductions computed in float32 and
    rounded once, moves the same bits (a NaN's payload, -0.0, inf, a subnormal). Before
    scripts/horovod_patches/17-*: "Value for attr 'T' of bfloat16 is not in the list"."""
    base = tf.constant([1 / 3, 2.0, -7.5, 1e-3, 3.0e38], tf.bfloat16)
    mine = [base * (r + 1) for r in range(size)]  # 3e38 x 2 overflows to inf in bfloat16

    def bits(t):
        return tf.bitcast(tf.convert_to_tensor(t), tf.int16).numpy().tolist()

    def expect(reduce):
        return bits(tf.cast(reduce(tf.stack([tf.cast(v, tf.float32) for v in mine])),
                            tf.bfloat16))

    total = expect(lambda t: tf.reduce_sum(t, 0))
    special = tf.bitcast(tf.constant([0x7FC1, 0x7F80, -0x8000, 0x0001, rank], tf.int16),
                         tf.bfloat16)
    special_bits = [0x7FC1, 0x7F80, -0x8000, 0x0001]
    checks = {"allreduce_sum": bits(hvd.allreduce(mine[rank], op=hvd.Sum)) == total,
              "allreduce_average": bits(hvd.allreduce(mine[rank], op=hvd.Average)) == expect(
                  lambda t: tf.reduce_sum(t, 0) / size),
              "allreduce_in_tf_function": bits(tf.function(
                  lambda v: hvd.allreduce(v, op=hvd.Sum))(mine[rank])) == total}
    pair = hvd.grouped_allreduce([mine[rank], tf.fill([2], float(rank))], op=hvd.Sum)
    checks["grouped_allreduce_with_float32"] = (
        pair[0].dtype == tf.bfloat16 and bits(pair[0]) == total
        and pair[1].numpy().tolist() == [size * (size - 1) / 2] * 2)
    checks["allgather"] = bits(hvd.allgather(special)) == [
        b for r in range(size) for b in special_bits + [r]]
    checks["broadcast"] = bits(hvd.broadcast(special, root_rank=size - 1)) == special_bits + [
        size - 1]
    outgoing = tf.bitcast(tf.constant([100 * rank + j for j in range(size)], tf.int16),
                          tf.bfloat16)
    checks["alltoall"] = bits(hvd.alltoall(outgoing)) == [100 * r + rank for r in range(size)]
    variable = keras.Variable(tf.cast(tf.fill([3], float(rank + 1)), tf.bfloat16))
    hvd.broadcast_variables([variable], root_rank=0)
    checks["broadcast_variables"] = bits(variable.value) == bits(tf.ones([3], tf.bfloat16))
    return checks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    data = batches(size)
    mine = [(x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL])
            for x, y in data]

    def spread(values):
        everyone = hvd.allgather_object(values)
        return float(max(np.abs(v - values).max() for v in everyone))

    def broadcast(model):  # Horovod's recipe: every rank starts from rank 0's variables
        hvd.broadcast_variables(model.variables, root_rank=0)

    result = {"size": size}
    # 1. The canonical loop; the ranks build different weights, the broadcast makes them equal.
    reference = train(build(seed=0), data, lambda tape: tape)
    model = train(build(seed=rank), mine, hvd.DistributedGradientTape, before=broadcast)
    weights = flat(model.trainable_variables)
    result["tape"] = {"vs_reference": float(np.abs(weights - flat(reference.trainable_variables)).max()),
                      "rank_spread": spread(weights)}

    # 2. The partial tape: a rank-local head keeps its own weights, the rest is shared.
    head = keras.layers.Dense(3, name="local_head")
    head.build((None, 3))
    head.kernel.assign(np.full((3, 3), 0.1 * (rank + 1), "float32"))
    model = train(build(seed=0), mine,
                  lambda tape: hvd.PartialDistributedGradientTape(tape, local_layers=[head]),
                  head=head)
    result["partial"] = {"shared_spread": spread(flat(model.trainable_variables)),
                         "local_spread": spread(flat(head.trainable_variables))}

    # 3. SyncBatchNormalization: the global batch's statistics, as one process with plain
    #    BatchNormalization on the whole global batch.
    reference = train(build(0, keras.layers.BatchNormalization), data, lambda tape: tape)
    model = train(build(0, hvd.SyncBatchNormalization), mine, hvd.DistributedGradientTape)
    weights = flat(model.variables)  # moving mean and variance included
    result["sync_batch_norm"] = {
        "vs_reference": float(np.abs(weights - flat(reference.variables)).max()),
        "rank_spread": spread(weights),
        "plain_vs_reference": None}
    # Without it, each rank normalizes with its own statistics: the weights differ.
    plain = train(build(0, keras.layers.BatchNormalization), mine, hvd.DistributedGradientTape)
    result["sync_batch_norm"]["plain_vs_reference"] = float(
        np.abs(flat(plain.variables) - flat(reference.variables)).max())
    try:  # an error fails the bfloat16 test alone (the ranks raise alike: no collective hangs)
        checks = bf16_collectives(size, rank)
    except Exception as exc:  # noqa: BLE001 - reported in the result
        checks = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    result["bf16_collectives"] = hvd.allgather_object(checks)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
