"""scripts/setup.sh's decisions without a GPU: its --plan mode run with a stand-in python (a shell
script printing the facts setup.sh asks its interpreter for) and a stand-in nvcc, its GPU path run
end to end with stand-ins for the build, and scripts/patch_horovod.sh on a small source tree."""
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
PATCH = ROOT / "scripts" / "patch_horovod.sh"
CPU_KEY_PREFIX = "horovod-0.28.1-torch"

# What a CUDA torch's interpreter reports (one GPU of compute capability 9.0, NCCL from its wheel).
GPU_FACTS = {"py": "cp312", "tf_package": "", "tf": "", "missing": "", "torch": "2.11.0+cu130",
             "torch_cuda": "13.0", "gpu_cc": "90", "torch_arch_cc": "75,80,86,90,100,120",
             "nccl_dist": "nvidia-nccl-cu13 2.27.3"}
# ... and the pinned CPU stack's.
CPU_FACTS = {"py": "cp311", "tf_package": "tensorflow-cpu", "tf": "2.21.0", "missing": "",
             "torch": "2.13.0+cpu", "torch_cuda": ""}
NCCL_H = ("#define NCCL_MAJOR 2\n#define NCCL_MINOR 27\n#define NCCL_PATCH 3\n"
          "#define NCCL_SUFFIX \"\"\n")


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _fake_python(tmp_path: Path, facts: dict, name: str = "python") -> Path:
    """A python for setup.sh: ``-c`` (the probe) prints ``facts``; ``-`` (the Horovod check)
    succeeds once a wheel was "installed", printing what the build has (as a CUDA torch's build
    with NCCL, else the CPU build with TensorFlow); ``-m pip wheel`` records its environment and
    source tree and writes a wheel; ``-m pip install`` records what it installs."""
    prefix = tmp_path / "prefix"
    facts = {"prefix": str(prefix), "scripts": str(prefix / "bin"), **facts}
    state = tmp_path / "pystate"
    state.mkdir(parents=True, exist_ok=True)
    (state / "facts").write_text("".join(f"{k}={v}\n" for k, v in facts.items()))
    (state / "built").write_text(
        "frameworks PyTorch; controllers MPI, Gloo; tensor operations NCCL, MPI, Gloo\n"
        if facts.get("torch_cuda") else
        "frameworks TensorFlow, PyTorch; controllers MPI, Gloo; tensor operations MPI, Gloo\n")
    return _exe(tmp_path / "bin" / name, f"""#!/bin/bash
state={state}
case "$1" in
  -c) cat "$state/facts" ;;
  -) cat >/dev/null; [ -f "$state/installed" ] && cat "$state/built" ;;
  -m)
    shift 2
    case "$1" in
      wheel)
        env | grep -E '^(HOROVOD_|CMAKE_|MAKEFLAGS=|PATH=)' | sort > "$state/build-env"
        for a in "$@"; do [ "$prev" = -w ] && out=$a; prev=$a; src=$a; done
        cp -r "$src" "$state/src"
        touch "$out/horovod-0.28.1-cp312-cp312-linux_x86_64.whl" ;;
      install)
        echo "$*" >> "$state/pip-install"
        case "$*" in
          *" -e "*) mkdir -p {prefix}/bin && touch {prefix}/bin/hvdtrain
                    chmod +x {prefix}/bin/hvdtrain ;;
          *.whl*) touch "$state/installed" ;;
        esac ;;
      *) exit 3 ;;
    esac ;;
  *) exit 2 ;;
esac
""")


def _nccl_wheel(tmp_path: Path) -> Path:
    """A stand-in for the nvidia-nccl-cu13 wheel's nvidia/nccl folder."""
    nccl = tmp_path / "site" / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "include" / "nccl.h").write_text(NCCL_H)
    (nccl / "lib").mkdir()
    (nccl / "lib" / "libnccl.so.2").write_text("")
    return nccl


NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"


def _toolkit(root: Path, nvcc: str = NVCC) -> Path:
    """A stand-in CUDA toolkit: ``bin/nvcc`` (a script's text) and ``include/cuda_runtime.h``."""
    _exe(root / "bin" / "nvcc", nvcc)
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "include" / "cuda_runtime.h").write_text("/* stand-in */\n")
    return root


def _env(tmp_path: Path, nvcc: str | None = NVCC, **extra) -> dict:
    """A clean environment: stand-ins first on PATH, caches under tmp_path, no CUDA toolkit except
    the stand-in one holding ``nvcc`` (a script's text; None: no nvcc)."""
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir(parents=True, exist_ok=True)
    path = f"{fakebin}:/usr/bin:/bin"
    if nvcc:
        path = f"{_toolkit(tmp_path / 'cuda-standin', nvcc) / 'bin'}:{path}"
    # No bytecode step: the stand-in pythons cannot compile (test_setup_compiled_... checks it).
    env = {"PATH": path, "HOME": str(tmp_path / "home"),
           "HVDTRAIN_CACHE": str(tmp_path / "cache"), "CUDA_HOME": str(tmp_path / "no-cuda"),
           "LANG": "C.UTF-8", "HVDTRAIN_COMPILE_BYTECODE": "0"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _setup(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _plan(env: dict) -> dict:
    """Run setup.sh --plan; {"key": value} for its NAME=VALUE lines, plus "env" (the build's
    variables), "patch" (the patches) and "run" lists."""
    proc = _setup(env, "--plan")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = {"env": {}, "patch": [], "run": [], "stdout": proc.stdout}
    for line in proc.stdout.splitlines():
        if line.startswith("env "):
            name, _, value = line[4:].partition("=")
            plan["env"][name] = value
        elif line.startswith(("patch ", "run ")):
            kind, _, rest = line.partition(" ")
            plan[kind].append(rest)
        elif "=" in line and not line.startswith("["):
            name, _, value = line.partition("=")
            plan[name] = value
    return plan


def _gpu_env(tmp_path, facts=None, nvcc=NVCC, **extra):
    nccl = _nccl_wheel(tmp_path)
    py = _fake_python(tmp_path, {**GPU_FACTS, "nccl_dir": str(nccl), **(facts or {})})
    return _env(tmp_path, nvcc, HVDTRAIN_PYTHON=py, **extra), nccl


def test_cuda_torch_and_nvcc_give_an_nccl_build_for_the_gpus_present(tmp_path):
    env, nccl = _gpu_env(tmp_path)
    plan = _plan(env)
    assert plan["mode"] == "gpu" and "has CUDA 13.0 and nvcc is" in plan["why"]
    assert plan["key"] == ("horovod-0.28.1-torch2.11.0-notf-cp312-cxx17-noxla-py-v23"
                           "-cu130-cc90-nccl2.27.3-gpu-v1")
    build = plan["env"]
    assert build["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert build["HOROVOD_NCCL_LINK"] == "SHARED"
    assert build["HOROVOD_NCCL_HOME"].startswith(str(tmp_path / "cache" / "nccl-home"))
    assert build["HOROVOD_WITHOUT_TENSORFLOW"] == "1" and "HOROVOD_WITH_TENSORFLOW" not in build
    assert build["HOROVOD_WITH_PYTORCH"] == build["HOROVOD_WITH_MPI"] == "1"
    assert plan["nccl"] == "2.27.3 from the nvidia-nccl-cu13 2.27.3 wheel"
    assert plan["cc_list"] == "90 (the GPUs present)"
    assert build["HOROVOD_CUDA_HOME"] == build["CUDA_HOME"] == plan["cuda_home"] == str(
        tmp_path / "cuda-standin")
    patches = "\n".join(plan["patch"])
    assert "set(CMAKE_CUDA_STANDARD 11) -> set(CMAKE_CUDA_STANDARD 17)" in patches
    assert "common.h: add #include <stdexcept>" in patches
    assert "group_table.h: add #include <string>" in patches
    assert "set(CMAKE_CXX_STANDARD 14) -> set(CMAKE_CXX_STANDARD 17)" in patches
    (run,) = plan["run"]
    assert run.startswith(f"LD_LIBRARY_PATH={nccl}/lib ")
    # A plan changes nothing: no cache, no log.
    assert not (tmp_path / "cache").exists()


def test_cc_list_from_the_environment_and_from_torch_without_a_gpu(tmp_path):
    env, _ = _gpu_env(tmp_path, HOROVOD_BUILD_CUDA_CC_LIST="80,90")
    plan = _plan(env)
    assert plan["env"]["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90" and "-cc80_90-" in plan["key"]

    env, _ = _gpu_env(tmp_path / "nogpu", facts={"gpu_cc": ""})
    plan = _plan(env)
    assert plan["env"]["HOROVOD_BUILD_CUDA_CC_LIST"] == "75,80,86,90,100,120"
    assert "the architectures torch was built for" in plan["cc_list"]

    # ... less those an older nvcc cannot build for (it warns about the CUDA mismatch too).
    older = ("#!/bin/sh\nif [ \"$1\" = --list-gpu-arch ]; then printf 'compute_%s\\n' 75 80 86 90;"
             "\nelse echo 'Cuda compilation tools, release 12.4, V12.4.131'; fi\n")
    env, _ = _gpu_env(tmp_path / "old-nvcc", facts={"gpu_cc": ""}, nvcc=older)
    plan = _plan(env)
    assert plan["env"]["HOROVOD_BUILD_CUDA_CC_LIST"] == "75,80,86,90"
    assert "is CUDA 12.4 but torch was built with CUDA 13.0" in plan["warning"]


def test_the_toolkit_is_found_when_nvcc_on_path_is_a_wrapper_elsewhere(tmp_path):
    """As on machines where /usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc: CMake looks
    for the headers and cudart beside the nvcc it is given, so the build gets the toolkit's."""
    env, _ = _gpu_env(tmp_path, nvcc=None)
    toolkit = _toolkit(tmp_path / "cuda-13.0")
    _exe(tmp_path / "fakebin" / "nvcc", f"#!/bin/sh\nexec {toolkit}/bin/nvcc \"$@\"\n")
    env["CUDA_HOME"] = str(toolkit)
    plan = _plan(env)
    assert plan["mode"] == "gpu" and plan["nvcc"] == str(toolkit / "bin" / "nvcc")
    assert plan["env"]["HOROVOD_CUDA_HOME"] == plan["env"]["CUDA_HOME"] == str(toolkit)


def test_nvcc_without_the_toolkit_headers_is_no_gpu_build(tmp_path):
    env, _ = _gpu_env(tmp_path, nvcc=None)
    _exe(tmp_path / "fakebin" / "nvcc", NVCC)  # no include/cuda_runtime.h anywhere
    plan = _plan(env)
    assert plan["mode"] == "cpu" and "no CUDA toolkit with include/cuda_runtime.h" in plan["why"]
    assert "set HOROVOD_CUDA_HOME" in plan["notice"] and "HOROVOD_GPU_OPERATIONS" not in plan["env"]

    proc = _setup({**env, "HVDTRAIN_GPU": "1"}, "--plan")
    assert proc.returncode == 1
    assert ("HVDTRAIN_GPU=1 asks for a GPU build; nvcc is "
            f"{tmp_path / 'fakebin' / 'nvcc'}, but no CUDA toolkit") in proc.stderr


def test_a_gpu_build_leaves_horovods_tensorflow_ops_out(tmp_path):
    """Seen with TensorFlow 2.21: Horovod's TensorFlow ops built with NCCL fail to load (undefined
    symbol stream_executor::gpu::AsGpuStreamValue), so a GPU build is PyTorch-only and says so;
    the CPU build of the same environment keeps them."""
    env, _ = _gpu_env(tmp_path, facts={"tf_package": "tensorflow", "tf": "2.21.0"})
    plan = _plan(env)
    assert plan["mode"] == "gpu" and "-notf-" in plan["key"]
    assert plan["env"]["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    assert "HOROVOD_WITH_TENSORFLOW" not in plan["env"]
    assert plan["tensorflow"] == "tensorflow 2.21.0 (Horovod without TensorFlow: a GPU build)"
    assert "Keras runs on its PyTorch backend here" in plan["notice"]

    plan = _plan({**env, "HVDTRAIN_GPU": "0"})
    assert plan["mode"] == "cpu" and "-tf2.21.0-" in plan["key"]
    assert plan["env"]["HOROVOD_WITH_TENSORFLOW"] == "1" and "notice" not in plan


def test_bad_cc_list_is_refused(tmp_path):
    env, _ = _gpu_env(tmp_path, HOROVOD_BUILD_CUDA_CC_LIST="sm_90")
    proc = _setup(env, "--plan")
    assert proc.returncode == 1 and "HOROVOD_BUILD_CUDA_CC_LIST=sm_90" in proc.stderr


def test_nccl_home_from_the_environment_wins(tmp_path):
    system = tmp_path / "system-nccl"
    (system / "include").mkdir(parents=True)
    (system / "include" / "nccl.h").write_text(NCCL_H.replace("MINOR 27", "MINOR 21"))
    env, _ = _gpu_env(tmp_path, HOROVOD_NCCL_HOME=system)
    plan = _plan(env)
    assert plan["env"]["HOROVOD_NCCL_HOME"] == str(system)
    assert "HOROVOD_NCCL_LINK" not in plan["env"] and plan["run"] == []
    assert plan["key"].endswith("-nccl2.21.3-gpu-v1")


def test_without_nvcc_a_cuda_torch_gets_a_cpu_build_with_a_notice(tmp_path):
    if shutil.which("nvcc", path="/usr/bin:/bin"):
        pytest.skip("this machine has nvcc in /usr/bin")
    nccl = _nccl_wheel(tmp_path)
    py = _fake_python(tmp_path, {**GPU_FACTS, "nccl_dir": str(nccl)})
    plan = _plan(_env(tmp_path, nvcc=None, HVDTRAIN_PYTHON=py))
    assert plan["mode"] == "cpu" and "no nvcc" in plan["notice"]
    assert "HOROVOD_GPU_OPERATIONS" not in plan["env"]
    # torch's CUDA still makes Horovod compile its CUDA kernels: CUDA patches, own key.
    assert plan["key"] == "horovod-0.28.1-torch2.11.0-notf-cp312-cxx17-noxla-py-v23-cu130-nonccl-gpu-v1"
    assert any("CMAKE_CUDA_STANDARD" in p for p in plan["patch"])

    proc = _setup(_env(tmp_path, nvcc=None, HVDTRAIN_PYTHON=py, HVDTRAIN_GPU=1), "--plan")
    assert proc.returncode == 1 and "there is no nvcc" in proc.stderr


def test_hvdtrain_gpu_0_forces_a_cpu_build(tmp_path):
    env, _ = _gpu_env(tmp_path, HVDTRAIN_GPU=0, HOROVOD_GPU_OPERATIONS="NCCL")
    plan = _plan(env)
    assert plan["mode"] == "cpu" and plan["why"] == "HVDTRAIN_GPU=0"
    assert "HOROVOD_GPU_OPERATIONS" not in plan["env"] and "-cc" not in plan["key"]


def test_a_gpu_build_of_a_cpu_torch_is_refused(tmp_path):
    py = _fake_python(tmp_path, CPU_FACTS)
    proc = _setup(_env(tmp_path, HVDTRAIN_PYTHON=py, HVDTRAIN_GPU=1), "--plan")
    assert proc.returncode == 1
    assert "torch 2.13.0+cpu" in proc.stderr and "is a CPU build" in proc.stderr
    assert "HVDTRAIN_GPU=0" in proc.stderr


def test_default_cpu_plan_keeps_the_cpu_key_and_build(tmp_path):
    """The venv's interpreter (VENV) reporting the pinned CPU stack, no settings, nvcc present:
    the key and the build's variables of the CPU set-up, unchanged."""
    _fake_python(tmp_path / "venv", CPU_FACTS)
    plan = _plan(_env(tmp_path, VENV=tmp_path / "venv"))
    assert plan["mode"] == "cpu" and plan["why"] == "torch 2.13.0+cpu is a CPU build"
    assert plan["key"] == "horovod-0.28.1-torch2.13.0-tf2.21.0-cp311-cxx17-noxla-py-v23"
    cores = len(os.sched_getaffinity(0))
    assert plan["env"] == {"CMAKE_POLICY_VERSION_MINIMUM": "3.5", "HOROVOD_WITH_PYTORCH": "1",
                           "HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1",
                           "HOROVOD_WITH_MPI": "1", "HOROVOD_WITH_GLOO": "1",
                           "HOROVOD_CPU_OPERATIONS": "MPI", "MAKEFLAGS": f"-j{cores}"}
    diffs = list((ROOT / "scripts" / "horovod_patches").glob("*.patch"))
    assert len(plan["patch"]) == 3 + len(diffs) and plan["run"] == []
    assert "horovod/tensorflow/CMakeLists.txt: leave xla_mpi_ops.cc out" in plan["patch"][2]


def test_default_plan_on_this_checkouts_venv():
    """No settings at all, the real .venv: the CPU key that names the cached wheel."""
    venv_python = ROOT / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip("no .venv: run make setup")
    proc = subprocess.run(["bash", str(SETUP), "--plan"], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items()
                                            if not k.startswith(("HVDTRAIN_", "HOROVOD_"))})
    assert proc.returncode == 0, proc.stderr
    torch_v = md.version("torch").split("+")[0]
    tf_v = md.version("tensorflow-cpu")
    py = "cp%d%d" % sys.version_info[:2]
    assert f"key={CPU_KEY_PREFIX}{torch_v}-tf{tf_v}-{py}-cxx17-noxla-py-v23\n" in proc.stdout
    assert "mode=cpu\n" in proc.stdout


def test_hvdtrain_python_without_torch_says_so(tmp_path):
    py = _fake_python(tmp_path, {"py": "cp312", "missing": "cffi tqdm",
                                 "torch_error": "ModuleNotFoundError: No module named 'torch'"})
    proc = _setup(_env(tmp_path, HVDTRAIN_PYTHON=py), "--plan")
    assert proc.returncode == 1
    assert f"HVDTRAIN_PYTHON={py} cannot import torch" in proc.stderr
    assert "No module named 'torch'" in proc.stderr


def test_sdist_setting_is_checked_and_shown(tmp_path):
    env, _ = _gpu_env(tmp_path, HVDTRAIN_HOROVOD_SDIST=tmp_path / "missing.tar.gz")
    proc = _setup(env, "--plan")
    assert proc.returncode == 1 and "missing.tar.gz: no such file" in proc.stderr
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    sdist.write_bytes(b"")
    env["HVDTRAIN_HOROVOD_SDIST"] = str(sdist)
    assert _plan(env)["sdist"] == str(sdist)


def test_bad_settings_are_refused(tmp_path):
    proc = _setup(_env(tmp_path, HVDTRAIN_GPU="yes"), "--plan")
    assert proc.returncode == 1 and "HVDTRAIN_GPU must be 1" in proc.stderr
    assert _setup(_env(tmp_path), "--bogus").returncode == 2


# ---- the GPU path end to end, with stand-ins for pip and the build -------------------------------

def _fake_source(root: Path) -> Path:
    """The files of Horovod 0.28.1 that the patches touch, as they are there."""
    files = {
        "CMakeLists.txt": 'project(horovod CXX)\n\nset(CMAKE_CXX_STANDARD 14)\n'
                          'string(PREPEND GLOO_CMAKE "set(CMAKE_CXX_STANDARD 17)\\n")\n',
        "horovod/torch/CMakeLists.txt": 'if(NOT Pytorch_VERSION VERSION_LESS "1.5.0")\n'
                                        '    set(CMAKE_CXX_STANDARD 14)\nendif()\n',
        "horovod/common/ops/cuda/CMakeLists.txt": "set(CMAKE_CUDA_STANDARD 11)\n"
                                                  "set(CMAKE_CUDA_STANDARD_REQUIRED ON)\n",
        "horovod/common/common.h": "#ifndef HOROVOD_COMMON_H\n#define HOROVOD_COMMON_H\n\n"
                                   "#include <functional>\n#include <memory>\n",
        "horovod/common/group_table.h": "// licence\n\n#include <mutex>\n#include <queue>\n",
        "horovod/tensorflow/CMakeLists.txt": (
            'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc")\n'
            'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n'),
    }
    for name, text in _python_stubs().items():  # after what the file has (CMakeLists.txt)
        files[name] = files.get(name, "") + text
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _python_stubs() -> dict[str, str]:
    """For each file that scripts/horovod_patches/*.patch change (Python, C++ and CMake), the
    lines those diffs expect before them (their context and removed lines, hunk after hunk):
    patch finds each hunk there as in Horovod's real file."""
    stubs: dict[str, list[str]] = {}
    for diff in sorted((ROOT / "scripts" / "horovod_patches").glob("*.patch")):
        name = None
        for line in diff.read_text().splitlines():
            if line.startswith("+++ "):
                name = line.split()[1].split("/", 1)[1]
                stubs.setdefault(name, [])
            elif name and line.startswith((" ", "-")) and not line.startswith("--- "):
                stubs[name].append(line[1:])
            elif name and line == "":  # an empty context line
                stubs[name].append("")
    return {name: "\n".join(lines) + "\n" for name, lines in stubs.items()}


def test_gpu_setup_end_to_end_with_stand_ins(tmp_path):
    if not all(shutil.which(p, path="/usr/bin:/bin") for p in ("mpirun", "mpicc", "ssh")) \
            or not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("Open MPI or ssh missing: setup.sh would apt-get install them")
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(_fake_source(tmp_path / "src" / "horovod-0.28.1"), arcname="horovod-0.28.1")
    env, nccl = _gpu_env(tmp_path, HVDTRAIN_HOROVOD_SDIST=sdist)
    proc = _setup(env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[setup] GPU build (torch 2.11.0+cu130 has CUDA 13.0 and nvcc is ")
    assert "NCCL 2.27.3 from the nvidia-nccl-cu13 2.27.3 wheel, compute capabilities 90" in lines[0]
    key = "horovod-0.28.1-torch2.11.0-notf-cp312-cxx17-noxla-py-v23-cu130-cc90-nccl2.27.3-gpu-v1"
    assert lines[1].startswith("[setup] building Horovod 0.28.1 with NCCL") and key in lines[1]
    assert lines[3] == ("[setup] Horovod built with frameworks PyTorch; controllers MPI, Gloo; "
                        "tensor operations NCCL, MPI, Gloo")
    assert (tmp_path / "cache" / "wheels" / key).is_dir()

    state = tmp_path / "pystate"
    build = dict(line.split("=", 1) for line in (state / "build-env").read_text().splitlines())
    assert build["HOROVOD_GPU_OPERATIONS"] == "NCCL" and build["HOROVOD_NCCL_LINK"] == "SHARED"
    assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert build["HOROVOD_WITHOUT_TENSORFLOW"] == "1" and build["PATH"].startswith("/usr/bin:")
    home = Path(build["HOROVOD_NCCL_HOME"])
    assert (home / "include" / "nccl.h").read_text() == NCCL_H
    assert os.readlink(home / "lib" / "libnccl.so") == "libnccl.so.2"
    assert (home / "lib" / "libnccl.so.2").resolve() == (nccl / "lib" / "libnccl.so.2").resolve()
    src = state / "src"
    tf_cmake = (src / "horovod/tensorflow/CMakeLists.txt").read_text()
    assert "/mpi_ops.cc" in tf_cmake and "xla_mpi_ops.cc" not in tf_cmake
    cuda_cmake = (src / "horovod/common/ops/cuda/CMakeLists.txt").read_text()
    assert "set(CMAKE_CUDA_STANDARD 17)" in cuda_cmake
    assert "#include <stdexcept>" in (src / "horovod/common/common.h").read_text()

    # The last line says where NCCL's library is, and the file to source for it.
    prefix_hash = hashlib.sha256(str(tmp_path / "prefix").encode()).hexdigest()[:12]
    env_file = tmp_path / "cache" / "state" / prefix_hash / "hvdtrain-env.sh"
    assert lines[-1].startswith(f"[setup] ready: {tmp_path / 'bin' / 'python'} (Horovod 0.28.1 "
                                "with NCCL 2.27.3, torch 2.11.0+cu130, no TensorFlow); ")
    assert f"source {env_file}" in lines[-1] and f"LD_LIBRARY_PATH={nccl}/lib:" in lines[-1]
    twice = f'. "{env_file}"; . "{env_file}"; echo "$LD_LIBRARY_PATH"'
    sourced = subprocess.run(["bash", "-c", twice], capture_output=True, text=True,
                             env={"LD_LIBRARY_PATH": "/x"})
    assert sourced.stdout.strip() == f"{nccl}/lib:/x"
    installs = (state / "pip-install").read_text()
    assert "--no-deps --no-build-isolation -e" in installs and ".whl" in installs

    # A second run finds everything in place: only the last line.
    again = _setup(env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [lines[-1]]


def test_offline_set_up_without_sshd_warns_and_goes_on(tmp_path):
    """A GPU node with no package registry (seen: an H200 image without ssh/sshd): the optional
    ssh packages are not asked of apt-get (an offline bundle sets PIP_NO_INDEX), the set-up says
    so and builds anyway; online, an apt-get that fails for them is a warning too."""
    if not all(shutil.which(p, path="/usr/bin:/bin") for p in ("mpirun", "mpicc")):
        pytest.skip("Open MPI missing: setup.sh would apt-get install it")
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(_fake_source(tmp_path / "src" / "horovod-0.28.1"), arcname="horovod-0.28.1")
    env, _ = _gpu_env(tmp_path, HVDTRAIN_HOROVOD_SDIST=sdist, PIP_NO_INDEX="1",
                      HVDTRAIN_SSHD=str(tmp_path / "no-sshd"))
    calls = tmp_path / "apt-get-calls"
    _exe(tmp_path / "fakebin" / "apt-get", f"#!/bin/sh\necho \"$*\" >> {calls}\nexit 100\n")
    assert "openssh-server" in _plan(env)["apt"].split()  # listed with the others, as before
    proc = _setup(env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[setup] apt-get install openssh-server ... not installed"
    assert ("setup: warning: openssh-server not installed (not root, offline, or apt-get failed: "
            in proc.stderr)
    assert "multi-host runs and the test hosts of tests/parallel need ssh and sshd" in proc.stderr
    assert lines[-1].startswith("[setup] ready: ")
    assert not calls.exists()  # offline: apt-get never asked

    if os.geteuid() != 0:
        return  # not root: apt-get is not tried either
    del env["PIP_NO_INDEX"]
    again = _setup(env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[setup] apt-get install openssh-server ... not installed" in again.stdout
    assert calls.read_text().splitlines()[0].startswith("update")  # asked, and it failed


# ---- scripts/patch_horovod.sh -------------------------------------------------------------------

def _patch(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PATCH), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_gpu_patches_on_a_source_tree(tmp_path):
    src = _fake_source(tmp_path)
    assert _patch(src, "gpu").returncode == 0
    top = (src / "CMakeLists.txt").read_text()
    assert top.startswith('project(horovod CXX)\n\nset(CMAKE_CXX_STANDARD 17)\n'
                          'string(PREPEND GLOO_CMAKE "set(CMAKE_CXX_STANDARD 17)\\n")\n')
    o3 = top.index('string(REPLACE "-O2" "-O3" CMAKE_CUDA_FLAGS_RELWITHDEBINFO')
    for lang in ("C", "CXX", "CUDA"):  # patch 12: RelWithDebInfo's flags without -g, after -O3
        flags = f"CMAKE_{lang}_FLAGS_RELWITHDEBINFO"
        assert top.index(f'string(REGEX REPLACE "(^| )-g( |$)" " " {flags} "${{{flags}}}")\n') > o3
    assert (src / "horovod/torch/CMakeLists.txt").read_text() == (
        'if(NOT Pytorch_VERSION VERSION_LESS "1.5.0")\n    set(CMAKE_CXX_STANDARD 17)\nendif()\n')
    assert (src / "horovod/common/ops/cuda/CMakeLists.txt").read_text() == (
        "set(CMAKE_CUDA_STANDARD 17)\nset(CMAKE_CUDA_STANDARD_REQUIRED ON)\n")
    assert (src / "horovod/common/common.h").read_text() == (
        "#ifndef HOROVOD_COMMON_H\n#define HOROVOD_COMMON_H\n\n"
        "#include <stdexcept>\n#include <functional>\n#include <memory>\n")
    assert (src / "horovod/common/group_table.h").read_text() == (
        "// licence\n\n#include <string>\n#include <mutex>\n#include <queue>\n")
    # The Python diffs too, on both kinds of build.
    assert "def zero_grad(self, set_to_none=True):" in (src / "horovod/torch/optimizer.py").read_text()
    assert "var_ref(source)" in (src / "horovod/tensorflow/__init__.py").read_text()
    # Again on the patched tree: nothing changes.
    before = {p: p.read_text() for p in src.rglob("*") if p.is_file()}
    assert _patch(src, "gpu").returncode == 0
    assert {p: p.read_text() for p in src.rglob("*") if p.is_file()} == before


def test_cpu_patches_leave_the_cuda_files_alone(tmp_path):
    src = _fake_source(tmp_path)
    assert _patch(src).returncode == 0
    assert "set(CMAKE_CXX_STANDARD 17)" in (src / "horovod/torch/CMakeLists.txt").read_text()
    assert "CUDA_STANDARD 11" in (src / "horovod/common/ops/cuda/CMakeLists.txt").read_text()
    assert "<stdexcept>" not in (src / "horovod/common/common.h").read_text()
    assert "_KERAS2_BATCH_NORM" in (src / "horovod/tensorflow/sync_batch_norm.py").read_text()


def test_patch_refuses_a_tree_that_is_not_horovod_0_28_1(tmp_path):
    src = _fake_source(tmp_path)
    (src / "horovod/torch/CMakeLists.txt").write_text("set(CMAKE_CXX_STANDARD 20)\n")
    proc = _patch(src, "gpu")
    assert proc.returncode == 1
    assert "horovod/torch/CMakeLists.txt: no 'set(CMAKE_CXX_STANDARD 14)'" in proc.stderr
    # A Python file unlike 0.28.1's: the diff's name and what patch said.
    src = _fake_source(tmp_path / "other")
    (src / "horovod/torch/optimizer.py").write_text("class Elsewhere:\n    pass\n")
    proc = _patch(src, "cpu")
    assert proc.returncode == 1
    assert "04-torch-zero-grad-set-to-none.patch does not apply to" in proc.stderr
    assert "FAILED" in proc.stderr
    (src / "horovod/common/common.h").unlink()
    proc = _patch(src.parent / "nowhere", "gpu")
    assert proc.returncode == 1 and "not a directory" in proc.stderr


def test_patch_list_names_each_change():
    listed = _patch("--list", "gpu").stdout.splitlines()
    diffs = sorted(p.name for p in (ROOT / "scripts" / "horovod_patches").glob("*.patch"))
    assert len(diffs) >= 4
    assert len(listed) == 6 + len(diffs)
    assert listed[3].startswith("horovod/common/ops/cuda/CMakeLists.txt: ")
    assert [line.split(":")[0] for line in listed[6:]] == [f"scripts/horovod_patches/{d}"
                                                           for d in diffs]
    assert ("scripts/horovod_patches/04-torch-zero-grad-set-to-none.patch: zero_grad("
            "set_to_none=...) in horovod.torch (horovod/horovod#3405)") in listed
    cpu = _patch("--list", "cpu").stdout.splitlines()
    assert len(cpu) == 3 + len(diffs) and cpu[2] == (
        "horovod/tensorflow/CMakeLists.txt: leave xla_mpi_ops.cc out of the build (TensorFlow >= "
        "2.16 ships no XLA headers)")
    assert _patch("--list", "tpu").returncode == 2


def test_python_diffs_apply_with_git_where_patch_is_missing(tmp_path):
    """A host without patch(1) (a GPU machine without a package registry) applies the diffs
    with git apply; the result is the same tree as with patch."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "sed", "grep", "head", "basename", "dirname", "git"):
        (bindir / tool).symlink_to(shutil.which(tool))
    with_git, with_patch = _fake_source(tmp_path / "git"), _fake_source(tmp_path / "patch")
    proc = subprocess.run([str(bindir / "bash"), str(PATCH), str(with_git), "cpu"],
                          capture_output=True, text=True, timeout=60, env={"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    assert _patch(with_patch, "cpu").returncode == 0
    assert {p.relative_to(with_git): p.read_text() for p in with_git.rglob("*") if p.is_file()} \
        == {p.relative_to(with_patch): p.read_text() for p in with_patch.rglob("*")
            if p.is_file()}
    assert "def zero_grad(self, set_to_none=True):" in (
        with_git / "horovod/torch/optimizer.py").read_text()


# ---- the venv's installer: uv where it can be had, else pip --------------------------------------

def _installer(env: dict) -> str:
    return _plan(env)["installer"]


def test_installer_is_uv_when_found_or_installable_else_pip(tmp_path):
    _fake_python(tmp_path / "venv", CPU_FACTS)
    env = _env(tmp_path, VENV=tmp_path / "venv")
    uv_home = tmp_path / "cache" / "tools" / "uv"
    assert _installer(env) == f"uv (to be installed into {uv_home} with pip (once))"
    assert _installer({**env, "PIP_NO_INDEX": "1"}) == "pip (offline (PIP_NO_INDEX) and no uv found)"
    assert _installer({**env, "HVDTRAIN_INSTALLER": "pip"}) == "pip (HVDTRAIN_INSTALLER=pip)"
    uv = _exe(tmp_path / "fakebin" / "uv", "#!/bin/sh\nexit 0\n")
    assert _installer(env) == f"uv {uv} (found)"
    assert _installer({**env, "PIP_NO_INDEX": "1"}) == f"uv {uv} (found)"
    uv.unlink()
    cached = _exe(uv_home / "bin" / "uv", "#!/bin/sh\nexit 0\n")
    assert _installer(env) == f"uv {cached} (found)"
    assert _installer({**env, "HVDTRAIN_UV": str(cached)}) == f"uv {cached} (found)"
    # Not in a user's own environment (HVDTRAIN_PYTHON): pip there.
    py = _fake_python(tmp_path / "own", CPU_FACTS)
    assert _installer(_env(tmp_path, HVDTRAIN_PYTHON=py)) == \
        "pip (HVDTRAIN_PYTHON: pip in that environment)"
    # A new venv's plan says so too.
    assert _installer(_env(tmp_path, VENV=tmp_path / "new")) == f"uv {cached} (found)"
    for bad in ({"HVDTRAIN_INSTALLER": "conda"}, {"HVDTRAIN_UV": str(tmp_path / "nope")}):
        proc = _setup({**env, **bad}, "--plan")
        assert proc.returncode == 1, proc.stdout
        assert ("HVDTRAIN_INSTALLER must be auto, uv or pip, not 'conda'" in proc.stderr
                or f"HVDTRAIN_UV={tmp_path / 'nope'}: no such program" in proc.stderr)


def test_cpu_venv_set_up_with_uv_end_to_end_with_stand_ins(tmp_path):
    """A new venv through uv (a stand-in recording its calls): uv makes the venv, installs the
    pinned stack in one resolution with the constraints and pip's find-links (where this machine
    keeps torch's CPU build), then Horovod's cached wheel and hvdtrain, editable."""
    if not all(shutil.which(p, path="/usr/bin:/bin") for p in ("mpirun", "mpicc")):
        pytest.skip("Open MPI missing: setup.sh would apt-get install it")
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(_fake_source(tmp_path / "src" / "horovod-0.28.1"), arcname="horovod-0.28.1")
    python = _fake_python(tmp_path, CPU_FACTS)
    venv = tmp_path / "venv"
    calls = tmp_path / "uv-calls"
    uv = _exe(tmp_path / "fakebin" / "uv", f"""#!/bin/bash
echo "$*" >> {calls}
case "$1" in
  venv) mkdir -p "${{@: -1}}/bin" && cp {python} "${{@: -1}}/bin/python" ;;
  pip) case "$*" in
         *.whl*) touch {tmp_path / "pystate" / "installed"} ;;
         *" -e "*) touch {venv}/bin/hvdtrain && chmod +x {venv}/bin/hvdtrain ;;
       esac ;;
esac
""")
    env = _env(tmp_path, None, VENV=venv, HVDTRAIN_HOROVOD_SDIST=sdist,
               PIP_FIND_LINKS=f"{tmp_path / 'wheels'} {tmp_path / 'more'}",
               HVDTRAIN_SSHD=tmp_path / "no-sshd", PIP_NO_INDEX="1")
    proc = _setup(env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    phases = [re.sub(r"\(\d+ s\)$", "(N s)", line) for line in proc.stdout.splitlines()]
    assert phases[1:3] == [
        f"[setup] creating {venv} (uv) ... done (N s)",
        f"[setup] installing the pinned stack into {venv} with uv (first time: a few minutes)"
        " ... done (N s)"]
    assert ("[setup] Horovod built with frameworks TensorFlow, PyTorch; controllers MPI, Gloo; "
            "tensor operations MPI, Gloo") in phases
    assert proc.stdout.splitlines()[-1].startswith(f"[setup] ready: {venv} (Horovod 0.28.1, ")
    made, stack, tf_keras, horovod, editable = calls.read_text().splitlines()
    assert made == f"venv --python python3.11 {venv}"
    links = (f"--find-links {tmp_path / 'wheels'} --find-links {tmp_path / 'more'} "
             "--no-index")
    constraints = ROOT / "requirements" / "constraints.txt"
    assert stack.startswith(f"pip install --python {venv}/bin/python {links} -c {constraints} "
                            "pip wheel setuptools torch tensorflow-cpu keras ")
    assert tf_keras.endswith(f"-c {constraints} --no-deps tf-keras")
    assert horovod.startswith(f"pip install --python {venv}/bin/python {links} --no-deps "
                              "--reinstall ") and horovod.endswith(".whl")
    assert editable.endswith(f"--no-deps --no-build-isolation -e {ROOT}")
    assert not (tmp_path / "pystate" / "pip-install").exists()  # pip was not used
    assert uv.exists()
    # Set up again: nothing to do. Then as after a PATCH_ID bump (the stamp of this build's key
    # gone, the Horovod there passing every check): the cached wheel goes in again.
    assert _setup(env).returncode == 0 and len(calls.read_text().splitlines()) == 5
    stamps = list(venv.glob(".hvdtrain-horovod-0.28.1-*"))
    assert len(stamps) == 1 and (tmp_path / "pystate" / "installed").exists()
    stamps[0].unlink()
    assert _setup(env).returncode == 0
    assert calls.read_text().splitlines()[5] == horovod


def test_setup_compiled_what_every_rank_imports_to_bytecode():
    """setup.sh step 6 ran for the environment these tests run in (make test sets it up first):
    the modules each torch rank imports and uv leaves without bytecode (sympy, torch._dynamo,
    mpmath) have current .pyc files, read even where PYTHONDONTWRITEBYTECODE is set."""
    import importlib.util
    import sysconfig
    if os.environ.get("HVDTRAIN_COMPILE_BYTECODE") == "0":
        pytest.skip("HVDTRAIN_COMPILE_BYTECODE=0: set-up step 6 was skipped on purpose")
    site = Path(sysconfig.get_paths()["purelib"])
    if Path(sys.prefix) != ROOT / ".venv" or not (site / ".hvdtrain-bytecode").exists():
        pytest.skip(f"not the environment make setup made ({sys.prefix})")
    for module in ("sympy/__init__.py", "sympy/core/basic.py", "mpmath/__init__.py",
                   "torch/_dynamo/__init__.py", "torch/_dynamo/symbolic_convert.py",
                   "keras/src/__init__.py"):
        source = site / module
        pyc = Path(importlib.util.cache_from_source(str(source)))
        assert pyc.exists(), f"{pyc}: no bytecode for {source}"
        assert pyc.stat().st_mtime >= source.stat().st_mtime


def installed_horovod_patch(module: str, marker: str, revision: int, compiled: bytes) -> None:
    """Assert that a Horovod patch is in the Horovod these tests run on: its ``marker`` in
    ``module`` at ``revision``, and ``compiled`` (a name its C++ adds) in each framework's
    extension library. Skips where Horovod is not installed."""
    import importlib
    import importlib.util
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        pytest.skip("Horovod is not installed here: run make setup")
    assert getattr(importlib.import_module(module), marker, None) == revision
    root = Path(spec.submodule_search_locations[0])
    libraries = sorted(root.glob("torch/mpi_lib_v2*.so")) + sorted(
        root.glob("tensorflow/mpi_lib*.so"))
    assert libraries, f"no Horovod extension library under {root}"
    for library in libraries:
        assert compiled in library.read_bytes(), library


def test_the_installed_horovod_has_gloos_loop_yield_compiled_in():
    """Horovod patch 13 (scripts/horovod_patches/13-gloo-loop-yields.patch) in the Horovod these
    tests run on: the marker in horovod.common.basics and, in each framework's extension library
    (Gloo is compiled into each), the variable its C++ reads (a wheel built before the patch, or
    from a cache key that missed it, has neither)."""
    installed_horovod_patch("horovod.common.basics", "GLOO_LOOP_YIELD", 2,
                            b"HOROVOD_GLOO_LOOP_YIELD")


def test_the_installed_horovod_restarts_its_parameters_at_each_init():
    """Horovod patch 14 (scripts/horovod_patches/14-parameters-restart-on-init.patch) in the
    Horovod these tests run on: the marker in horovod.common.elastic and, in each framework's
    extension library, the function the background thread calls at each initialization
    (ParameterManager::Restart, by its mangled name). tests/parallel/test_horovod_elastic.py
    checks what it does."""
    installed_horovod_patch("horovod.common.elastic", "PARAMETERS_RESTART", 1,
                            b"_ZN7horovod6common16ParameterManager7RestartEv")
