"""hvdtrain.torch on 2 real ranks (the session's rank pool) for what GPU jobs rely on, checked on
the CPU: channels_last models and BatchNorm statistics (tests/parallel/torch_layout_checks.py),
bfloat16 models and tensors (tests/parallel/torch_bf16_checks.py)."""
import json

import pytest

from jobs import rank_script

SIZE = 2


def result_of(pools, tmp_path_factory, script: str) -> dict:
    """One request of ``script`` to the torch pool; what its rank 0 wrote."""
    out = tmp_path_factory.mktemp(script.removesuffix(".py")) / "result.json"
    pools.get().run(rank_script(script), "--out", out)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def checks(pools, tmp_path_factory):
    return result_of(pools, tmp_path_factory, "torch_layout_checks.py")


@pytest.mark.parametrize("case", ["none_k2", "fp16_k1"])
def test_a_channels_last_model_trains_like_the_contiguous_one(checks, case):
    c = checks["layouts"][case]
    assert c["moved"] > 1e-2  # it trained
    # Same weights as the contiguous model (float32 rounding of another conv summation order;
    # fp16 compression rounds both runs' gradients alike).
    assert c["max_diff_to_contiguous"] < 1e-5
    assert c["ranks_equal"] is True
    assert c["grads_channels_last"] == [True, True] and c["weights_channels_last"] == [True, True]


def test_a_channels_last_step_copies_no_gradient(checks):
    # The all-reduce runs in place on a permuted view of each gradient's own memory (#50): no
    # copy of a gradient-sized tensor beyond the plain loop's (none here, fp32). The control, the
    # contiguous copy and the copy back DenseLayout made before, shows that the counter sees
    # them: 2 per 3x3 conv weight (a 1x1 kernel would be contiguous in both formats).
    c = checks["step_copies"]
    assert c["distributed"] == c["plain"]
    extra = [op for op in c["copy_layout"] if op not in c["plain"]]
    assert sorted(extra) == sorted([["clone", 216], ["copy_", 216], ["clone", 576],
                                    ["copy_", 576]]), c


def test_a_gradient_one_rank_lacks_is_averaged_with_zeros_in_the_same_layout(checks):
    # A channels_last conv that only rank 0 uses: its weight moves by half rank 0's gradient on
    # both ranks (Horovod sends zeros for rank 1; laid out as the parameter, not contiguous).
    c = checks["unused_on_one_rank"]
    assert c["max_diff"] < 1e-6 and c["ranks_equal"] is True, c


@pytest.mark.parametrize("op", ["average", "broadcast"])
def test_sync_buffers_makes_batchnorm_statistics_equal(checks, op):
    b = checks["batchnorm"][op]
    assert b["buffers"] == 3  # running_mean, running_var, num_batches_tracked
    assert b["spread_before"] > 1e-3  # each rank's own batches: the statistics drifted apart
    assert b["spread_after"] == 0.0
    # average: the mean of the ranks' statistics; broadcast: rank 0's (as DDP).
    assert b["diff_to_expected"] < 1e-12
    assert b["num_batches_tracked"] == [6, 6]


def test_batchnorm_errors_say_what_to_do(checks):
    b = checks["batchnorm"]
    assert "op must be one of average, broadcast" in b["bad_op_error"]
    assert "needs the model on its GPU" in b["sync_batchnorm_cpu_error"]
    assert "sync_buffers(model)" in b["sync_batchnorm_cpu_error"]
    assert b["converted"] == {"type": "SyncBatchNorm", "same_parameters": True}


def test_rank_info_names_the_device(checks):
    assert checks["size"] == SIZE and checks["device"] == "cpu"


@pytest.fixture(scope="module")
def bf16(pools, tmp_path_factory):
    return result_of(pools, tmp_path_factory, "torch_bf16_checks.py")


@pytest.mark.parametrize("kind", ["hvdtrain", "horovod"])
def test_a_bfloat16_model_trains_as_one_process_on_the_global_batch(bf16, kind):
    """A model in bfloat16 (weights, gradients, momentum) through distribute(), or through
    Horovod's DistributedOptimizer with broadcast_parameters and broadcast_optimizer_state from
    a rank 1 that started elsewhere: bit for bit the one-process reference (each rank's shard
    gradient averaged in float32, rounded once), ranks identical. Before
    scripts/horovod_patches/17-*: "Tensor type torch.BFloat16Tensor is not supported."."""
    r = bf16["trained"][kind]
    assert r["dtypes"] == ["torch.bfloat16"]
    assert r["moved"] > 0.01  # it trained
    assert r["equal_to_reference"] is True
    assert r["ranks_equal"] is True


def test_every_collective_takes_bfloat16_tensors(bf16):
    """allreduce (sum, average, min, max, in place), grouped_allreduce beside a float32 tensor
    and reducescatter: the float32 result rounded once, bit for bit; allgather, broadcast (also
    in place) and alltoall: the same bits, a NaN's payload, -0.0, inf and a subnormal too."""
    assert len(bf16["collectives"]) == SIZE
    for rank, checks in enumerate(bf16["collectives"]):
        assert checks == dict.fromkeys(checks, True), (rank, checks)
        assert len(checks) == 11
