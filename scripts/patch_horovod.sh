#!/usr/bin/env bash
# The source changes Horovod 0.28.1 needs to build here (docs/stack.md, section 2).
# scripts/setup.sh runs it on the unpacked source archive before building.
#
#   bash scripts/patch_horovod.sh SRC [cpu|gpu]      # patch the source tree SRC in place
#   bash scripts/patch_horovod.sh --list [cpu|gpu]   # print the patches, one a line; change nothing
#
# cpu: C++17 instead of C++14 in CMakeLists.txt and horovod/torch/CMakeLists.txt (PyTorch >= 2.1
#      headers need C++17); xla_mpi_ops.cc left out of horovod/tensorflow/CMakeLists.txt (it
#      includes XLA/LLVM headers that TensorFlow >= 2.16 wheels no longer ship; the XLA ops only
#      serve XLA-compiled GPU graphs).
# gpu: the same, plus C++17 for the CUDA kernels (horovod/common/ops/cuda/CMakeLists.txt asks for
#      C++11) and two includes gcc 13 needs (upstream after 0.28.1: "Fix build on gcc 13").
# both: the fixes in scripts/horovod_patches/*.patch, unified diffs applied in name order with
#      patch -p1 (each file starts with what it fixes and the upstream issue it mirrors):
#      horovod.tensorflow with Keras 3 variables and layers, Horovod's Keras-2 callbacks under
#      TF_USE_LEGACY_KERAS=1, zero_grad(set_to_none=...) in horovod.torch, (C++, 08) the
#      background thread woken when work is enqueued under HOROVOD_CYCLE_WAKE=1, (CMake, 12) the
#      libraries built without debug info, (C++, 13) Gloo's event loop yielding its core while a
#      pair is locked instead of spinning, (C++, 14) hvd.init() after hvd.shutdown() starting
#      from the parameters as constructed, (15) Horovod's Keras layer all-reducing on Keras 3, and
#      (16) horovod.torch's unnamed collectives named alike on every rank after hvd.join() or a
#      process set, and (17) bfloat16 tensors in horovod.torch and horovod.tensorflow
#      (docs/install.md lists them all).
# Each change is checked once made; running it again on a patched tree changes nothing. A file
# without the expected text (not Horovod 0.28.1?) stops it with exit status 1.
set -euo pipefail

usage() { echo "usage: $0 SRC [cpu|gpu] | --list [cpu|gpu]" >&2; exit 2; }
DIFFS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/horovod_patches
# The diffs go in with patch(1), or with git apply where patch is missing (a GPU host without a
# package registry may have one of them only).
if command -v patch >/dev/null 2>&1; then
  reverses() { patch -d "$1" -p1 -R -f -s --dry-run <"$2" >/dev/null 2>&1; }
  applies() { patch -d "$1" -p1 -N -f -s --dry-run <"$2" 2>&1; }
  apply_diff() { patch -d "$1" -p1 -N -f -s --no-backup-if-mismatch <"$2"; }
elif command -v git >/dev/null 2>&1; then
  reverses() { (cd "$1" && git apply -p1 -R --check "$2" >/dev/null 2>&1); }
  applies() { (cd "$1" && git apply -p1 --check "$2" 2>&1); }
  apply_diff() { (cd "$1" && git apply -p1 "$2"); }
else
  reverses() { return 1; }
  applies() { echo "neither patch nor git is installed (apt-get install patch)"; return 1; }
  apply_diff() { return 1; }
fi

patches() {  # patches MODE: one line per patch, "FILE<TAB>KIND<TAB>ARG<TAB>WHY"
  local t=$'\t' cxx17="PyTorch >= 2.1 needs C++17"
  echo "CMakeLists.txt${t}std${t}CMAKE_CXX_STANDARD 14 17${t}$cxx17"
  echo "horovod/torch/CMakeLists.txt${t}std${t}CMAKE_CXX_STANDARD 14 17${t}$cxx17"
  echo "horovod/tensorflow/CMakeLists.txt${t}drop${t}xla_mpi_ops.cc${t}TensorFlow >= 2.16 ships no XLA headers"
  if [ "$1" = gpu ]; then
    echo "horovod/common/ops/cuda/CMakeLists.txt${t}std${t}CMAKE_CUDA_STANDARD 11 17${t}nvcc C++17"
    echo "horovod/common/common.h${t}include${t}stdexcept${t}gcc 13"
    echo "horovod/common/group_table.h${t}include${t}string${t}gcc 13"
  fi
  local diff
  for diff in "$DIFFS"/*.patch; do
    echo "$(grep -m1 '^+++ ' "$diff" | sed 's|^+++ b/||; s|[[:space:]].*||')${t}diff${t}$diff${t}$(head -n 1 "$diff")"
  done
}

describe() {  # one readable line per patch
  local file kind arg why var from to
  while IFS=$'\t' read -r file kind arg why; do
    if [ "$kind" = std ]; then
      read -r var from to <<<"$arg"
      echo "$file: set($var $from) -> set($var $to) ($why)"
    elif [ "$kind" = drop ]; then
      echo "$file: leave $arg out of the build ($why)"
    elif [ "$kind" = diff ]; then
      echo "scripts/horovod_patches/$(basename "$arg"): $why"
    else
      echo "$file: add #include <$arg> ($why)"
    fi
  done
}

apply() {  # apply SRC: read the patches on stdin and make them in SRC
  local src=$1 file kind arg why var from to path out
  while IFS=$'\t' read -r file kind arg why; do
    path=$src/$file
    [ -f "$path" ] ||
      { echo "patch_horovod: $path: no such file (not Horovod 0.28.1's source?)" >&2; exit 1; }
    if [ "$kind" = diff ]; then
      # Applied already when it reverses cleanly; else it must apply whole.
      reverses "$src" "$arg" && continue
      out=$(applies "$src" "$arg") || {
        echo "patch_horovod: $(basename "$arg") does not apply to $src (not Horovod 0.28.1?):" >&2
        echo "$out" | sed 's/^/    /' >&2
        exit 1
      }
      apply_diff "$src" "$arg"
    elif [ "$kind" = std ]; then
      read -r var from to <<<"$arg"
      grep -Eq "^[[:space:]]*set\($var ($from|$to)\)" "$path" || {
        echo "patch_horovod: $path: no 'set($var $from)' to change (not Horovod 0.28.1?)" >&2
        exit 1
      }
      sed -i "s/^\([[:space:]]*\)set($var $from)/\1set($var $to)/" "$path"
      ! grep -q "set($var $from)" "$path" ||
        { echo "patch_horovod: $path: still asks for $from" >&2; exit 1; }
    elif [ "$kind" = drop ]; then
      # The line that adds the source file to the build; gone already on a patched tree.
      sed -i "/^[[:space:]]*list(APPEND [A-Z_]* \"[^\"]*\/$arg\")/d" "$path"
      ! grep -q "/$arg\"" "$path" ||
        { echo "patch_horovod: $path: still builds $arg" >&2; exit 1; }
    elif ! grep -qx "#include <$arg>" "$path"; then
      # Before the file's first #include, so that everything after it sees the declaration.
      sed -i "0,/^#include /s//#include <$arg>\n&/" "$path"
      grep -qx "#include <$arg>" "$path" || {
        echo "patch_horovod: $path: no #include line to add <$arg> before" >&2
        exit 1
      }
    fi
  done
}

[ $# -ge 1 ] && [ $# -le 2 ] || usage
mode=${2:-cpu}
case $mode in cpu|gpu) ;; *) usage ;; esac
if [ "$1" = --list ]; then
  patches "$mode" | describe
else
  [ -d "$1" ] || { echo "patch_horovod: $1: not a directory" >&2; exit 1; }
  patches "$mode" | apply "$1"
fi
