"""Code Horovod and PyTorch users already have, on 2 real ranks (the session's rank pools) (README,
"Your existing Horovod code"): Horovod's TensorFlow API and its Keras layer with Keras 3 models,
PyTorch optimizer habits on the optimizer distribute() returns, several models in one program.
Each trained case is compared with one process training on the global batch, and the two ranks
with each other."""
import importlib.util
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


def test_unnamed_collectives_after_hvd_join_with_uneven_data(pools, tmp_path):
    """Rank 1 takes one step more than rank 0, which waits in hvd.join(); then hvd.allreduce,
    allgather, broadcast, alltoall, reducescatter and grouped_allreduce without a name. Before
    scripts/horovod_patches/16-*, the first of them waited forever ("Missing ranks: 0:
    [allreduce.noname.N] 1: [allreduce.noname.N+2]"); a hang ends the pool in 2 min."""
    out = tmp_path / "result.json"
    pools.get().run(rank_script("torch_habits.py"), "--join", "--out", out, timeout=120)
    result = json.loads(out.read_text())
    join = result["join"]
    assert join["rank_spread"] == 0.0  # every rank took the last joined rank's weights
    size = result["size"]
    for rank, seen in enumerate(join["ranks"]):
        assert seen == {
            "last_joined": size - 1,
            "allreduce": [size * (size + 1) / 2],
            "allgather": [float(r) for r in range(size)],
            "broadcast": [float(size - 1)],
            "alltoall": [10.0 * r + rank for r in range(size)],
            "reducescatter": [size * (size + 1) / 2],
            "grouped_allreduce": [[size * (size - 1) / 2], [float(size)] * 2],
        }, rank


@pytest.fixture(scope="module")
def lightning(pools, tmp_path_factory):
    if importlib.util.find_spec("lightning") is None:  # make setup installs it (setup.sh)
        pytest.skip("PyTorch Lightning is not installed (pip install hvdtrain[lightning])")
    out = tmp_path_factory.mktemp("lightning") / "result.json"
    pools.get().run(rank_script("lightning_checks.py"), "--out", out)
    return json.loads(out.read_text())


def test_a_lightning_trainer_with_strategy_horovod_trains_as_one_process(lightning):
    """PyTorch Lightning 2.x's Trainer(strategy="horovod") (hvdtrain.torch.lightning; Lightning
    2.0 removed its own): accumulate_grad_batches=4 over epochs of 6 micro-batches, clipping,
    momentum and a SequentialLR (warmup, then StepLR), on the DistributedSampler the Trainer put
    in, equals one process on the global batch (clipping the averaged gradients)."""
    r = lightning["automatic"]
    assert r["vs_reference"] < 1e-6 and r["rank_spread"] == 0.0
    assert r["optimizer_steps"] == 4  # 2 epochs x (one group of 4 + one of 2)
    assert r["lr"] == pytest.approx(r["reference_lr"]) == pytest.approx(0.1)
    assert r["sampler"] == "DistributedSampler"
    size = lightning["size"]
    assert r["world_size"] == size == 2 and r["global_rank"] == list(range(size))
    assert r["is_global_zero"] == [True] + [False] * (size - 1)
    assert r["rank_zero_only"] == list(range(size))
    # hvdtrain.torch.init(seed=None), which the strategy calls: the random generators untouched
    assert lightning["init_seed_none"] == {"seed": None, "rng_unchanged": True}


def test_lightning_resumes_from_a_checkpoint_with_its_schedule(lightning):
    """One epoch, then a new module and Trainer resumed from the checkpoint (ckpt_path): the
    uninterrupted reference's weights and learning rate. Before, the optimizer's loaded state
    replaced the param groups that the SequentialLR's own schedulers drive (lr 0.2, not 0.1)."""
    r = lightning["resumed"]
    assert r["vs_reference"] < 1e-6 and r["rank_spread"] == 0.0
    assert r["lr"] == pytest.approx(r["reference_lr"])


def test_lightning_logs_gathers_and_checkpoints_through_horovod(lightning):
    r = lightning["automatic"]
    assert r["logged_spread"] == 0.0  # self.log(sync_dist=True): the mean over the ranks
    assert r["gathered"] == [[0.0, 7.0], [1.0, 7.0]]  # self.all_gather: (size, ...)
    # all_gather(sync_grads=True) sends gradients back summed over the ranks, as under DDP
    # (Horovod's own allgather averages them): sum over ranks j of (j + 1)
    size = lightning["size"]
    assert r["gathered_grad"] == [size * (size + 1) / 2] * size
    assert r["checkpoints"] == ["last.ckpt"] and r["checkpoint_matches"]
    assert r["checkpoints_written"][0] > 0 and r["checkpoints_written"][1:] == [0] * (size - 1)
    assert r["fit_again"].startswith("this LightningModule was already trained with "
                                     "strategy='horovod' in this process")


def test_lightning_manual_optimization_with_two_optimizers(lightning):
    """automatic_optimization=False, SGD and Adam on two parts of the model, manual_backward,
    opt.step() and opt.zero_grad() through Lightning's optimizer wrappers (before: a
    RecursionError in Horovod's zero_grad)."""
    r = lightning["manual"]
    assert r["vs_reference"] < 1e-6 and r["rank_spread"] == 0.0


def test_lightning_refusals_and_collectives_say_what_to_do(lightning):
    r = lightning["refusals"]
    assert "Trainer(accumulate_grad_batches=k)" in r["accumulation_scheduler"]
    assert r["reduce_op"].startswith("reduce_op 'product' is not supported")
    assert r["reduce_sum"] == [2.0, 2.0] and r["reduce_int_mean"] == 0.5
    assert r["reduce_other"] == "not a tensor"  # returned as it is, as DDP's reduce does
    assert r["broadcast"] == {"from": 1}
    assert r["compression"] == "compression must be one of none, fp16; got 'int8'"
    # torchmetrics over Horovod with metric_sync(): every rank's state; without, its own.
    size = lightning["size"]
    assert r["metrics"]["cat"] == [float(i) for rank in range(size) for i in range(rank + 2)]
    assert r["metrics"]["alone"] == [0.0, 1.0] and r["metrics"]["sum"] == size * (size + 1) / 2


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


def test_horovods_tensorflow_collectives_take_bfloat16(tf_habits):
    """allreduce (sum, average, in a tf.function), grouped_allreduce beside a float32 tensor:
    the float32 result rounded once, bit for bit; allgather, broadcast, alltoall and
    broadcast_variables: the same bits (scripts/horovod_patches/17-*)."""
    for rank, checks in enumerate(tf_habits["bf16_collectives"]):
        assert checks == dict.fromkeys(checks, True), (rank, checks)
        assert len(checks) == 8


@pytest.fixture(scope="module")
def hvd_keras(pools, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hvd_keras")
    pools.keras("tensorflow").run(rank_script("hvd_keras_habits.py"), "--out",
                                  folder / "result.json", "--dir", folder)
    return json.loads((folder / "result.json").read_text())


@pytest.mark.parametrize("case", ["fit", "tf_entry", "standalone"])
def test_horovods_keras_optimizer_trains_keras3_as_one_process(hvd_keras, case):
    """Horovod's canonical Keras script on Keras 3 (model.fit, hvd.DistributedOptimizer, the
    broadcast callback), also through horovod.tensorflow.DistributedOptimizer and horovod.keras:
    the ranks' weights identical and equal to one process on the global batch. Upstream, the
    optimizer never all-reduced on Keras 3 and the broadcast callback failed (patch 15)."""
    assert hvd_keras["size"] == 2
    r = hvd_keras[case]
    assert r["rank_spread"] == 0.0
    assert r["vs_reference"] < 1e-6
    if case == "fit":
        assert r["optimizer"] == "SGD"  # the wrapper keeps the optimizer's name


def test_horovods_partial_optimizer_keeps_a_rank_local_layer_on_keras3(hvd_keras):
    """horovod.keras.PartialDistributedOptimizer(local_layers=[head]) in model.fit, both ranks
    starting from the same weights: the shared layer stays equal, the local head (trained on each
    rank's own gradients) moves apart."""
    assert hvd_keras["partial"]["shared_spread"] == 0.0
    assert hvd_keras["partial"]["local_spread"] > 0.01


def test_horovods_broadcast_callback_gives_every_rank_rank0s_weights(hvd_keras):
    assert hvd_keras["broadcast"]["rank_spread"] == 0.0
    assert hvd_keras["broadcast"]["without_callback"] > 0.01


@pytest.mark.parametrize("case", ["passes_sum", "passes_mean"])
def test_horovods_backward_passes_per_step_on_keras3(hvd_keras, case):
    """backward_passes_per_step=2: 6 micro-batches, 3 updates; the passes summed (one process at
    twice the rate) or averaged (average_aggregated_gradients=True: one process, same rate). The
    summed run has the broadcast callback, whose broadcast after the first micro-batch must leave
    each rank's accumulated gradients alone (it took rank 0's: 0.05 off the reference)."""
    r = hvd_keras[case]
    assert r["rank_spread"] == 0.0 and r["updates"] == 3
    assert r["vs_reference"] < 1e-6


def test_horovods_metric_average_callback_on_keras3(hvd_keras):
    r = hvd_keras["metric_average"]
    assert r["averaged_spread"] == 0.0 and r["own_spread"] > 0.01
    assert r["averaged"] == pytest.approx(r["own_mean"], rel=1e-6)


def test_horovods_learning_rate_callbacks_on_keras3(hvd_keras):
    """Warmup over 2 epochs from initial_lr / size (Goyal et al. 2017, Horovod's formula: 3/4 of
    the rate after the first epoch at size 2, all of it after the second), then a schedule
    callback's x0.5 from epoch 2, as logged in each epoch's `lr`."""
    r = hvd_keras["lr_callbacks"]
    assert r["lr"] == pytest.approx([0.75 * r["initial_lr"], r["initial_lr"],
                                     0.5 * r["initial_lr"]], rel=1e-6)


def test_a_model_saved_with_horovods_optimizer_loads_with_and_without_horovod(hvd_keras):
    """keras.models.load_model gives Keras's own SGD (the wrapper keeps its module);
    hvd.load_model gives Horovod's optimizer with the saved state (iterations, momentum), which
    trains on with the ranks equal; a user's optimizer class comes through custom_optimizers,
    and a model saved with backward_passes_per_step=2 still sums its 2 passes."""
    r = hvd_keras["saved"]
    assert r["plain_is_keras"] and r["plain_optimizer"].startswith("keras.")
    assert r["plain_lr"] == pytest.approx(0.1)
    assert r["saved_variables"] == 6  # iterations, rate, 4 momentums: no model weight tracked
    assert r["loaded_distributed"] and r["loaded_state"] == 0.0
    assert r["loaded_trains"] > 0.0 and r["loaded_spread"] == 0.0
    assert r["custom_optimizer"] == ["MySGD", True]
    assert r["summing"] == [2, 2]


def test_horovods_keras_optimizer_refuses_what_it_cannot_do_on_keras3(hvd_keras):
    r = hvd_keras["refused"]
    assert r["loss_scale"].startswith("DistributedOptimizer cannot wrap a Keras 3 "
                                      "LossScaleOptimizer")
    assert "hvdtrain.keras.distribute" in r["loss_scale"]
    assert r["mixed_float16"].startswith("the dtype policy is mixed_float16, so compile() would "
                                         "wrap DistributedOptimizer in a LossScaleOptimizer")
    assert r["multi"].startswith("DistributedOptimizer cannot wrap a Keras 3 MultiOptimizer")
    assert "gradient_accumulation_steps=3" in r["accumulation"]
    assert "backward_passes_per_step=2" in r["accumulation"]


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
