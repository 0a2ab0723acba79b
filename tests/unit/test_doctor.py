import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.launch.doctor import (GPU, NCCL_REBUILD, Machine, describe_cuda, describe_gpus, gpu_notes,
                             notes, parse_check_build, parse_driver_cuda, parse_nvidia_smi,
                             parse_torch_version_py, problems, report)

NO_GPU = Machine(gpu_problem="nvidia-smi not found", torch_cuda="")

FULL = """Horovod v0.28.1:

Available Frameworks:
    [X] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo
"""


def test_parse_full_build():
    info = parse_check_build(FULL)
    assert info.version == "0.28.1"
    assert info.available("Frameworks") == ["TensorFlow", "PyTorch"]
    assert info.available("Controllers") == ["MPI", "Gloo"]
    assert info.available("Tensor Operations") == ["MPI", "Gloo"]
    assert problems(info) == []


def test_build_with_pytorch_only_is_usable_and_says_what_keras_needs():
    info = parse_check_build(FULL.replace("[X] TensorFlow", "[ ] TensorFlow"))
    assert problems(info) == []
    (note,) = notes(info, on=NO_GPU)
    assert "--framework keras will not run" in note and "HOROVOD_WITH_TENSORFLOW=1" in note


def test_build_without_any_framework_is_reported_with_the_fix():
    text = FULL.replace("[X] PyTorch", "[ ] PyTorch").replace("[X] TensorFlow", "[ ] TensorFlow")
    (issue,) = problems(parse_check_build(text))
    assert "without PyTorch or TensorFlow support" in issue
    assert "HOROVOD_WITH_PYTORCH=1" in issue and "HOROVOD_WITH_TENSORFLOW=1" in issue


def test_build_without_controllers():
    text = FULL.replace("[X] MPI", "[ ] MPI").replace("[X] Gloo", "[ ] Gloo")
    assert any("no controller" in p for p in problems(parse_check_build(text)))


def test_not_check_build_output():
    with pytest.raises(ValueError, match="not the output of 'horovodrun --check-build'"):
        parse_check_build("command not found")


def _doctor(env_path):
    exe = Path(sys.executable).parent / "hvdtrain"
    env = dict(os.environ, PATH=env_path)
    return subprocess.run([str(exe), "doctor"], capture_output=True, text=True, env=env,
                          timeout=300)


def test_doctor_on_this_machine_reports_a_usable_build():
    proc = _doctor(f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    assert "Horovod:            0.28.1" in proc.stdout
    assert "TensorFlow, PyTorch" in proc.stdout and "MPI, Gloo" in proc.stdout
    assert "Open MPI" in proc.stdout and "status:             ok" in proc.stdout


BUILT_FACTS = r"""
import json
import sys
import horovod.common.util as util
facts = ("mpi", "gloo", "nccl", "ddl", "ccl")
library = {f: util._torch_library_built(f, False) for f in facts}
checks = {f: getattr(util, f + "_built")() for f in facts}
# The library not where HorovodBasics looks: no answer, and the check asks the extension instead.
where = util.get_extension_full_path
util.get_extension_full_path = lambda *args: "/nonexistent/mpi_lib_v2.so"
missing = util._torch_library_built("mpi", False)
fallback = util._torch_library_first("mpi", lambda verbose=False: "imported")()
util.get_extension_full_path = where
import horovod.torch as ext
own = {f: getattr(ext, f + "_built")() for f in facts}
with open(sys.argv[1], "w") as out:
    json.dump({"library": library, "checks": checks, "own": own, "missing": missing,
               "fallback": fallback}, out)
"""


def test_horovodruns_build_checks_read_the_torch_library_and_agree_with_the_extension(tmp_path):
    """Patch 10 (scripts/horovod_patches): the *_built() checks every horovodrun launch runs answer
    from PyTorch's extension library, without importing torch, what the extension itself answers;
    where the library cannot answer, they fall back to importing the extension."""
    facts = tmp_path / "facts.json"
    proc = subprocess.run([sys.executable, "-c", BUILT_FACTS, str(facts)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(facts.read_text())
    assert seen["library"] == seen["checks"] == seen["own"]
    assert seen["own"]["mpi"] is True and seen["own"]["gloo"] is True  # this machine's build
    assert seen["missing"] is None and seen["fallback"] == "imported"


def _fake_horovodrun(tmp_path, text):
    """A horovodrun on PATH whose --check-build prints ``text``."""
    fake = tmp_path / "horovodrun"
    fake.write_text("#!/bin/sh\ncat <<'OUT'\n" + text + "OUT\n")
    fake.chmod(0o755)
    return f"{tmp_path}{os.pathsep}{os.environ['PATH']}"


def test_doctor_passes_a_pytorch_only_build_with_a_note(tmp_path):
    proc = _doctor(_fake_horovodrun(tmp_path, FULL.replace("[X] TensorFlow", "[ ] TensorFlow")))
    assert proc.returncode == 0, proc.stderr
    assert "--framework keras will not run" in proc.stderr
    assert "status:             ok" in proc.stdout


def test_doctor_fails_on_a_build_without_frameworks(tmp_path):
    text = FULL.replace("[X] PyTorch", "[ ] PyTorch").replace("[X] TensorFlow", "[ ] TensorFlow")
    proc = _doctor(_fake_horovodrun(tmp_path, text))
    assert proc.returncode == 1
    assert "Horovod was built without PyTorch or TensorFlow support" in proc.stderr
    assert "status:             NOT usable" in proc.stdout


# ---- GPUs: nvidia-smi, torch's CUDA version, NCCL ------------------------------------------

SMI_QUERY = """NVIDIA H100 80GB HBM3, 580.159.04, 9.0
NVIDIA H100 80GB HBM3, 580.159.04, 9.0
NVIDIA A100-SXM4-40GB, 580.159.04, 8.0
"""
SMI_HEADER = """Sun Nov 23 10:00:00 2026
| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |
|-----------------------------------------+------------------------+----------------------+
"""
H100 = GPU("NVIDIA H100 80GB HBM3", "580.159.04", "9.0")
WITH_NCCL = FULL.replace("[ ] NCCL", "[X] NCCL")


def test_parse_nvidia_smi_query_and_header():
    gpus = parse_nvidia_smi(SMI_QUERY + "\nNo devices were found\n")
    assert gpus == [H100, H100, GPU("NVIDIA A100-SXM4-40GB", "580.159.04", "8.0")]
    assert parse_driver_cuda(SMI_HEADER) == "13.0"
    assert parse_driver_cuda("NVIDIA-SMI has failed") is None
    assert describe_gpus(Machine(gpus=tuple(gpus))) == (
        "2 x NVIDIA H100 80GB HBM3 (compute capability 9.0, driver 580.159.04); "
        "1 x NVIDIA A100-SXM4-40GB (compute capability 8.0, driver 580.159.04)")
    assert describe_gpus(NO_GPU) == "none (nvidia-smi not found)"


def test_parse_torch_version_py():
    cuda = ("__version__ = '2.14.1+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
            "hip: Optional[str] = None\n")
    assert parse_torch_version_py(cuda) == "13.0"
    assert parse_torch_version_py("cuda: Optional[str] = None\nhip = None\n") == ""
    assert parse_torch_version_py("cuda = '12.4'\n") == "12.4"
    assert describe_cuda(Machine(torch_cuda="13.0", driver_cuda="13.0")) == (
        "torch built for 13.0; driver supports up to 13.0")
    assert describe_cuda(NO_GPU) == "torch is a CPU build; no NVIDIA driver seen"
    assert describe_cuda(Machine()) == "torch not installed; no NVIDIA driver seen"


def test_gpus_without_nccl_say_what_to_rebuild():
    info = parse_check_build(FULL)
    (note,) = gpu_notes(info, Machine(gpus=(H100,), torch_cuda="13.0"))
    assert "1 GPU(s) but Horovod was built without NCCL" in note
    assert "rerun `HVDTRAIN_GPU=1 make setup` to build Horovod with NCCL" in note
    assert NCCL_REBUILD in note and "nvcc" in note
    (note,) = gpu_notes(info, Machine(gpus=(H100,), torch_cuda=""))
    assert "install a CUDA build of torch first" in note
    # A usable build stays usable: the GPU advice is a note, not a problem.
    assert problems(info) == []
    assert notes(info, on=Machine(gpus=(H100,), torch_cuda="13.0"))[-1] == note.replace(
        " (torch here is a CPU build: install a CUDA build of torch first)",
        " (it needs nvcc, the CUDA toolkit, on PATH)")


def test_nccl_build_with_and_without_gpus():
    info = parse_check_build(WITH_NCCL)
    assert info.available("Tensor Operations") == ["NCCL", "MPI", "Gloo"]
    assert gpu_notes(info, Machine(gpus=(H100,), torch_cuda="13.0")) == []
    (note,) = gpu_notes(info, NO_GPU)
    assert "built with NCCL but no GPU is visible (nvidia-smi not found)" in note
    assert gpu_notes(parse_check_build(FULL), NO_GPU) == []


def test_gpu_build_without_tensorflow_points_keras_to_its_pytorch_backend():
    """scripts/setup.sh builds GPU Horovod without TensorFlow on purpose; doctor must not advise
    the rebuild that would fail, but the backend that works."""
    info = parse_check_build(WITH_NCCL.replace("[X] TensorFlow", "[ ] TensorFlow"))
    (note,) = notes(info, on=Machine(gpus=(H100,), torch_cuda="13.0"))
    assert "as scripts/setup.sh builds for GPUs" in note and "--keras-backend torch" in note
    assert "HOROVOD_WITH_TENSORFLOW" not in note


def test_report_shows_gpus_cuda_and_nccl():
    on = Machine(gpus=(H100,), driver_cuda="13.0", torch_cuda="13.0")
    text = report(parse_check_build(WITH_NCCL), on)
    assert "NCCL:               yes (GPU all-reduce)" in text
    assert "GPUs:               1 x NVIDIA H100 80GB HBM3 (compute capability 9.0" in text
    assert "CUDA:               torch built for 13.0; driver supports up to 13.0" in text
    assert "NCCL:               no" in report(parse_check_build(FULL), NO_GPU)


def _fake_nvidia_smi(tmp_path):
    """An nvidia-smi listing one H100 (its query) and CUDA 13.0 (its header)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nif [ $# -gt 0 ]; then echo 'NVIDIA H100 80GB HBM3, 580.159.04, 9.0'"
                    "\nelse cat <<'OUT'\n" + SMI_HEADER + "OUT\nfi\n")
    fake.chmod(0o755)


def test_doctor_on_a_gpu_machine_whose_horovod_lacks_nccl(tmp_path):
    _fake_nvidia_smi(tmp_path)
    proc = _doctor(_fake_horovodrun(tmp_path, FULL))
    assert proc.returncode == 0, proc.stderr
    assert "GPUs:               1 x NVIDIA H100 80GB HBM3" in proc.stdout
    assert "driver supports up to 13.0" in proc.stdout and "NCCL:               no" in proc.stdout
    assert "hvdtrain: note: this machine has 1 GPU(s) but Horovod was built without NCCL" \
        in proc.stderr
    assert "HVDTRAIN_GPU=1 make setup" in proc.stderr
    assert "status:             ok" in proc.stdout


def test_doctor_finds_horovodrun_beside_its_python_without_the_venv_on_path():
    # .venv/bin/hvdtrain doctor with a PATH that lacks .venv/bin (a user who did not activate)
    bindir = Path(sys.executable).parent
    proc = subprocess.run([str(bindir / "hvdtrain"), "doctor"], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": os.environ["HOME"]})
    assert proc.returncode == 0, proc.stderr
    assert "status:             ok" in proc.stdout
