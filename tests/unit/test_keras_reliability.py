"""The Keras pieces of reliability in one process (Horovod with size 1): the non-finite guard,
checkpoint files, and the elastic epoch plan. The same behaviour under horovodrun -np 2/3 is in
tests/parallel/test_reliability.py and test_elastic.py."""
import numpy as np
import pytest
import keras

import hvdtrain.keras as hk
from hvdtrain import runtime
from hvdtrain.keras import checkpoint
from hvdtrain.keras.elastic import epoch_shard
from hvdtrain.keras.models import build_model
from hvdtrain.keras.trainer import TrainLoss

X = np.random.default_rng(0).random((32, 8, 8, 1), dtype=np.float32)
Y = np.random.default_rng(1).integers(0, 10, 32)


def guarded(k, mode="skip", fault=(0, 1)):
    hk.init(seed=0)
    model = build_model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    model, optimizer = hk.distribute(model, optimizer, backward_passes_per_step=k,
                                     on_nonfinite=mode)
    model.compile(optimizer=optimizer, loss=TrainLoss(optimizer, k, 0, fault),
                  jit_compile=False)
    return model, optimizer


def snapshot(model, optimizer):
    return [w.copy() for w in model.get_weights()] + [
        np.array(keras.ops.convert_to_numpy(v)) for v in optimizer.variables
        if "iteration" not in v.path]


@pytest.mark.parametrize("k", [1, 2])
def test_a_nan_step_changes_nothing_but_the_step_count(k):
    model, optimizer = guarded(k)
    batch = 4
    first_step = slice(0, batch * k)          # optimizer step 0: applied
    model.fit(X[first_step], Y[first_step], batch_size=batch, shuffle=False, verbose=0)
    before = snapshot(model, optimizer)
    nan_step = slice(batch * k, 2 * batch * k)  # optimizer step 1: NaN loss, skipped
    model.fit(X[nan_step], Y[nan_step], batch_size=batch, shuffle=False, verbose=0)
    after = snapshot(model, optimizer)
    assert all((a == b).all() for a, b in zip(before, after))
    guard = optimizer.hvdtrain_nonfinite
    value = keras.ops.convert_to_numpy
    assert int(value(guard.skipped)) == 1 and int(value(guard.bad_step)) == 1
    assert list(value(guard.bad_ranks)) == [1.0]
    assert int(value(optimizer.iterations)) == 2  # optimizer steps: the schedule moves on
    assert hk.micro_batch_count(optimizer) == 2 * k
    third = slice(2 * batch * k, 3 * batch * k)  # step 2: finite, applied again
    model.fit(X[third], Y[third], batch_size=batch, shuffle=False, verbose=0)
    assert any((a != b).any() for a, b in zip(after, snapshot(model, optimizer)))
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_stop_mode_raises_at_the_bad_step_with_weights_intact():
    model, optimizer = guarded(1, mode="stop")
    callbacks = hk.callbacks(optimizer)
    with pytest.raises(runtime.NonFiniteLossError,
                       match=r"non-finite loss on rank\(s\) \[0\] at optimizer step 1 .*stop"):
        model.fit(X, Y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 2
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_the_fault_follows_the_rank_variable_which_elastic_runs_reassign():
    # --fault-nan-at 1:0 on a process that starts as rank 0: no fault; once its rank variable
    # says 1 (an elastic reset renumbered it), it fires at step 0 of the counter.
    hk.init(seed=0)
    optimizer = keras.optimizers.SGD(0.05)
    loss = TrainLoss(optimizer, 1, 0, (1, 0))
    y_pred = keras.ops.convert_to_tensor(np.eye(10, dtype=np.float32)[Y[:4]])
    assert np.isfinite(float(keras.ops.convert_to_numpy(loss(Y[:4], y_pred))))
    loss.calls.assign(0)
    loss.rank.assign(1)
    assert np.isnan(float(keras.ops.convert_to_numpy(loss(Y[:4], y_pred))))
    assert np.isfinite(float(keras.ops.convert_to_numpy(loss(Y[:4], y_pred))))  # step 1: none


def test_distribute_rejects_an_unknown_nonfinite_mode():
    hk.init(seed=0)
    with pytest.raises(ValueError, match="on_nonfinite must be None, 'skip' or 'stop'"):
        hk.distribute(build_model(), keras.optimizers.SGD(0.1), on_nonfinite="ignore")


def test_keras_checkpoint_round_trip_and_fallback(tmp_path):
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    checkpoint.save(tmp_path, arrays, [np.int64(3), np.zeros(2)], {"epoch": 1})
    checkpoint.save(tmp_path, [a * 2 for a in arrays], [np.int64(6), np.ones(2)], {"epoch": 2})
    loaded = checkpoint.load(tmp_path)
    assert loaded["record"] == {"epoch": 2} and int(loaded["optimizer"][0]) == 6
    assert all((a * 2 == b).all() for a, b in zip(arrays, loaded["model"]))
    newest = tmp_path / checkpoint.CHECKPOINT_FILE
    newest.write_bytes(newest.read_bytes()[:-40])  # truncated
    loaded = checkpoint.load(tmp_path)
    assert loaded["record"] == {"epoch": 1}
    assert all((a == b).all() for a, b in zip(arrays, loaded["model"]))


@pytest.mark.parametrize("samples,batch", [(1437, 16), (1001, 7)])
def test_elastic_epoch_plan_neither_loses_nor_repeats_committed_work(samples, batch):
    order = np.random.default_rng((5, 3)).permutation(samples)
    done, seen = 0, []
    for size, steps in ((3, 4), (2, 6), (3, None)):  # world size changes at commits
        shards = [epoch_shard(samples, done, 5, 3, r, size) for r in range(size)]
        assert len({len(s) for s in shards}) == 1  # equal length: no rank waits
        steps = steps if steps is not None else -(-len(shards[0]) // batch)
        for step in range(steps):
            for rank_shard in shards:
                seen.extend(rank_shard[step * batch:(step + 1) * batch])
            done = min(done + sum(len(s[step * batch:(step + 1) * batch]) for s in shards),
                       samples)
        assert sorted(set(seen)) == sorted(order[:done])  # exactly the committed prefix
    assert done == samples and len(seen) - samples < 3  # padding: < size samples, once


# What the survivors of a lost worker saw (CI and here): Gloo's text, hvdtrain's op name, no
# capitalised "Horovod"; and Horovod's own shut-down text.
GLOO_TEXT = ("[/tmp/tmp.x/horovod-0.28.1/third_party/compatible17_gloo/gloo/transport/tcp/pair.cc:"
             "589] Read error [127.0.0.1]:34518: Connection reset by peer\n\t "
             "[[{{node sgd/hvdtrain.gradients}}]]")
SHUT_DOWN_TEXT = "Horovod has been shut down. This was caused by an exception on one of the ranks"


@pytest.mark.parametrize("text", [GLOO_TEXT, SHUT_DOWN_TEXT])
@pytest.mark.parametrize("error", ["UnknownError", "AbortedError"])
def test_a_collective_failed_by_a_lost_worker_resets_the_elastic_loop(error, text):
    """Every way TensorFlow reports a Horovod collective that a lost worker broke reaches
    hvd.elastic.run as HorovodInternalError (roll back and reset), and no other UnknownError
    reaches Horovod's TensorFlow wrapper, which would swallow it (the worker would exit 0 and the
    driver end the job); other errors pass through unchanged."""
    import tensorflow as tf
    from horovod.common.exceptions import HorovodInternalError

    from hvdtrain.keras.elastic import _collective_failures

    @_collective_failures
    def step(exc):
        raise exc

    with pytest.raises(HorovodInternalError):
        step(getattr(tf.errors, error)(None, None, text))
    with pytest.raises(RuntimeError, match="UnknownError: something else"):
        step(tf.errors.UnknownError(None, None, "something else"))
    with pytest.raises(ValueError):
        step(ValueError("Horovod"))


def test_a_second_signal_in_the_same_group_is_pushed_too():
    # Before: the flags were pushed once, so SIGTERM then SIGUSR1 inside one accumulation group
    # stopped as SIGTERM and never requeued.
    import signal

    from hvdtrain.run import preempt
    from hvdtrain.keras.optimizer import PreemptFlags
    from hvdtrain.keras.trainer_callbacks import StopOnSignal
    signals = preempt.Preemption(enabled=False)
    flags = PreemptFlags()
    stop = StopOnSignal(flags, k=4, signals=signals)
    stop.on_train_batch_begin(0)
    assert keras.ops.convert_to_numpy(flags.requested).tolist() == [0.0, 0.0]
    signals._handle(signal.SIGTERM, None)
    stop.on_train_batch_begin(1)
    assert keras.ops.convert_to_numpy(flags.requested).tolist() == [1.0, 0.0]
    signals._handle(signal.SIGUSR1, None)
    stop.on_train_batch_begin(2)
    assert keras.ops.convert_to_numpy(flags.requested).tolist() == [1.0, 1.0]
    assert preempt.agreed_signal([1.0, 1.0]) == "SIGUSR1"
