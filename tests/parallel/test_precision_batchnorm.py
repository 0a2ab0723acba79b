"""`hvdtrain train` on 2 real ranks (the session's rank pools; `--device cuda` under a real
`horovodrun -np 1`) with what GPU jobs use, run on the CPU: BatchNorm
models (statistics equal on every rank), mixed precision (bf16 both frameworks, fp16 with a
dynamic loss scale for PyTorch, composed with accumulation and the non-finite check), and the
device choice. Numbers come from the metrics.json / checkpoint files the jobs write."""
import json

import pytest
import torch

from jobs import KERAS_BACKENDS, Console, horovodrun, rank_script, run

FRAMEWORKS = pytest.mark.parametrize("framework", ["torch", "keras"])


def train(out, *args, framework="torch", np_=2):
    return horovodrun(np_, "hvdtrain", "train", "--framework", framework, "--output-dir",
                      str(out), "--no-progress", *args)



def metrics(out):
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_sync_buffers_averages_or_broadcasts(keras_ranks, tmp_path, backend):
    out = tmp_path / "result.json"
    keras_ranks.run(rank_script("keras_sync_buffers.py"), "--out", out)
    r = json.loads(out.read_text())
    for op in ("average", "broadcast"):
        assert r[op]["variables"] == 2  # moving_mean, moving_variance
        assert r[op]["spread_before"] > 1e-3  # each rank's own data: the statistics drifted
        assert r[op]["spread_after"] == 0.0
        assert r[op]["diff_to_expected"] < 1e-6  # mean over ranks / rank 0's
    assert r["callbacks"] == ["MetricAverageCallback", "SyncBuffersCallback", "WarmupCallback"]
    assert r["averaged_logs"] == {"loss": 0.5, "accuracy": 1.0}  # means over the two ranks


@FRAMEWORKS
def test_a_batchnorm_model_ends_equal_on_every_rank(train_here, tmp_path, framework):
    train_here(tmp_path, "--batchnorm", "--epochs", "3", "-k", "2", framework=framework)
    m = metrics(tmp_path)
    # ranks_agree compares every rank's weights *and* BatchNorm statistics (a float64 checksum
    # gathered from all ranks); without sync_buffers they differ (the adapter tests show it).
    assert m["ranks_agree"] is True and m["config"]["batchnorm"] is True
    assert m["epochs"][-1]["test_accuracy"] > 0.85
    if framework == "torch":
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
        assert any(k.endswith("running_mean") for k in state)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_torch_mixed_precision_with_accumulation(train_here, tmp_path, precision):
    train_here(tmp_path, "--precision", precision, "--batchnorm", "--epochs", "3", "-k", "2")
    m = metrics(tmp_path)
    assert m["precision"] == precision and m["device"] == "cpu"
    assert m["ranks_agree"] is True and m["skipped_steps"] == 0 and m["overflow_steps"] == 0
    assert m["epochs"][-1]["test_accuracy"] > 0.85
    scaler = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["scaler"]
    assert (scaler is not None) == (precision == "fp16")


def test_fp16_overflow_is_skipped_by_the_scaler_not_counted_as_a_failure(train_here, tmp_path):
    # A loss scale of 1e12 overflows fp16 gradients until the scaler has halved it ~24 times.
    train_here(tmp_path, "--precision", "fp16", "--init-loss-scale", "1e12", "--epochs", "3",
               "-k", "2")
    m = metrics(tmp_path)
    assert m["overflow_steps"] >= 10 and m["skipped_steps"] == 0 and m["ranks_agree"] is True
    steps = sum(e["optimizer_steps"] for e in m["epochs"])
    assert steps == 3 * m["steps_per_epoch"] - m["overflow_steps"]
    assert m["epochs"][-1]["test_accuracy"] > 0.5
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["scaler"]["scale"] < 1e6


def test_fp16_nan_loss_is_a_failure_not_an_overflow(train_here, tmp_path):
    proc = train_here(tmp_path, "--precision", "fp16", "--epochs", "1", "-k", "2",
                      "--fault-nan-at", "1:5")
    m = metrics(tmp_path)
    assert m["skipped_steps"] == 1 and m["overflow_steps"] == 0 and m["ranks_agree"] is True
    assert "non-finite loss on rank(s) [1] at optimizer step 5" in proc.text


def test_keras_bf16(train_here, tmp_path):
    train_here(tmp_path, "--precision", "bf16", "--epochs", "3", framework="keras")
    m = metrics(tmp_path)
    assert m["precision"] == "bf16" and m["ranks_agree"] is True
    assert m["epochs"][-1]["test_accuracy"] > 0.85


def test_keras_fp16_overflow_is_skipped_on_every_rank_not_counted_as_a_failure(train_here,
                                                                               tmp_path):
    # Keras's LossScaleOptimizer around the distributed one; its overflow check is all-reduced.
    train_here(tmp_path, "--precision", "fp16", "--init-loss-scale", "1e12", "--epochs", "2",
               framework="keras")
    m = metrics(tmp_path)
    assert m["precision"] == "fp16" and m["ranks_agree"] is True
    assert m["overflow_steps"] >= 10 and m["skipped_steps"] == 0
    steps = sum(e["optimizer_steps"] for e in m["epochs"])
    assert steps == 2 * m["steps_per_epoch"] - m["overflow_steps"]  # k=1: one per micro-batch
    assert m["epochs"][-1]["test_accuracy"] > 0.5


def test_keras_fp16_nan_loss_is_a_failure_not_an_overflow(train_here, tmp_path):
    proc = train_here(tmp_path, "--precision", "fp16", "--epochs", "1", "--fault-nan-at", "1:5",
                      framework="keras")
    m = metrics(tmp_path)
    assert m["skipped_steps"] == 1 and m["overflow_steps"] == 0 and m["ranks_agree"] is True
    assert "non-finite loss on rank(s) [1] at optimizer step 5" in proc.text


def test_device_cuda_without_a_gpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU; tests/gpu covers --device cuda")
    proc = run(train(tmp_path, "--device", "cuda", "--epochs", "1", np_=1), check=False)
    assert proc.returncode != 0
    assert "no CUDA GPU is visible" in Console.of(proc).text
