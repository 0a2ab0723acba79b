"""The GPU parts, checked where there is no GPU (the CPU machines and CI): tests/gpu is skipped
with its stated reason (so it cannot vanish silently), and benchmarks/gpu.py refuses to start
without CUDA or torchvision with exit status 2 and what to install, and runs end to end on the
CPU in a tiny configuration (Horovod at size 1 needs no launcher)."""
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "gpu.py"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # torch sees no CUDA device, on any machine
SMOKE = ["--device", "cpu", "--image-size", "32", "--batch-size", "4", "--iters", "2",
         "--warmup", "1", "--batches-per-iter", "1"]


def python(*args, env=None, timeout=600):
    full = dict(os.environ)
    full["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full.get('PATH', '')}"
    full.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


def bench_module():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # definitions only; torch is imported when main() runs
    return module


def torchvision_importable() -> bool:
    return importlib.util.find_spec("torchvision") is not None


@pytest.mark.parametrize("select", [[], ["-m", "gpu"]], ids=["all", "marker-gpu"])
def test_gpu_suite_is_skipped_with_its_reason_without_cuda(select):
    proc = python("-m", "pytest", "tests/gpu", "-rs", "-q", "-p", "no:cacheprovider", *select,
                  env=NO_GPU)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    # Every test skipped (none deselected by -m gpu: the marker is set at collection), none run.
    assert skipped and int(skipped.group(1)) >= 10, summary
    assert not re.search(r"passed|failed|error|deselected", summary), summary
    assert "no CUDA device: torch.cuda.is_available() is False" in out
    assert "tests/gpu needs an NVIDIA GPU, a CUDA build of torch and Horovod built with NCCL" in out


def test_benchmark_without_cuda_exits_2_saying_what_to_do():
    proc = python(str(BENCH), "--model", "tiny", env=NO_GPU)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "benchmarks/gpu.py: error: no CUDA device: torch.cuda.is_available() is False" \
        in proc.stderr
    assert "--device cpu" in proc.stderr and "HVDTRAIN_GPU=1" in proc.stderr
    assert "Iter #" not in proc.stdout  # nothing ran


def test_torchvision_release_paired_with_torch():
    pin = bench_module().torchvision_pin
    assert pin("2.13.0+cpu") == "0.28.*" and pin("2.11.0+cu130") == "0.26.*"


def test_benchmark_rejects_bad_options():
    parse = bench_module().parse_args
    with pytest.raises(SystemExit) as exc:
        parse(["--variants", "fp32,fp64"])
    assert exc.value.code == 2
    assert parse(["--variants", "bf16"]).variants == ["bf16"]


def run_smoke(tmp_path, *args):
    out = tmp_path / "gpu.json"
    # The keras_* variants run on Keras's PyTorch backend, whatever this shell's KERAS_BACKEND.
    proc = python(str(BENCH), *SMOKE, *args, "--json-out", str(out), env={"KERAS_BACKEND": "torch"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_benchmark_runs_on_the_cpu_in_horovods_format(tmp_path):
    result, printed = run_smoke(tmp_path, "--model", "tiny", "--rounds", "2")
    assert result["model"] == "tiny" and result["size"] == 1 and result["device"] == "cpu"
    assert result["machine"]["torch"] and result["machine"]["gpu"] is None
    variants = ["fp32", "bf16", "channels_last", "keras_mnist", "keras_gpt"]
    assert list(result["variants"]) == variants
    assert [(e["model"], e["framework"]) for e in result["variants"].values()] == [
        ("tiny", "torch")] * 3 + [("mnist", "keras (torch backend)"),
                                  ("gpt", "keras (torch backend)")]
    for variant, entry in result["variants"].items():
        for loop in ("plain", "hvdtrain"):
            assert len(entry[loop]["iters"]) == 2 * 2 and len(entry[loop]["rounds"]) == 2
            assert entry[loop]["img_sec_per_device"] > 0
        assert entry["ratio"] == pytest.approx(statistics.median(entry["round_ratios"]))
        assert entry["meets_target"] == (entry["ratio"] >= result["target_ratio"] == 0.98)
    # What a person reads: Horovod's benchmark lines (per CPU here, per GPU on a GPU).
    lines = printed.splitlines()
    for head in ("Model: tiny", "Keras 3 on PyTorch: keras_mnist, keras_gpt", "Batch size: 4",
                 "Number of CPUs: 1"):
        assert head in lines
    # 5 variants x 2 loops x 2 rounds x 2 iterations
    assert sum(bool(re.fullmatch(r"Iter #\d+: \d+\.\d img/sec per CPU", l)) for l in lines) == 40
    assert len([l for l in lines if re.fullmatch(r"Img/sec per CPU: [\d.]+ \+-[\d.]+", l)]) == 10
    assert len([l for l in lines
                if re.fullmatch(r"Total img/sec on 1 CPU\(s\): [\d.]+ \+-[\d.]+", l)]) == 10
    assert "keras_gpt, plain Keras fit:" in lines and "keras_gpt, hvdtrain.keras:" in lines
    for variant in variants:
        assert any(l.startswith(f"Ratio hvdtrain / plain ({variant}): ") for l in lines)


def test_keras_variants_need_the_pytorch_backend(tmp_path):
    """The keras_* variants compare Keras's PyTorch-backend loops (a GPU build of Horovod has no
    TensorFlow ops): another KERAS_BACKEND is refused before any work, saying what to set."""
    proc = python(str(BENCH), *SMOKE, "--model", "tiny", "--variants", "fp32,keras_mnist",
                  env={"KERAS_BACKEND": "tensorflow"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("benchmarks/gpu.py: error: the keras_* variants run Keras on its PyTorch backend, "
            "but KERAS_BACKEND is 'tensorflow': unset it or set KERAS_BACKEND=torch") in proc.stderr
    assert "Iter #" not in proc.stdout
    ok = python(str(BENCH), *SMOKE, "--model", "tiny", "--variants", "fp32", "--rounds", "1",
                env={"KERAS_BACKEND": "tensorflow"})  # no Keras variant: no Keras needed
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_benchmark_torchvision_model(tmp_path):
    pin = bench_module().torchvision_pin(importlib.metadata.version("torch"))  # 0.28.* for 2.13
    if python("-c", "import torchvision").returncode == 0:
        result, _ = run_smoke(tmp_path, "--model", "resnet18", "--num-classes", "10",
                              "--rounds", "1", "--variants", "fp32,channels_last")
        assert result["machine"]["torchvision"]
        for entry in result["variants"].values():
            assert entry["plain"]["img_sec_per_device"] > 0
            assert entry["hvdtrain"]["img_sec_per_device"] > 0
        return
    # No usable torchvision here (hvdtrain's CPU stack does not install it): the clear error.
    proc = python(str(BENCH), *SMOKE, "--model", "resnet18")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"benchmarks/gpu.py: error: torchvision (is not installed|.* does not "
                     r"import)", proc.stderr), proc.stderr
    assert f"pip install 'torchvision=={pin}'" in proc.stderr
    assert "--model tiny" in proc.stderr


def test_benchmark_names_a_torchvision_built_for_another_torch(tmp_path):
    # What the registry's torchvision 0.28.0 (a CUDA 13 wheel) does beside the CPU torch 2.13.0:
    # its compiled ops do not load, and importing it raises RuntimeError.
    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    proc = python(str(BENCH), *SMOKE, "--model", "resnet18",
                  env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not import (RuntimeError: operator torchvision::nms does not exist)" \
        in proc.stderr
    assert "built for another torch" in proc.stderr and "--model tiny" in proc.stderr
