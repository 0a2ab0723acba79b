"""scripts/gpu_check.sh, the GPU acceptance check, where there is no GPU: it refuses to start
without one, and with a stand-in nvidia-smi it records a failed set-up and runs nothing after it
(the GPU steps themselves need a GPU: tests/gpu, benchmarks/gpu.py)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"


def _run(tmp_path, env_extra=None, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("HVDTRAIN_GPU", "GPU_CHECK_STEPS")}
    env.update(env_extra or {})
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def _stand_in_gpu(tmp_path) -> dict:
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    smi = fakebin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA Stand-in, 580.00, 81559 MiB'\n")
    smi.chmod(0o755)
    return {"PATH": f"{fakebin}:{os.environ['PATH']}"}


def test_without_a_gpu_it_stops_before_any_work(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}  # no nvidia-smi
    proc = _run(tmp_path, env, str(tmp_path / "results"))
    assert proc.returncode == 2
    assert "gpu_check: no NVIDIA GPU visible (nvidia-smi not found)" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_unknown_step_is_refused(tmp_path):
    proc = _run(tmp_path, {"GPU_CHECK_STEPS": "setup bnech"}, str(tmp_path / "results"))
    assert proc.returncode == 2
    assert "GPU_CHECK_STEPS: unknown step 'bnech' (the steps: setup tests bench)" in proc.stderr


def test_a_failed_set_up_is_recorded_and_nothing_runs_after_it(tmp_path):
    # A stand-in GPU, but this interpreter's torch is a CPU build: HVDTRAIN_GPU=1 set-up refuses.
    env = {**_stand_in_gpu(tmp_path), "HVDTRAIN_PYTHON": sys.executable,
           "HVDTRAIN_CACHE": str(tmp_path / "cache")}
    results = tmp_path / "results"
    proc = _run(tmp_path, env, str(results))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (results / "summary.txt").read_text().splitlines()
    assert summary[1] == "gpu: NVIDIA Stand-in, 580.00, 81559 MiB"
    assert any(line.startswith("torch: ") and "CUDA None" in line for line in summary)
    assert any(line.startswith("step setup  exit 1") for line in summary)
    assert summary[-1] == "set-up failed: tests and bench not run (the tools' output: setup.log.tools)"
    assert "asks for a GPU build, but torch" in (results / "setup.log").read_text()
    assert sorted(p.name for p in results.iterdir()) == ["setup.log", "setup.log.tools",
                                                          "summary.txt"]
