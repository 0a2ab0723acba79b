"""hvdtrain.torch on 2 real ranks (the session's rank pool) for what GPU jobs rely on, checked on
the CPU: channels_last models and BatchNorm statistics (tests/parallel/torch_layout_checks.py)."""
import json

import pytest

from jobs import rank_script

SIZE = 2


@pytest.fixture(scope="module")
def checks(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("layout") / "result.json"
    pools.get().run(rank_script("torch_layout_checks.py"), "--out", out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["none_k2", "fp16_k1"])
def test_a_channels_last_model_trains_like_the_contiguous_one(checks, case):
    c = checks["layouts"][case]
    assert c["moved"] > 1e-2  # it trained
    # Same weights as the contiguous model (float32 rounding of another conv summation order;
    # fp16 compression rounds both runs' gradients alike).
    assert c["max_diff_to_contiguous"] < 1e-5
    assert c["ranks_equal"] is True
    assert c["grads_channels_last"] == [True, True] and c["weights_channels_last"] == [True, True]


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
