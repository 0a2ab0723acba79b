"""Code Horovod and PyTorch users already have, on 2 real ranks (the session's rank pools) (README,
"Your existing Horovod code"): Horovod's TensorFlow API with Keras 3 models, PyTorch optimizer
habits on the optimizer distribute() returns, several models in one program. Each trained case is
compared with one process training on the global batch, and the two ranks with each other."""
import json
from pathlib import Path

import pytest

from jobs import rank_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def torch_habits(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_habits") / "result.json"
    pools.get().run(rank_script("torch_habits.py"), "--out", out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["hvdtrain_set_to_none", "hvdtrain_zeros", "beside_horovod",
                                  "late_group", "two_late_groups", "unfreeze"])
def test_torch_habits_train_as_one_process_on_the_global_batch(torch_habits, case):
    """Two models with gradients from one backward pass: each through distribute() (zero_grad
    with set_to_none True and False), or one through Horovod's own DistributedOptimizer beside
    hvdtrain's; a param group added with add_param_group() after distribute() (to each of two
    distributed optimizers at once, without an lr: the scaled rate); a model frozen at
    distribute() and unfrozen after the first step."""
    r = torch_habits[case]
    assert r["rank_spread"] == 0.0
    assert r["vs_reference"] < 1e-6
    assert r["grads_after_zero_grad"] == (["zeros"] if case == "hvdtrain_zeros" else ["none"])


def test_distribute_twice_says_what_to_do(torch_habits):
    message = torch_habits["distribute_twice"]
    assert message.startswith("this optimizer is already distributed")
    assert "call distribute() once per model" in message


@pytest.fixture(scope="module")
def tf_habits(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_habits") / "result.json"
    pools.keras("tensorflow").run(rank_script("tf_habits.py"), "--out", out)
    return json.loads(out.read_text())


def test_horovod_tf2_loop_trains_keras3_models_as_one_process(tf_habits):
    """hvd.DistributedGradientTape + hvd.broadcast_variables on a Keras 3 model (before the
    patches: "'Variable' object has no attribute 'ref'" and "no attribute 'assign'")."""
    assert tf_habits["size"] == 2
    assert tf_habits["tape"]["rank_spread"] == 0.0
    assert tf_habits["tape"]["vs_reference"] < 1e-6


def test_partial_tape_keeps_a_rank_local_layer(tf_habits):
    assert tf_habits["partial"]["shared_spread"] == 0.0
    assert tf_habits["partial"]["local_spread"] > 0.01


def test_sync_batch_normalization_uses_the_global_batch_on_keras3(tf_habits):
    """hvd.SyncBatchNormalization in a Keras 3 model (before: "Unrecognized keyword arguments
    ... {'fused': False}"): weights and moving statistics as plain BatchNormalization on the
    whole global batch in one process; without it they are far off."""
    r = tf_habits["sync_batch_norm"]
    assert r["rank_spread"] == 0.0
    assert r["vs_reference"] < 1e-5
    assert r["plain_vs_reference"] > 100 * max(r["vs_reference"], 1e-6)


def test_gan_example_trains_two_models(ranks, tmp_path):
    """examples/pytorch_gan.py: generator and discriminator, each through distribute()."""
    out = tmp_path / "gan.json"
    ranks.run(EXAMPLES / "pytorch_gan.py", out)
    r = json.loads(out.read_text())
    assert r["size"] == 2 and r["rank_spread"] == 0.0
    # The generated digits' mean image is near the real one: 10x closer than a grey image.
    assert r["mean_error"] < r["grey_error"] / 5


@pytest.fixture(scope="module", params=["tensorflow", "torch"])
def keras_habits(request, pools, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"keras_habits_{request.param}") / "result.json"
    pools.keras(request.param).run(rank_script("keras_habits.py"), "--out", out)
    result = json.loads(out.read_text())
    assert result["backend"] == request.param and result["size"] == 2
    return result


def test_a_loaded_distributed_model_keeps_its_rate(keras_habits):
    """load_model of a model saved by a distributed run, then distribute() again: 0.02 x 2
    ranks saved, loaded and kept (before: the restored schedule was scaled again, 0.16)."""
    r = keras_habits["loaded"]
    assert r["saved"] == pytest.approx(0.04) and r["loaded"] == pytest.approx(0.04)
    assert r["distributed"] == pytest.approx(0.04)
    assert r["class"] == "SGD" and r["spread"] == 0.0


def test_distribute_after_fit_takes_effect(keras_habits):
    """fit() undistributed on each rank's own data, distribute(), fit() again without compiling:
    the ranks end equal (before, on TensorFlow, the cached train function skipped the
    all-reduce). A model compiled with another optimizer is refused."""
    r = keras_habits["after_fit"]
    assert r["spread"] == 0.0
    assert r["other_optimizer"].startswith("the model was compiled with another optimizer")


def test_steps_per_execution_trains_exactly_the_epoch(keras_habits):
    chunks = keras_habits["chunks"]
    assert chunks["1"]["micro_batches"] == 12  # 2 epochs of 6
    if keras_habits["backend"] == "tensorflow":
        assert chunks["3"]["micro_batches"] == 12
        assert max(abs(a - b) for a, b in zip(chunks["1"]["weights"],
                                               chunks["3"]["weights"])) < 1e-6
    else:  # Keras's own rule on its PyTorch backend
        assert "steps_per_execution` must be 1" in chunks["3"]["error"]
    if keras_habits["backend"] == "tensorflow":
        assert chunks["4"]["error"].startswith(
            "steps_per_epoch=6 is not a multiple of the model's steps_per_execution=4")


@pytest.mark.parametrize("callback", ["scheduler", "plateau"])
def test_keras_lr_callbacks_set_the_distributed_rate(keras_habits, callback):
    """LearningRateScheduler (x0.5 from the second epoch) and ReduceLROnPlateau (x0.5 every
    epoch here) on the optimizer distribute() returned (before: TypeError, "created with a
    LearningRateSchedule")."""
    r = keras_habits["lr_callbacks"][callback]
    assert r["rates"] == pytest.approx([0.02, 0.01, 0.005]) and r["spread"] == 0.0


def test_a_sharded_dataset_without_steps_per_epoch_ends_its_epoch(keras_habits):
    r = keras_habits["no_steps"]
    assert r["micro_batches"] == r["steps_per_epoch"] == 6
    assert r["evaluated"] > 0  # evaluate(data) ended too
    assert r["val_loss"] > 0  # and validation_data=data without validation_steps
