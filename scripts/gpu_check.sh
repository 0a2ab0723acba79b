#!/usr/bin/env bash
# The GPU acceptance check: on a machine with an NVIDIA GPU, what hvdtrain claims there, run in one
# command, with the evidence in one folder (the figures that benchmarks/README.md and the README's
# GPU section record).
#
#   bash scripts/gpu_check.sh [RESULTS]              # RESULTS defaults to runs/gpu-check
#   GPU_CHECK_STEPS="tests bench" bash scripts/gpu_check.sh   # some steps only (set up already)
#
# Offline (no package registry; a Python that already holds a CUDA PyTorch):
#   . BUNDLE/env.sh && HVDTRAIN_PYTHON=python3 bash scripts/gpu_check.sh
# where BUNDLE comes from scripts/offline_bundle.sh on a machine that reaches the registry.
#
# Steps (GPU_CHECK_STEPS, default "setup tests bench", always in this order; after them, whatever
# was chosen, `horovodrun --check-build` and `hvdtrain doctor` into doctor.txt):
#   setup  HVDTRAIN_GPU=1 scripts/setup.sh: Horovod built with NCCL (into HVDTRAIN_PYTHON's
#          environment when it is set, else .venv)
#   tests  pytest tests/gpu -m gpu (one rank: NCCL refuses two ranks on one GPU)
#   bench  benchmarks/gpu.py: ResNet-50, hvdtrain / plain loop at fp32, bf16 and channels_last,
#          and Keras (PyTorch backend) plain fit / hvdtrain.keras on the MNIST CNN and the LM
#          (target >= 0.98; reported, not asserted)
# RESULTS then holds summary.txt (the GPU, driver, CUDA, torch, Horovod's build, and each step
# with its exit status and seconds), setup.log (setup.sh's lines), setup.log.tools (the compiler's
# and pip's output), doctor.txt, tests.log, tests.xml (JUnit), bench.log and gpu.json: eight
# files, none in a subfolder.
#
# Exit status: 0 when every step passed, 1 when one failed (the others still run, but nothing runs
# after a failed set-up), 2 before any work when no NVIDIA GPU is visible or on bad input.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RESULTS=${1:-$ROOT/runs/gpu-check}
STEPS=${GPU_CHECK_STEPS:-setup tests bench}
for s in $STEPS; do
  case $s in setup|tests|bench) ;; *)
    echo "gpu_check: GPU_CHECK_STEPS: unknown step '$s' (the steps: setup tests bench)" >&2
    exit 2 ;;
  esac
done
[ $# -le 1 ] || { echo "usage: bash scripts/gpu_check.sh [RESULTS]" >&2; exit 2; }
gpus=''
if ! command -v nvidia-smi >/dev/null; then
  gpus_error="nvidia-smi not found"
elif ! gpus=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)
then
  gpus_error="nvidia-smi: $(printf '%s' "$gpus" | head -n 1)"; gpus=''
fi
if [ -z "$gpus" ]; then
  echo "gpu_check: no NVIDIA GPU visible (${gpus_error:-nvidia-smi lists none}); this check" \
    "needs one. On a CPU machine, make test covers the rest." >&2
  exit 2
fi

mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/summary.txt
if [ -n "${HVDTRAIN_PYTHON:-}" ]; then
  PY=$(command -v "$HVDTRAIN_PYTHON") || { echo "gpu_check: HVDTRAIN_PYTHON=$HVDTRAIN_PYTHON:" \
    "no such program" >&2; exit 2; }
else
  PY=$ROOT/.venv/bin/python
fi
cd "$ROOT" || exit 2

say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
failed=0
# step NAME LOG COMMAND...: runs it with its output in LOG, and records status and seconds.
step() {
  local name=$1 out=$2 t0=$SECONDS rc
  shift 2
  printf '[gpu_check] %s ... ' "$name"
  "$@" >> "$out" 2>&1  # appended: pytest's installation and the tests share tests.log
  rc=$?
  printf 'exit %d (%d s)\n' "$rc" "$((SECONDS - t0))"
  printf 'step %-6s exit %d  %4d s  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(basename "$out")" \
    >> "$SUMMARY"
  [ "$rc" -eq 0 ] || { failed=1; tail -n 15 "$out" | sed 's/^/    /'; }
  return "$rc"
}
# After set-up: the interpreter's scripts (horovodrun, hvdtrain) first on PATH, and NCCL's library
# where Horovod loads it (setup.sh's last line names the file that says where).
use_env() {
  local bin env_file
  bin=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') || return 1
  export PATH=$bin:$PATH
  env_file=$(grep -o 'source [^ ]*hvdtrain-env.sh' "$RESULTS/setup.log" 2>/dev/null | tail -n 1)
  env_file=${env_file#source }
  [ -z "$env_file" ] && [ -f "$bin/hvdtrain-env.sh" ] && env_file=$bin/hvdtrain-env.sh
  # shellcheck disable=SC1090
  [ -z "$env_file" ] || . "$env_file"
}
doctor() {
  TF_CPP_MIN_LOG_LEVEL=3 horovodrun --check-build && echo && hvdtrain doctor
}

for f in summary.txt setup.log setup.log.tools doctor.txt tests.log tests.xml bench.log gpu.json; do
  rm -f "${RESULTS:?}/$f"  # this run's evidence only
done
: > "$SUMMARY"
say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): steps: $STEPS"
say "gpu: $gpus"
say "nvcc: $(nvcc --version 2>/dev/null | sed -n 's/.*release \([^,]*\),.*/\1/p' || true)"
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
say "torch: $("$PY" -c '
import torch
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
print(torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(),
      "NCCL", nccl, "GPUs seen", torch.cuda.device_count())' 2>&1 | tail -n 1)"

case " $STEPS " in *" setup "*)
  if ! step setup "$RESULTS/setup.log" env HVDTRAIN_GPU=1 HVDTRAIN_SETUP_LOG="$RESULTS/setup.log.tools" \
      bash scripts/setup.sh; then
    say "set-up failed: tests and bench not run (the tools' output: setup.log.tools)"
    exit 1
  fi
esac
use_env || { say "cannot run $PY"; exit 1; }
step doctor "$RESULTS/doctor.txt" doctor
say "horovod: $(grep -A12 'Available Tensor Operations' "$RESULTS/doctor.txt" |
  grep -o '\[X\] [A-Za-z]*' | tr '\n' ' ')"

# What the tests (pytest, keras) and the benchmark (keras) need, where the environment lacks it
# (offline: from the bundle, PIP_FIND_LINKS); keras at its pinned version alone (a whole
# constraints file would also move the numpy the environment has).
wanted=''
case " $STEPS " in *" tests "*) wanted="pytest keras" ;; *" bench "*) wanted="keras" ;; esac
for m in $wanted; do
  # find_spec, not import: Keras's default backend is TensorFlow, absent from GPU environments
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$m') is None)" \
      2>/dev/null; then
    spec=$(grep -E "^$m==" requirements/constraints.txt || echo "$m")
    step "$m" "$RESULTS/tests.log" "$PY" -m pip install --disable-pip-version-check "$spec"
  fi
done

case " $STEPS " in *" tests "*)
  step tests "$RESULTS/tests.log" "$PY" -m pytest tests/gpu -m gpu -rA -p no:cacheprovider \
    --junitxml="$RESULTS/tests.xml"
  say "tests: $(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$RESULTS/tests.log" | tail -n 1)"
  # A skipped GPU test proves nothing: on a GPU machine none may be skipped.
  if grep -qE '^=+ .*[0-9]+ skipped' "$RESULTS/tests.log"; then
    say "tests: FAILED: tests were skipped (tests.log says why); on a GPU machine every one must run"
    failed=1
  fi
esac

case " $STEPS " in *" bench "*)
  step bench "$RESULTS/bench.log" env PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu.py \
    --json-out "$RESULTS/gpu.json"
  "$PY" - "$RESULTS/gpu.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
try:
    result = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print(f"bench: no results ({exc})")
    raise SystemExit(0)
print(f"bench: {result['model']}, batch {result['batch_size']}, {result['unit']}s: "
      f"{result['size']}, target ratio >= {result['target_ratio']}")
for name, v in result["variants"].items():
    print(f"bench: {name}: plain {v['plain']['img_sec_median_of_rounds']:.0f} img/s, hvdtrain "
          f"{v['hvdtrain']['img_sec_median_of_rounds']:.0f} img/s, ratio {v['ratio']:.3f} "
          f"({'met' if v['meets_target'] else 'NOT met'})")
PY
esac

say "result: $([ "$failed" -eq 0 ] && echo "every step passed" || echo "a step FAILED")"
exit "$failed"
