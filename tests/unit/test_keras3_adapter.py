"""hvdtrain.keras on Keras 3 in one process (Horovod with size 1; the backend of this pytest process,
TensorFlow unless KERAS_BACKEND says otherwise): what a review of the Keras 2 adapter found, each
re-checked here (two fit phases, Embedding with k > 1, global reshuffling, no per-batch host
reads, resume without replay, a user's LearningRateSchedule, LossScaleOptimizer), and Keras 3
files. The same adapter under horovodrun -np 2 on both backends: tests/parallel/."""
import numpy as np
import pytest

import keras

import hvdtrain.keras as hk
from hvdtrain import schedule
from hvdtrain.keras.models import build_model

X = np.random.default_rng(0).random((64, 8, 8, 1), dtype=np.float32)
Y = np.random.default_rng(1).integers(0, 10, 64)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
value = keras.ops.convert_to_numpy


def lr_now(optimizer) -> float:
    return float(value(optimizer.learning_rate))


def test_a_second_fit_phase_keeps_the_scaled_rate():
    hk.init(seed=0)
    model, optimizer = hk.distribute(build_model(), keras.optimizers.SGD(0.01),
                                     backward_passes_per_step=2)  # factor 1 x 2 = 2
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    for phase in range(2):  # callbacks() again, as a second fit phase would
        cbs = hk.callbacks(optimizer, warmup_epochs=0, steps_per_epoch=4)
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=cbs)
        assert lr_now(optimizer) == pytest.approx(0.02, rel=1e-6), phase
        assert cbs[-1].lr_at(100) == pytest.approx(0.02, rel=1e-6)
    with pytest.raises(ValueError, match="distributed already"):
        hk.distribute(model, optimizer)


def test_embedding_model_with_accumulation_trains():
    hk.init(seed=0)
    model = keras.Sequential([keras.layers.Embedding(50, 8), keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(3)])
    model.build((None, 5))
    model, optimizer = hk.distribute(model, keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    tokens = np.random.default_rng(2).integers(0, 50, (32, 5))
    labels = np.random.default_rng(3).integers(0, 3, 32)
    before = model.get_weights()[0].copy()
    model.fit(tokens, labels, batch_size=4, epochs=1, verbose=0)
    assert int(value(optimizer.iterations)) == 4 and hk.micro_batch_count(optimizer) == 8
    assert not np.allclose(before, model.get_weights()[0])


def test_shards_are_reshuffled_globally_every_epoch():
    x, y = np.arange(40, dtype=np.float32)[:, None], np.arange(40)
    ranks = [hk.ShardedDataset(x, y, batch_size=5, rank=r, size=2, seed=7) for r in range(2)]
    per_epoch = ranks[0].steps_per_epoch
    assert per_epoch == 4
    epochs = []
    for epoch in range(2):
        seen = [np.concatenate([d[epoch * per_epoch + j][1] for j in range(per_epoch)])
                for d in ranks]
        assert sorted(np.concatenate(seen)) == list(range(40))  # together: every sample once
        epochs.append(seen)
    assert set(epochs[0][0]) != set(epochs[1][0])  # rank 0 holds other samples next epoch
    # Resuming at micro-batch 6 starts right there: no replay of the stream.
    resumed = hk.ShardedDataset(x, y, batch_size=5, rank=1, size=2, seed=7, start_batch=6)
    assert (resumed[0][0] == ranks[1][6][0]).all() and (resumed[1][1] == ranks[1][7][1]).all()


def test_uneven_shards_have_equal_whole_groups():
    x, y = np.zeros((45, 1), np.float32), np.arange(45)
    shards = [hk.ShardedDataset(x, y, batch_size=4, rank=r, size=2, backward_passes_per_step=2)
              for r in range(2)]
    assert {s.steps_per_epoch for s in shards} == {6}  # 22 per rank -> 6 batches, 3 groups
    assert all(len(s[5][0]) == 4 for s in shards)  # the last batch is full (wraps around)


@pytest.mark.parametrize("batch_size,k", [(0, 1), (4, 0), (-2, 1)])
def test_a_batch_or_k_below_one_is_refused_by_name(batch_size, k):
    """Not a ZeroDivisionError from the epoch's length: a ValueError naming both."""
    x, y = np.zeros((45, 1), np.float32), np.arange(45)
    with pytest.raises(ValueError, match=rf"batch_size and backward_passes_per_step must be >= "
                                         rf"1; got {batch_size} and {k}"):
        hk.ShardedDataset(x, y, batch_size=batch_size, rank=0, size=2,
                          backward_passes_per_step=k)


def train(steps_per_execution: int) -> list:
    hk.init(seed=0)
    model, optimizer = hk.distribute(build_model(), keras.optimizers.SGD(0.05, momentum=0.9),
                                     backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False,
                  steps_per_execution=steps_per_execution)
    data = hk.shard_dataset(X, Y, batch_size=4, shuffle=False, backward_passes_per_step=2)
    model.fit(data, epochs=2, steps_per_epoch=data.steps_per_epoch, verbose=0,
              callbacks=hk.callbacks(optimizer, warmup_epochs=1, steps_per_epoch=8))
    return model.get_weights()


def test_warmup_runs_inside_the_step_so_steps_per_execution_changes_nothing():
    one, four = train(1), train(4)
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, four)) < 1e-6


def test_a_users_learning_rate_schedule_is_composed_with_the_scaling_and_warmup():
    hk.init(seed=0)
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    model, optimizer = hk.distribute(build_model(), keras.optimizers.SGD(decay),
                                     backward_passes_per_step=2)
    callback = hk.warmup(optimizer, warmup_epochs=1, steps_per_epoch=4)
    for step in (0, 2, 4, 9):
        hk.set_micro_batch_count(optimizer, 2 * step)  # the step's first micro-batch
        expected = float(value(decay(step))) * 2 * schedule.warmup_multiplier(step, 2.0, 1, 4)
        assert lr_now(optimizer) == pytest.approx(expected, rel=1e-5), step
        assert callback.lr_at(step) == pytest.approx(expected, rel=1e-5)


def test_loss_scale_optimizer_is_distributed_through_its_inner_optimizer():
    hk.init(seed=0)
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0 ** 15)
    model, optimizer = hk.distribute(build_model(), lso, lr_scaling="sqrt")
    assert optimizer is lso and lr_now(optimizer) == pytest.approx(0.01, rel=1e-6)
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    before = [w.copy() for w in model.get_weights()]
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert any(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))
    assert int(value(optimizer.iterations)) == 4


def test_the_distributed_model_saves_as_a_keras_file_a_user_can_load(tmp_path):
    hk.init(seed=0)
    model, optimizer = hk.distribute(build_model(), keras.optimizers.SGD(0.01),
                                     backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    model.save_weights(tmp_path / "model.weights.h5")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
    # The distributed optimizer is an SGD (of a subclass whose learning_rate Keras's callbacks can
    # set); the file holds a plain SGD.
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert type(loaded.optimizer) is keras.optimizers.SGD
    plain = build_model()
    plain.load_weights(tmp_path / "model.weights.h5")
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), plain.get_weights()))


def test_distribute_refuses_what_it_cannot_honour():
    hk.init(seed=0)
    built = keras.optimizers.SGD(0.1)
    built.build(build_model().trainable_variables)
    with pytest.raises(ValueError, match="must not be built yet"):
        hk.distribute(build_model(), built, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        hk.distribute(build_model(), keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
                      backward_passes_per_step=2)
    with pytest.raises(ValueError, match="no weights yet"):
        hk.distribute(keras.Sequential([keras.layers.Dense(2)]), keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="distribute"):
        hk.warmup(keras.optimizers.SGD(0.1), warmup_epochs=1, steps_per_epoch=1)


def test_dropout_randomness_stays_per_rank():
    hk.init(seed=0)
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    model.build((None, 3))
    seeds = [v for v in model.non_trainable_variables if "seed_generator_state" in v.path]
    assert len(seeds) == 1  # Dropout's SeedGenerator: seeded per rank by init()
    assert hk.sync_buffers(model) == 2  # moving mean and variance only, not the seed state


def test_fp16_set_ups_that_would_hang_or_underflow_are_refused():
    hk.init(seed=0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="wrap the optimizer in .*LossScaleOptimizer"):
            hk.distribute(build_model(), keras.optimizers.SGD(0.1))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="compression='fp16' with a LossScaleOptimizer"):
        hk.distribute(build_model(), lso, compression="fp16")


def test_a_new_world_size_starts_with_an_empty_accumulation_group():
    hk.init(seed=0)
    model, optimizer = hk.distribute(build_model(), keras.optimizers.SGD(0.1),
                                     backward_passes_per_step=4)
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    model.fit(X[:8], Y[:8], batch_size=4, epochs=1, verbose=0)  # 2 of 4 micro-batches
    accumulators = optimizer._accumulated_gradients
    assert any(np.abs(value(a)).sum() > 0 for a in accumulators)
    hk.set_micro_batch_count(optimizer, 8, reset_groups=True)
    assert hk.micro_batch_count(optimizer) == 8
    assert all(np.abs(value(a)).sum() == 0 for a in accumulators)


def test_slow_steps_sleeps_before_the_last_micro_batch_of_each_step_from_its_step(monkeypatch):
    from hvdtrain import runtime
    from hvdtrain.keras.trainer_callbacks import SlowSteps
    slept = []
    monkeypatch.setattr(runtime, "slow_step", lambda slow, step: slept.append(step)
                        if step >= slow[0] else None)
    # k=2, 6 micro-batches (3 steps) per epoch, a fit resumed 2 micro-batches into epoch 1.
    cb = SlowSteps((2, 0.5), k=2, micro_per_epoch=6, offset=2)
    cb.on_epoch_begin(1)
    for batch in range(4):  # micro-batches 8..11 of the run: steps 4 and 5 end at 9 and 11
        cb.on_train_batch_begin(batch)
    cb.on_epoch_end(1)
    cb.on_epoch_begin(2)
    for batch in range(6):  # micro-batches 12..17: steps 6, 7, 8
        cb.on_train_batch_begin(batch)
    assert slept == [4, 5, 6, 7, 8]


def test_jit_compile_true_with_a_users_own_train_step_is_refused_with_what_to_do():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the XLA split is for Keras's TensorFlow backend")

    class Custom(keras.Sequential):
        def train_step(self, data):  # a user's own step
            return super().train_step(data)

    hk.init(seed=0)
    model = Custom(build_model().layers)
    model.build((None, 8, 8, 1))
    model, optimizer = hk.distribute(model, keras.optimizers.SGD(0.01))
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=True)
    with pytest.raises(ValueError, match="has its own train_step .* jit_compile=False"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_init_gives_tensorflow_as_many_inter_op_as_intra_op_threads(threads):
    """The rank's core share for both pools: 1 inter-op thread at one core per rank (2 were
    7-15 % slower at np=2 on 2 cores), the cores at one rank per host (TensorFlow's own default;
    1 cost 10 % on the gpt). A fresh interpreter: TensorFlow's threads are set before it runs."""
    import os
    import subprocess
    import sys
    code = ("import hvdtrain.keras as hk, tensorflow as tf\n"
            f"info = hk.init(seed=0, threads={threads})\n"
            "t = tf.config.threading\n"
            "print(info.threads, t.get_intra_op_parallelism_threads(), "
            "t.get_inter_op_parallelism_threads())\n")
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.split()
    assert out[-3:] == [str(threads)] * 3


def _fresh(code: str, **env) -> "subprocess.CompletedProcess":
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}, timeout=180)


def test_init_refuses_a_keras_that_computes_elsewhere_than_the_rank():
    """Keras's PyTorch backend picks its device when keras is imported (a visible GPU, or
    KERAS_TORCH_DEVICE), before hk.init: a CPU rank whose Keras puts tensors elsewhere (on a GPU
    host: the GPU) is an error that says what to set. Here the stand-in for "elsewhere" is
    torch's meta device, the one other device a CPU machine has."""
    code = ("import hvdtrain.keras as hk\n"
            "try:\n"
            "    hk.init(seed=0, device='cpu')\n"
            "except ValueError as exc:\n"
            "    print('ERROR', exc)\n"
            "else:\n"
            "    print('OK')\n")
    refused = _fresh(code, KERAS_BACKEND="torch", KERAS_TORCH_DEVICE="meta")
    assert refused.returncode == 0, refused.stderr[-2000:]
    assert ("ERROR this rank computes on cpu, but Keras's PyTorch backend puts tensors on meta "
            "(chosen when keras was imported: KERAS_TORCH_DEVICE=meta, else a visible GPU); set "
            "KERAS_TORCH_DEVICE=cpu before importing keras (hvdtrain train does it for "
            "--device), or hide the GPUs with CUDA_VISIBLE_DEVICES=''") in refused.stdout
    fine = _fresh(code, KERAS_BACKEND="torch", KERAS_TORCH_DEVICE="cpu")
    assert fine.stdout.split()[-1] == "OK", fine.stdout + fine.stderr[-2000:]


def test_train_sets_keras_torch_device_from_device(tmp_path):
    """hvdtrain train --keras-backend torch --device cpu tells Keras before importing it (the
    KERAS_TORCH_DEVICE=meta in the environment stands for a GPU Keras would otherwise pick),
    and trains on the CPU."""
    code = ("import sys\n"
            "from hvdtrain.cli import main\n"
            f"sys.exit(main(['train', '--framework', 'keras', '--keras-backend', 'torch', "
            f"'--device', 'cpu', '--epochs', '1', '--output-dir', {str(tmp_path)!r}]))\n")
    proc = _fresh(code, KERAS_TORCH_DEVICE="meta")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    import json
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["device"] == "cpu" and m["versions"]["keras_backend"] == "torch"
    assert m["final_test_accuracy"] > 0.5


def test_overlap_only_where_keras_reads_the_gradients_after_clipping_starts():
    """The backward-pass all-reduces (hvdtrain.keras.overlap, torch backend) are allowed only
    with k = 1, a plain optimizer (no LossScaleOptimizer), no loss_scale_factor (Keras divides
    the gradients before _clip_gradients) and no overwrite_with_gradient variable."""
    from hvdtrain.keras.adapter import _can_overlap
    model = build_model()
    sgd = keras.optimizers.SGD(0.1)
    assert _can_overlap(model, sgd, sgd, 1)
    assert not _can_overlap(model, sgd, sgd, 2)
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert not _can_overlap(model, lso.inner_optimizer, lso, 1)
    scaled = keras.optimizers.SGD(0.1, loss_scale_factor=128.0)
    assert not _can_overlap(model, scaled, scaled, 1)
    model.trainable_variables[0].overwrite_with_gradient = True
    assert not _can_overlap(model, sgd, sgd, 1)
