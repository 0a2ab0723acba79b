"""scripts/gpu_check.sh, the GPU acceptance check, where there is no GPU: it refuses to start
without one or with a bad budget, and with a stand-in nvidia-smi it records a failed set-up and
runs nothing after it, stops a step that outlives its budget and says so in summary.txt and
phases.json, and puts a kept Horovod wheel into set-up's cache (the GPU steps themselves need a
GPU: tests/gpu, benchmarks/gpu.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"


def _run(tmp_path, env_extra=None, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HVDTRAIN_GPU", "GPU_CHECK_STEPS", "GPU_CHECK_WHEELS")
           and not k.startswith("GPU_CHECK_BUDGET")}
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


@pytest.mark.parametrize("variable, value", [("GPU_CHECK_BUDGET", "5min"),
                                             ("GPU_CHECK_BUDGET_TESTS", "0")])
def test_a_bad_budget_is_refused_before_any_work(tmp_path, variable, value):
    proc = _run(tmp_path, {variable: value}, str(tmp_path / "results"))
    assert proc.returncode == 2
    assert f"gpu_check: {variable}={value}: want whole seconds" in proc.stderr
    assert not (tmp_path / "results").exists()


def _cpu_env(tmp_path) -> dict:
    # A stand-in GPU, but this interpreter's torch is a CPU build: HVDTRAIN_GPU=1 set-up refuses.
    return {**_stand_in_gpu(tmp_path), "HVDTRAIN_PYTHON": sys.executable,
            "HVDTRAIN_CACHE": str(tmp_path / "cache")}


def test_a_failed_set_up_is_recorded_and_nothing_runs_after_it(tmp_path):
    # A Horovod wheel kept by an earlier run goes into set-up's cache first (under its key).
    key = "horovod-0.28.1-torch2.11.0-notf-cp312-cxx17-noxla-py-v23-cu130-cc90-nccl2.28.9-gpu-v1"
    wheel = "horovod-0.28.1-cp312-cp312-linux_x86_64.whl"
    (tmp_path / "kept" / key).mkdir(parents=True)
    (tmp_path / "kept" / key / wheel).write_bytes(b"a wheel")
    results = tmp_path / "results"
    proc = _run(tmp_path, {**_cpu_env(tmp_path), "GPU_CHECK_WHEELS": str(tmp_path / "kept")},
                str(results))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (tmp_path / "cache" / "wheels" / key / wheel).read_bytes() == b"a wheel"
    summary = (results / "summary.txt").read_text().splitlines()
    assert summary[1] == "gpu: NVIDIA Stand-in, 580.00, 81559 MiB"
    assert any(line.startswith("torch: ") and "CUDA None" in line for line in summary)
    assert any(line.startswith("budget: 300 s in all; steps: setup 150") for line in summary)
    assert (f"wheels: 1 kept Horovod wheel(s) put into {tmp_path / 'cache'}/wheels (from "
            f"{tmp_path / 'kept'})") in summary
    assert any(line.startswith("step setup  exit   1") for line in summary)
    assert summary[-3] == ("set-up failed: tests and bench not run (the tools' output: "
                           "setup.log.tools)")
    assert summary[-2].startswith("total: ") and summary[-2].endswith(" s (budget 300 s)")
    assert summary[-1] == "result: a step FAILED"
    assert "asks for a GPU build, but torch" in (results / "setup.log").read_text()
    assert sorted(p.name for p in results.iterdir()) == ["phases.json", "setup.log",
                                                          "setup.log.tools", "summary.txt"]
    phases = json.loads((results / "phases.json").read_text())
    assert phases["budget_s"] == 300
    assert [(p["name"], p["exit"], p["budget_s"], p["status"], p["log"])
            for p in phases["phases"]] == [("setup", 1, 150, "failed", "setup.log")]


def test_a_step_past_its_budget_is_stopped_and_recorded(tmp_path):
    # set-up's first look at the interpreter hangs (a stand-in python that never answers it).
    hang = tmp_path / "python"
    hang.write_text(f"#!/bin/sh\ncase \"$*\" in *importlib.metadata*) exec sleep 600 ;; esac\n"
                    f"exec {sys.executable} \"$@\"\n")
    hang.chmod(0o755)
    results = tmp_path / "results"
    proc = _run(tmp_path, {**_cpu_env(tmp_path), "HVDTRAIN_PYTHON": str(hang),
                           "GPU_CHECK_BUDGET_SETUP": "2"}, str(results))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (results / "summary.txt").read_text()
    assert "step setup  exit 124" in summary and "of    2 s  setup.log  OVER BUDGET, stopped" \
        in summary
    assert "gpu_check: step setup stopped at its budget of 2 s" in \
        (results / "setup.log").read_text()
    phases = json.loads((results / "phases.json").read_text())["phases"]
    assert [(p["name"], p["exit"], p["budget_s"], p["status"]) for p in phases] == [
        ("setup", 124, 2, "over budget")]
