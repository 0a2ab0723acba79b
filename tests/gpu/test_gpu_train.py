"""``hvdtrain train --framework torch`` on one CUDA GPU (``horovodrun -np 1``), against the same
runs on the CPU: fp32 numerics, mixed precision with accumulation, BatchNorm, and a checkpoint
written on the GPU resumed on the CPU; and Keras on its PyTorch backend on the GPU. Skipped
without CUDA (see conftest.py).

Each run is a case of the session's shared GPU job (tests/gpu/rank_cases.py: ``hvdtrain train``'s
own entry point, one case after another in one CUDA process, TF32 off) or, where it needs a
process of its own, a side job started beside it (tests/gpu/gpujobs.py's ``SIDES``); the ``gpu``
fixture (conftest.py) starts them all once, and each test asserts on its own run's files.

Digits (1,437 train / 360 test samples), batch 16, 3 epochs unless stated. Reference numbers,
measured on the CPU with the same options (epoch-3 held-out accuracy): fp32 0.939; bf16 k=2
0.936; fp16 k=2 0.936; fp16 k=2 from loss scale 1e12 0.894 (24 overflowing steps);
--batchnorm 0.986.
"""
import json

import pytest
import torch

from gpujobs import metrics


def check_run(m: dict, device: str, precision: str = "fp32", k: int = 1) -> None:
    assert m["size"] == 1 and m["device"] == device and m["precision"] == precision
    assert m["backward_passes_per_step"] == k
    assert m["ranks_agree"] is True
    assert m["skipped_steps"] == 0  # no non-finite loss
    # Every optimizer step of every epoch was taken or, fp16 only, skipped by the loss scaler.
    taken = sum(e["optimizer_steps"] for e in m["epochs"])
    assert taken + (m.get("overflow_steps") or 0) == m["steps_per_epoch"] * len(m["epochs"])


@pytest.fixture(scope="module")
def fp32_runs(gpu):
    """The same fp32 run on the GPU and on the CPU (cases ``fp32_cuda`` and ``fp32_cpu``).

    TF32 is off for the GPU run (the shared job runs with NVIDIA_TF32_OVERRIDE=0, read by cuDNN
    and cuBLAS): by default PyTorch lets cuDNN run float32 convolutions in TF32 (10-bit mantissa)
    on Ampere and newer GPUs, which is another precision, not another order of summation.
    """
    return metrics(gpu.case("fp32_cuda")), metrics(gpu.case("fp32_cpu"))


def test_cuda_run_says_where_it_ran(fp32_runs):
    cuda, cpu = fp32_runs
    check_run(cuda, "cuda:0")
    check_run(cpu, "cpu")


def test_cuda_training_matches_the_cpu_within_tolerance(fp32_runs):
    """Not bitwise: cuDNN's and cuBLAS's kernels sum in other orders than the CPU's (and the
    weight-gradient kernels may use atomics), so each step differs by float32 rounding (~1e-7
    relative), and SGD amplifies that over hundreds of steps. Calibrated on the CPU by putting
    random relative noise of 1e-6 on every convolution output (4 seeds, 3 epochs): epoch-1 train
    loss moved <= 0.02 % relative, later epochs' train loss by up to 0.018 absolute (9 %
    relative at epoch 3: the loss is still falling fast, so relative bounds on it are not a
    sound test), held-out accuracy by up to 0.006. A real error (wrong loss weight, lr scale,
    a batch on the wrong device) moves epoch 1 by far more than 1 %.
    """
    cuda, cpu = fp32_runs
    first_cuda, first_cpu = cuda["epochs"][0]["train_loss"], cpu["epochs"][0]["train_loss"]
    assert abs(first_cuda - first_cpu) <= 0.01 * first_cpu, (first_cuda, first_cpu)
    for a, b in zip(cuda["epochs"], cpu["epochs"]):
        assert abs(a["train_loss"] - b["train_loss"]) <= 0.05, (a, b)
        assert a["lr"] == b["lr"] and a["optimizer_steps"] == b["optimizer_steps"]
    assert abs(cuda["final_test_accuracy"] - cpu["final_test_accuracy"]) <= 0.02
    assert cuda["final_test_accuracy"] >= 0.90 and cpu["final_test_accuracy"] >= 0.90


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_accumulation_trains(gpu, precision):
    m = metrics(gpu.case(f"{precision}_k2"))
    check_run(m, "cuda:0", precision, k=2)
    assert m["final_test_accuracy"] >= 0.85  # CPU, same options: 0.936
    assert m["epochs"][-1]["train_loss"] < m["epochs"][0]["train_loss"]


def test_fp16_overflowing_loss_scale_is_skipped_and_training_goes_on(gpu):
    # Loss scale 1e12: the scaled fp16 gradients overflow; GradScaler skips those steps (on every
    # rank alike) and halves the scale each time until it fits (about log2(1e12 / 2**16) = 24).
    m = metrics(gpu.case("fp16_overflow"))
    check_run(m, "cuda:0", "fp16", k=2)
    assert 0 < m["overflow_steps"] <= 40  # it overflowed, and the scale came down
    assert m["final_test_accuracy"] >= 0.80  # CPU, same options: 0.894


def test_batchnorm_trains_on_cuda(gpu):
    out = gpu.case("batchnorm")
    m = metrics(out)
    check_run(m, "cuda:0")
    assert m["final_test_accuracy"] >= 0.95  # CPU, same options: 0.986
    state = torch.load(out / "checkpoint.pt", weights_only=True, map_location="cpu")["model"]
    stats = [k for k in state if k.endswith("running_var")]
    assert len(stats) == 2 and all(bool((state[k] > 0).all()) for k in stats)


def test_keras_on_its_pytorch_backend_trains_on_cuda(gpu):
    """On GPUs Keras runs on its PyTorch backend (a GPU build of Horovod has no TensorFlow ops:
    scripts/setup.sh), its gradients all-reduced by horovod.torch over NCCL."""
    m = metrics(gpu.case("keras_cuda"))
    check_run(m, "cuda:0")
    assert m["versions"]["keras_backend"] == "torch"
    assert m["final_test_accuracy"] >= 0.85
    assert m["epochs"][-1]["train_loss"] < m["epochs"][0]["train_loss"]


def test_keras_cpu_rank_on_a_gpu_host_computes_on_the_cpu(gpu):
    """Keras's PyTorch backend would put a --device cpu rank's tensors on the visible GPU (it
    chooses when imported); hvdtrain train sets KERAS_TORCH_DEVICE, and hk.init refuses a Keras
    that computes elsewhere than the rank, so a finished run was on the CPU. Both are side jobs:
    processes of their own, launched as a user would."""
    m = metrics(gpu.side("keras_cpu_rank").out)
    check_run(m, "cpu")
    assert m["versions"]["keras_backend"] == "torch"
    assert m["final_test_accuracy"] >= 0.85
    # Without hvdtrain train's KERAS_TORCH_DEVICE, Keras takes the GPU and init refuses it.
    refused = gpu.side("keras_refuses_gpu", check=False)
    assert refused.returncode not in (0, None), refused.output
    assert "this rank computes on cpu, but Keras's PyTorch backend puts tensors on cuda" \
        in refused.stderr


@pytest.mark.parametrize("gpu_visible", [True, False], ids=["gpu-visible", "cpu-only-process"])
def test_cuda_checkpoint_resumes_on_the_cpu(gpu, gpu_visible):
    # gpu-visible: in the shared job (a CUDA process); cpu-only-process: a side job with
    # CUDA_VISIBLE_DEVICES="", as on a machine without a GPU. Each resumes its own copy of the
    # checkpoint_cuda case's folder, which stays as the GPU run left it.
    written_dir = gpu.case("checkpoint_cuda")
    written = metrics(written_dir)
    ckpt = torch.load(written_dir / "checkpoint.pt", weights_only=True)  # no map_location
    assert {t.device.type for t in ckpt["model"].values()} == {"cuda"}  # really a GPU checkpoint
    out = gpu.case("resume_gpu_visible") if gpu_visible else gpu.side("resume_cpu_only").out
    m = metrics(out)
    check_run(m, "cpu")
    assert m["resumed_from"] == {"epoch": 2, "size": 1, "global_batch": 16, "batch": 0}
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3, 4]
    assert m["epochs"][:2] == written["epochs"]  # the GPU epochs, carried over
    assert m["epochs"][3]["train_loss"] < m["epochs"][1]["train_loss"]  # went on learning
    assert m["final_test_accuracy"] >= 0.93  # CPU, 4 uninterrupted epochs: 0.953
    after = torch.load(out / "checkpoint.pt", weights_only=True)
    assert after["epoch"] == 4 and {t.device.type for t in after["model"].values()} == {"cpu"}


def test_keras_torch_step_on_cuda_synchronises_the_host_no_more_than_plain_keras(gpu):
    """The synchronisations PyTorch itself reports (torch.cuda.set_sync_debug_mode) in a Keras
    step on the GPU: distribute's step makes as many as plain Keras's (the schedule's constants
    come from tensors), hvdtrain train's step one more (the non-finite guard's decision, read
    once), and its loss as many as Keras's (tests/unit/keras_step_syncs.py --cuda, a side job:
    Keras on its PyTorch backend, imported fresh)."""
    counts = json.loads((gpu.side("keras_syncs").out / "counts.json").read_text())
    plain = counts["plain"]
    assert plain["cuda"] > 0, counts  # the count works: Keras's own step synchronises
    assert counts["distribute"] == plain, counts
    assert counts["distribute, loss scale"] == counts["plain, loss scale"], counts
    assert counts["train"]["cuda"] == plain["cuda"] + 1, counts
    assert counts["train loss"] == counts["keras loss"], counts
