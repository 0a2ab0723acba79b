"""hvdtrain.torch's adapter on one CUDA GPU (tests/gpu/gpu_checks.py's checks, run as the cases
``layouts`` and ``sync_batchnorm`` of the session's shared GPU job, tests/gpu/rank_cases.py):
channels_last conv models and SyncBatchNorm. Skipped without CUDA (see conftest.py)."""
import json

import pytest


def result(gpu, case: str) -> dict:
    """What adapter case ``case`` of the shared GPU job wrote (its failure fails the test)."""
    return json.loads((gpu.case(case) / "result.json").read_text())


def test_rank_runs_on_the_gpu(gpu):
    for case in ("layouts", "sync_batchnorm"):
        r = result(gpu, case)
        assert r["size"] == 1 and r["device"] == "cuda:0" and r["nccl_built"] is True, r


@pytest.mark.parametrize("case", ["none_k2", "fp16_k1"])
def test_channels_last_cuda_model_trains_like_the_contiguous_one(gpu, case):
    c = result(gpu, "layouts")["layouts"][case]
    assert c["devices"] == ["cuda:0"]
    assert c["moved"] > 1e-2  # it trained (3-6 SGD steps, lr 0.1)
    # Not bitwise: cuDNN picks other kernels for NHWC than for NCHW, which sum in another order.
    # In float32 (TF32 off in the script) that is ~1e-7 per step (the same check run on the
    # CPU: 1.5e-8, 9e-7 with fp16 compression); 1e-4 leaves room for cuDNN's kernels and is
    # still far below what a gradient on the wrong elements would do (the weights move by 6e-2
    # to 1.6e-1 here).
    assert c["max_diff_to_contiguous"] < 1e-4
    # The same steps on the CPU: CUDA kernels compute what the CPU ones compute.
    assert c["max_diff_cuda_to_cpu"] < 1e-4
    # Every gradient went through Horovod's all-reduce at every step (hooks forced on one rank),
    # came back in the parameters' layout, and the weights stayed NHWC.
    steps = 6 // int(case[-1])
    assert c["allreduces_per_step"] == [c["parameters"]] * steps
    assert c["grads_channels_last"] == [True, True] and c["weights_channels_last"] == [True, True]


def test_a_bf16_channels_last_step_adds_no_copies_or_host_syncs(gpu):
    # Counted, not timed (#50): every gradient goes through Horovod's all-reduce (hooks on), as a
    # permuted view of its own memory; the step copies no gradient-sized tensor and makes no
    # host synchronisation PyTorch sees beyond what the plain loop does (autocast's bf16 weight
    # casts are copies both loops make).
    c = result(gpu, "layouts")["layouts"]["step_counts"]
    assert c["distributed"]["copies"] == c["plain"]["copies"], c
    assert c["distributed"]["syncs"] == c["plain"]["syncs"], c


def test_sync_batchnorm_converts_and_steps_on_cuda(gpu):
    b = result(gpu, "sync_batchnorm")["batchnorm"]
    assert b["types"] == ["SyncBatchNorm", "SyncBatchNorm"]
    assert b["num_batches_tracked"] == [3, 3]
    assert all(l == l and abs(l) < 1e3 for l in b["losses"])  # finite
    assert b["moved"] > 1e-2
    # One rank: Horovod's layer normalises with the batch's own statistics, which is exactly what
    # torch's BatchNorm2d does (same kernel): the same parameters and running statistics.
    assert b["max_param_diff_to_plain_bn"] < 1e-6
    assert b["max_running_stats_diff_to_plain_bn"] < 1e-6


def test_sync_batchnorm_cross_rank_path_matches_batch_norm(gpu):
    # Horovod's all-gather / all-reduce path of SyncBatchNorm, run on one rank, against
    # F.batch_norm: forward, the three gradients and the running statistics (float32; the
    # statistics are combined by other kernels, so not bitwise).
    diffs = result(gpu, "sync_batchnorm")["batchnorm"]["sync_path_max_diff"]
    assert set(diffs) == {"output", "grad_input", "grad_weight", "grad_bias", "running_mean",
                          "running_var"}
    assert all(d < 1e-4 for d in diffs.values()), diffs
