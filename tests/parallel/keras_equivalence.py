"""Data-parallel Keras training with hvdtrain.keras equals single-process training on the global
batch.

Launch (parallel; each rank builds its model from a different seed, rank 0's is broadcast)::

    horovodrun -np 2 python tests/parallel/keras_equivalence.py --out par.npz [--jit-compile true]

Reference (one process, batch = local batch x k x size, lr x size x k, same samples per step)::

    python tests/parallel/keras_equivalence.py --reference --world-size 2 --out ref.npz
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

from hvdtrain.keras.models import build_model  # noqa: E402

SEED, BASE_LR, MOMENTUM = 7, 0.05, 0.9
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dataset(n: int):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, 8, 8, 1)).astype(np.float32),
            rng.integers(0, 10, n).astype(np.int64))


def flat(model) -> np.ndarray:
    return np.concatenate([w.reshape(-1).astype(np.float32) for w in model.get_weights()])


class CountSteps(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        self.micro_batches = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))


def parallel(args) -> None:
    import hvdtrain.keras as hk
    from hvdtrain.keras.collectives import allgather_object

    info = hk.init(seed=SEED, threads=1)
    keras.config.set_dtype_policy(args.dtype_policy)  # the pool sets float32 back afterwards
    model = build_model()
    optimizer = keras.optimizers.SGD(BASE_LR, momentum=MOMENTUM)
    model, optimizer = hk.distribute(model, optimizer, backward_passes_per_step=args.k,
                                     lr_scaling="linear")
    jit = {"auto": "auto", "true": True, "false": False}[args.jit_compile]
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=jit)
    x, y = dataset(args.samples)
    micro = hk.micro_batches_per_epoch(len(x), args.batch_size, info.size, args.k)
    data = hk.shard_dataset(x, y, batch_size=args.batch_size, shuffle=False, info=info)
    counter = CountSteps()
    model.fit(data, epochs=args.epochs, steps_per_epoch=micro, verbose=0,
              callbacks=[counter])
    counter.micro_batches *= args.k  # Keras 3: optimizer.iterations counts optimizer steps
    weights = allgather_object(flat(model))
    overlap = optimizer.hvdtrain_allreduce.overlap  # torch backend, k = 1: during backward
    if info.rank == 0:
        spread = max(float(np.abs(w - weights[0]).max()) for w in weights)
        np.savez(args.out, weights=weights[0], steps=counter.micro_batches // args.k,
                 rank_spread=spread, size=info.size, jit_compile=bool(model.jit_compile),
                 overlapped_steps=overlap.steps if overlap is not None else -1,
                 dtypes=sorted({str(v.dtype) for v in model.weights}),
                 xla_split=bool(getattr(model, "hvdtrain_xla_split", False)))


def reference(args) -> None:
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
        except RuntimeError:  # TF already running: a rank pool, started on init's threads
            pass
    else:
        import torch
        torch.set_num_threads(1)
    keras.utils.set_random_seed(SEED)
    keras.config.set_dtype_policy(args.dtype_policy)
    model = build_model()
    n = args.world_size * args.k
    model.compile(optimizer=keras.optimizers.SGD(BASE_LR * n, momentum=MOMENTUM), loss=LOSS,
                  jit_compile=False)
    x, y = dataset(args.samples)
    counter = CountSteps()
    model.fit(x, y, batch_size=args.batch_size * n, epochs=args.epochs, shuffle=False, verbose=0,
              callbacks=[counter])
    np.savez(args.out, weights=flat(model), steps=counter.micro_batches, rank_spread=0.0, size=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--reference", action="store_true")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dtype-policy", default="float32",
                   help="keras.config.set_dtype_policy before the model is built (bfloat16: "
                        "weights, gradients and the update in bfloat16)")
    p.add_argument("--jit-compile", default="false", choices=("auto", "true", "false"),
                   help="the parallel run's model.compile(jit_compile=...)")
    args = p.parse_args()
    (reference if args.reference else parallel)(args)


if __name__ == "__main__":
    main()
