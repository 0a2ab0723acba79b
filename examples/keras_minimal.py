"""The smallest complete hvdtrain.keras program: a CNN on scikit-learn's digits with Keras 3's
model.fit, on either Keras backend (KERAS_BACKEND=tensorflow, the default, or torch).

Launch::

    horovodrun -np 2 python examples/keras_minimal.py [result.json]
    KERAS_BACKEND=torch horovodrun -np 2 python examples/keras_minimal.py
    mpirun -np 2 -bind-to none -map-by slot -x PATH -x KERAS_BACKEND python examples/keras_minimal.py
"""
import keras
import numpy as np

import hvdtrain.keras as hk
from hvdtrain import datasets
from hvdtrain.keras.models import build_model

K = 2  # backward_passes_per_step: one all-reduce per 2 micro-batches

info = hk.init(seed=0)                       # hvd.init(), threads per rank, per-rank seed
split = datasets.load_digits()
x_train = split.x_train.transpose(0, 2, 3, 1)                  # NHWC for Keras
dataset = hk.shard_dataset(x_train, split.y_train, batch_size=16, seed=0,
                           backward_passes_per_step=K)         # reshuffled globally each epoch

model = build_model()                                          # built: weights exist
optimizer = keras.optimizers.SGD(0.01, momentum=0.9)           # any Keras 3 optimizer
model, optimizer = hk.distribute(model, optimizer, backward_passes_per_step=K,
                                 lr_scaling="linear")          # lr x size x K, rank 0's weights
model.compile(optimizer=optimizer, metrics=["accuracy"],        # any jit_compile (see below)
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(dataset, epochs=10, steps_per_epoch=dataset.steps_per_epoch,  # whole groups of K
          callbacks=hk.callbacks(optimizer, warmup_epochs=1,   # metric averaging + warmup
                                 steps_per_epoch=dataset.steps_per_epoch // K),
          verbose=1 if info.rank == 0 else 0)

logits = keras.ops.convert_to_numpy(model(split.x_test.transpose(0, 2, 3, 1), training=False))
accuracy = float(np.mean(np.argmax(logits, axis=1) == split.y_test))
if info.rank == 0:
    print(f"held-out accuracy {accuracy:.4f} on {info.size} ranks ({hk.backend()} backend)")
    import json, sys                                           # optional: results as a file
    if len(sys.argv) > 1:                                      # (tests read them from there)
        with open(sys.argv[1], "w") as f:
            json.dump({"accuracy": accuracy, "size": info.size, "backend": hk.backend()}, f)
