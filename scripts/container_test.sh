#!/usr/bin/env bash
# The images for real, with podman and no image registry (tests/container runs this):
#
#   bash scripts/container_test.sh [OUTDIR]      # OUTDIR default: a new temporary directory
#
# (an OUTDIR inside the checkout belongs under runs/, which .dockerignore leaves out of the build)
#
# 1. podman (runc, fuse-overlayfs, CNI plugins with dnsname) and podman-compose from Debian's
#    packages when missing; mmdebstrap too when the base image has to be made.
# 2. A containers.conf of its own (CONTAINERS_CONF, in a temporary directory): runtime runc and
#    cgroupfs (no systemd needed), default ulimits under this shell's hard limits.
# 3. The base image docker.io/library/python:3.11-slim-bookworm, when it is not in podman's local
#    storage: a Debian 12 minbase with Debian's python3.11, from mmdebstrap and this host's apt
#    sources, then `podman import` (nothing is pulled: --pull=never).
# 4. docker/Dockerfile.cpu built as hvdtrain:cpu (its build stage tagged hvdtrain:cpu-build) with
#    this host's pip settings (`pip config list`: index URLs, find-links, CA bundle) as build
#    arguments, their local files and folders lent read-only as volumes, and
#    ~/.cache/hvdtrain/wheels lent as Horovod's wheel cache, so Horovod is not compiled when the
#    host has its wheel. Layers stay cached for the next run; the images a build replaces go.
# 5. In the image: `hvdtrain doctor`; the 2-rank main job (MNIST, cached in the image at build
#    time; horovodrun -np 2, output in
#    OUTDIR/main on the host: final test accuracy >= 0.989); what the runtime image holds (no
#    g++/gcc/cmake/make/git, no .git, no PIP_* build argument in its environment or history).
# 6. The cluster of docker/compose.yaml with podman-compose: node2 up, waited for until its
#    healthcheck passes (podman-compose 1.0.3 starts node1 without waiting, and podman runs no
#    healthchecks by itself without systemd), then node1, whose exit status is waited for; its
#    run goes to OUTDIR/cluster on the host (HVDTRAIN_RUN_DIR): 4 ranks on 2 hosts.
# 7. Kubernetes without Kubernetes: the MPIJob that `hvdtrain launch --emit mpijob` writes (in the
#    image), run by scripts/mpijob_contract.py as Kubeflow's MPI Operator would (worker pods with
#    sshd and the operator's SSH Secret, a launcher with its hostfile and Open MPI variables; the
#    PVC is OUTDIR/mpijob-runs), against the same training command under horovodrun -np 2 in one
#    container (OUTDIR/reference); the test compares their metrics epoch by epoch.
# 8. The eviction drill: the same MPIJob, worker 1 stopped as a node drain stops a pod once epoch
#    1's checkpoint exists; the stop checkpoint, the worker made again, the launcher started
#    again, and --resume auto to the end (OUTDIR/evict, OUTDIR/evict-runs).
#
# Writes OUTDIR/summary.json (the numbers the checks used, the image's size in bytes and the build
# time in seconds) and the logs OUTDIR/*.log; prints one line per step.
#
# Exit status: 0 when every check passed; 3, with a one-line reason as the last line on stderr,
# when podman, podman-compose or mmdebstrap are missing and cannot be installed (not root, no
# apt-get, apt-get failed): tests skip on that; anything else is a failure.
# The containers, networks and volumes it makes are removed on exit (also after a failure); the
# images (base, hvdtrain:cpu-build, hvdtrain:cpu) stay, so a second run takes about 4 minutes.
#
# Settings (environment, all optional):
#   HVDTRAIN_CACHE        hvdtrain's cache, whose wheels/ is lent to the build (default
#                         ~/.cache/hvdtrain, as scripts/setup.sh)
#   HVDTRAIN_CT_PYTHON    the Python whose pip settings the build gets (default: .venv/bin/python
#                         of this checkout, else python3)
set -euo pipefail

PROG=container_test.sh
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=localhost/hvdtrain:cpu  # the image docker/compose.yaml names (hvdtrain:cpu)
BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
CACHE=${HVDTRAIN_CACHE:-$HOME/.cache/hvdtrain}
PROJECT=hvdtrain-ct  # podman-compose project: containers hvdtrain-ct_node1_1, hvdtrain-ct_node2_1
MAIN_CONTAINER=hvdtrain-ct-main
MPIJOB=hvdtrain-ct-mpijob  # the MPIJob's name: containers $MPIJOB-worker-<i>, $MPIJOB-launcher
PODMAN_PACKAGES=(podman runc fuse-overlayfs containernetworking-plugins
                 golang-github-containernetworking-plugin-dnsname podman-compose)
DNSNAME_PLUGIN=/usr/lib/cni/dnsname

say() { printf '[container_test] %s\n' "$*"; }
die() { echo "$PROG: error: $*" >&2; exit 1; }
cannot_install() { echo "$PROG: cannot install $*" >&2; exit 3; }
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH=$PATH:/usr/sbin:/sbin ;; esac

[ $# -le 1 ] || { echo "usage: bash scripts/container_test.sh [OUTDIR]" >&2; exit 2; }
# One run at a time on a machine: the containers' and the compose project's names are fixed.
exec 9>"/tmp/hvdtrain-container-test.$(id -u).lock"
if ! flock -n 9; then
  say "another scripts/container_test.sh is running: waiting for it"
  flock -w 3600 9 || die "another scripts/container_test.sh still runs after an hour"
fi
OUT=${1:-$(mktemp -d /tmp/container_test.XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# What a previous run left in OUTDIR must not pass for this run's results.
rm -rf "$OUT/main" "$OUT/cluster" "$OUT/mpijob" "$OUT/mpijob-runs" "$OUT/reference" \
  "$OUT/evict" "$OUT/evict-runs" "$OUT/mpijob.yaml" "$OUT/summary.json" "$OUT"/*.log
mkdir -p "$OUT/main" "$OUT/cluster"
T_START=$SECONDS

step() {  # step "what it does" LOGNAME command...: its output goes to OUTDIR/LOGNAME.log
  local what=$1 log=$OUT/$2.log t0=$SECONDS rc
  shift 2
  printf '[container_test] %s ... ' "$what"
  set +e
  ( set -e; "$@" ) >>"$log" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    printf 'FAILED (exit %d after %d s)\n' "$rc" "$((SECONDS - t0))"
    echo "$PROG: '$what' failed; the last lines of $log:" >&2
    tail -n 30 "$log" | sed 's/^/    /' >&2
    return "$rc"
  fi
  printf 'done (%d s)\n' "$((SECONDS - t0))"
}

# ---- 1. podman and co. -------------------------------------------------------------------------
APT_UPDATED=0
apt_install() {  # apt_install WHAT PACKAGE...: exits 3 when that cannot be done
  local what=$1 log=$OUT/install.log
  shift
  [ "$(id -u)" -eq 0 ] || cannot_install "$what: not root (uid $(id -u)); apt-get install $* needs root"
  command -v apt-get >/dev/null 2>&1 || cannot_install "$what: no apt-get on this machine"
  if [ "$APT_UPDATED" = 0 ]; then
    say "apt-get update (log: $log)"
    apt-get -o DPkg::Lock::Timeout=300 update >>"$log" 2>&1 ||
      { tail -n 10 "$log" | sed 's/^/    /' >&2; cannot_install "$what: apt-get update failed (log: $log)"; }
    APT_UPDATED=1
  fi
  say "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y \
    --no-install-recommends "$@" >>"$log" 2>&1 ||
    { tail -n 10 "$log" | sed 's/^/    /' >&2; cannot_install "$what: apt-get install $* failed (log: $log)"; }
}
if ! command -v podman >/dev/null 2>&1 || ! command -v podman-compose >/dev/null 2>&1 ||
   ! command -v runc >/dev/null 2>&1 || [ ! -x "$DNSNAME_PLUGIN" ]; then
  apt_install podman "${PODMAN_PACKAGES[@]}"
  for c in podman podman-compose runc; do
    command -v "$c" >/dev/null 2>&1 || cannot_install "podman: no $c after apt-get install"
  done
fi
say "$(podman --version), $(podman-compose version 2>/dev/null | grep -i '^podman-compose' | head -n 1)"

# ---- 2. podman's settings for this run ---------------------------------------------------------
WORK=$(mktemp -d /tmp/container_test-work.XXXXXX)
HARD_NOFILE=$(ulimit -Hn)
HARD_NPROC=$(ulimit -Hu)
[ "$HARD_NOFILE" != unlimited ] || HARD_NOFILE=1048576
NPROC=32768
[ "$HARD_NPROC" = unlimited ] || [ "$HARD_NPROC" -ge "$NPROC" ] || NPROC=$HARD_NPROC
cat >"$WORK/containers.conf" <<EOF
# Written by scripts/container_test.sh for its own podman commands.
[containers]
default_ulimits = ["nofile=$HARD_NOFILE:$HARD_NOFILE", "nproc=$NPROC:$NPROC"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF=$WORK/containers.conf
export HVDTRAIN_RUN_DIR=$OUT/cluster  # docker/compose.yaml: node1's --output-dir
COMPOSE=(podman-compose -p "$PROJECT" -f "$ROOT/docker/compose.yaml")

remove_ours() {  # the containers, volumes and network this script makes (also a killed run's)
  podman rm -f "$MAIN_CONTAINER" >/dev/null 2>&1
  "${COMPOSE[@]}" down -v >>"$OUT/cleanup.log" 2>&1
  # podman-compose 1.0.3's down leaves the project's network, and an interrupted run more.
  podman ps -a --format '{{.Names}}' | grep "^${PROJECT}_" | xargs -r podman rm -f >/dev/null 2>&1
  podman volume ls --format '{{.Name}}' | grep "^${PROJECT}_" | xargs -r podman volume rm -f \
    >/dev/null 2>&1
  podman network ls --format '{{.Name}}' | grep "^${PROJECT}_" | xargs -r podman network rm -f \
    >/dev/null 2>&1
  # scripts/mpijob_contract.py removes its own (steps 7, 8), unless it was killed outright.
  podman ps -a --format '{{.Names}}' | grep "^${MPIJOB}-\(worker-[0-9]*\|launcher\)$" |
    xargs -r podman rm -f >/dev/null 2>&1
  podman network rm -f "${MPIJOB}-mpijob-net" >/dev/null 2>&1
  return 0
}
cleanup() {
  local rc=$?
  set +e
  remove_ours
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
remove_ours || true  # what an interrupted run left, before this one starts (errexit off inside)

# ---- 3. the base image ---------------------------------------------------------------------------
make_base() {
  local sources=() tar=$WORK/base.tar
  # This host's Debian sources (their mirror), else mmdebstrap's default.
  if [ -s /etc/apt/sources.list.d/debian.sources ]; then
    sources=(/etc/apt/sources.list.d/debian.sources)
  elif grep -qs '^deb ' /etc/apt/sources.list; then
    sources=(/etc/apt/sources.list)
  fi
  mmdebstrap --variant=minbase \
    --include=python3.11,python3.11-venv,python3.11-dev,python3-pip,ca-certificates,netbase \
    bookworm "$tar" "${sources[@]}"
  podman import --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3.11"]' "$tar" "$BASE_IMAGE"
  rm -f "$tar"
}
if podman image exists "$BASE_IMAGE"; then
  say "base image $BASE_IMAGE: present"
else
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    apt_install mmdebstrap mmdebstrap
    command -v mmdebstrap >/dev/null 2>&1 || cannot_install "mmdebstrap: not found after apt-get install"
  fi
  step "making the base image $BASE_IMAGE with mmdebstrap (no registry; about a minute)" base \
    make_base
fi

# ---- 4. the image ------------------------------------------------------------------------------
PY=${HVDTRAIN_CT_PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
# This host's pip settings as build arguments and read-only volumes, one per output line:
# "arg NAME=VALUE" or "volume HOST:CONTAINER:ro".
read -r -d '' PIP_SETTINGS <<'PY' || true
import os, shlex, subprocess, sys
from urllib.parse import unquote, urlparse
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                     text=True).stdout
found = {}  # option -> value; the environment (":env:") over files, [global] over others
rank = {":env:": 3, "global": 2}
for line in out.splitlines():
    key, _, value = line.partition("=")
    section, _, option = key.rpartition(".")
    if not option:
        continue
    try:
        value = " ".join(shlex.split(value))
    except ValueError:
        continue
    r = rank.get(section, 1)
    if option not in found or r >= found[option][0]:
        found[option] = (r, value)
volumes = set()
def local(path, index=False):
    """Lend a local path to the build at the same path (an index: the folder above simple/)."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        return
    if index and os.path.basename(path.rstrip("/")) == "simple":
        path = os.path.dirname(path.rstrip("/"))
    volumes.add(path)
def urls(option, index=False):
    kept = []
    for item in found.get(option, (0, ""))[1].split():
        u = urlparse(item)
        if u.scheme == "file":
            local(unquote(u.path), index)
        elif not u.scheme:
            local(item, index)
        kept.append(item)
    return " ".join(kept)
args = {}
if found.get("index-url"):
    args["PIP_INDEX_URL"] = urls("index-url", index=True)
args["PIP_EXTRA_INDEX_URL"] = urls("extra-index-url", index=True)
args["PIP_FIND_LINKS"] = urls("find-links")
args["PIP_TRUSTED_HOST"] = found.get("trusted-host", (0, ""))[1]
cert = found.get("cert", (0, ""))[1]
if cert and os.path.isfile(cert):
    print("volume %s:/run/hvdtrain-pip/ca.pem:ro" % os.path.realpath(cert))
    args["PIP_CERT"] = "/run/hvdtrain-pip/ca.pem"
for name, value in args.items():
    if value:
        print("arg %s=%s" % (name, value))
for path in sorted(volumes):
    print("volume %s:%s:ro" % (path, path))
PY
BUILD_ARGS=()
while IFS= read -r line; do
  case $line in
    arg\ *) BUILD_ARGS+=(--build-arg "${line#arg }") ;;
    volume\ *) BUILD_ARGS+=(-v "${line#volume }") ;;
  esac
done < <("$PY" -c "$PIP_SETTINGS")
if compgen -G "$CACHE/wheels/*/horovod-*.whl" >/dev/null; then
  BUILD_ARGS+=(-v "$CACHE/wheels:/opt/hvdtrain-wheels:ro")
  say "Horovod wheel cache lent to the build: $CACHE/wheels"
else
  say "no Horovod wheel in $CACHE/wheels: the build compiles Horovod (about 3 minutes on 2 cores)"
fi
printf '%s\n' "${BUILD_ARGS[@]}" | grep -v '^--build-arg$\|^-v$' | sed 's/^/[container_test]   build: /'

# The build stage is tagged too ($IMAGE-build): its layers are the cache of the next build, and an
# untagged stage would be taken by the first `podman image prune`. The images a build replaces
# (and their layers no other image uses) are removed, so reruns do not fill the disk.
BUILD_IMAGE=$IMAGE-build
image_id() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }
build() {  # build [--target build] TAG
  podman build --pull=never --layers -f "$ROOT/docker/Dockerfile.cpu" "${@:1:$#-1}" \
    -t "${!#}" "${BUILD_ARGS[@]}" "$ROOT"
}
OLD_IDS=("$(image_id "$BUILD_IMAGE")" "$(image_id "$IMAGE")")
t0=$SECONDS
step "podman build --target build -t $BUILD_IMAGE (first time: about 5 minutes, 6 more to compile Horovod)" \
  build build --target build "$BUILD_IMAGE"
step "podman build -t $IMAGE (first time: about 4 minutes)" build build "$IMAGE"
BUILD_SECONDS=$((SECONDS - t0))
NEW_IDS=" $(image_id "$BUILD_IMAGE") $(image_id "$IMAGE") "
for id in "${OLD_IDS[@]}"; do
  if [ -n "$id" ] && [[ $NEW_IDS != *" $id "* ]]; then
    podman rmi "$id" >>"$OUT/build.log" 2>&1 || true
  fi
done
IMAGE_BYTES=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "image $IMAGE: $((IMAGE_BYTES / 1000000)) MB ($IMAGE_BYTES bytes), built in $BUILD_SECONDS s"

# ---- 5. in the image ---------------------------------------------------------------------------
# What the runtime image holds: compilers and build tools (Open MPI's mpicc is there, a wrapper with
# no compiler behind it), the checkout's .git, pip's build arguments.
CONTENTS=$(podman run --rm --name "$MAIN_CONTAINER" "$IMAGE" sh -c '
  for c in g++ gcc cc c++ cmake make git; do
    if command -v "$c" >/dev/null 2>&1; then echo "tool $c"; fi
  done
  if [ -e /opt/hvdtrain/.git ]; then echo "git_dir"; fi
  env | sed -n "s/^\(PIP_[A-Z_]*\)=.*/env \1/p"')
ENV_JSON=$(podman image inspect --format '{{json .Config.Env}}' "$IMAGE")
HISTORY=$(podman history --no-trunc --format '{{.CreatedBy}}' "$IMAGE")
TOOLS=$(sed -n 's/^tool //p' <<<"$CONTENTS" | paste -sd' ' -)
HAS_GIT_DIR=false
! grep -qx git_dir <<<"$CONTENTS" || HAS_GIT_DIR=true
PIP_IN_ENV=$( (sed -n 's/^env //p' <<<"$CONTENTS"; grep -o 'PIP_[A-Z_]*' <<<"$ENV_JSON" || true) |
  sort -u | paste -sd' ' -)
PIP_IN_HISTORY=$(grep -o 'PIP_[A-Z_]*=' <<<"$HISTORY" | sort -u | paste -sd' ' - || true)
say "runtime image: build tools [${TOOLS}], .git ${HAS_GIT_DIR}, PIP_* in its environment" \
  "[${PIP_IN_ENV}], in its history [${PIP_IN_HISTORY}]"

DOCTOR_RC=0
step "hvdtrain doctor" doctor podman run --rm --name "$MAIN_CONTAINER" "$IMAGE" hvdtrain doctor ||
  DOCTOR_RC=$?

MAIN_RC=0
MNIST=(--dataset mnist)  # make demo's: the mnist recipe (hvdtrain/datasets/recipes.py)
step "main job: horovodrun -np 2 -H localhost:2 hvdtrain train --framework torch ${MNIST[*]}" \
  main podman run --rm --name "$MAIN_CONTAINER" -v "$OUT/main:/out" "$IMAGE" \
  horovodrun -np 2 -H localhost:2 hvdtrain train --framework torch "${MNIST[@]}" --no-progress \
  --output-dir /out || MAIN_RC=$?

# ---- 6. the two-container cluster of docker/compose.yaml ---------------------------------------
NODE1=${PROJECT}_node1_1
NODE2=${PROJECT}_node2_1
wait_healthy() {  # podman runs healthchecks on systemd timers: without systemd, run them here
  local i
  for i in $(seq 1 60); do
    if podman healthcheck run "$NODE2"; then echo "healthy after $i tries"; return 0; fi
    [ "$(podman inspect --format '{{.State.Running}}' "$NODE2")" = true ] ||
      { echo "$NODE2 is not running"; podman logs "$NODE2"; return 1; }
    sleep 1
  done
  echo "$NODE2 not healthy after 60 tries"
  return 1
}
cluster() {  # (called from step, under `||`: bash ignores errexit there, so each check returns)
  "${COMPOSE[@]}" up -d node2 || return 1
  wait_healthy || return 1
  # podman-compose 1.0.3 starts a service's dependencies too, --no-deps or not: node2 again,
  # which fails (its name is taken) and falls back to `podman start` of the running node2.
  "${COMPOSE[@]}" up -d node1 || true
  podman container exists "$NODE1" || { echo "podman-compose did not make $NODE1"; return 1; }
  local rc
  rc=$(podman wait "$NODE1") || return 1
  podman logs "$NODE1"
  echo "node1 exited $rc"
  return "$rc"
}
CLUSTER_RC=0
step "compose cluster: node2 up and healthy, then node1 runs 4 ranks on 2 hosts" cluster cluster ||
  CLUSTER_RC=$?
"${COMPOSE[@]}" down -v >>"$OUT/cluster.log" 2>&1 || true

# ---- 7. an MPIJob under the MPI Operator's contract ----------------------------------------------
# The manifest `hvdtrain launch --emit mpijob` writes (in the image, as a user with it would), run
# by scripts/mpijob_contract.py as the operator would run it: two worker containers running
# `sshd -De` with the operator's SSH Secret at /root/.ssh, then the launcher with the hostfile at
# /etc/mpi/hostfile and the operator's Open MPI variables; the PVC is OUTDIR/mpijob-runs. The
# reference: the same training command under horovodrun -np 2 in one container (OUTDIR/reference).
# From step 45 (epoch 2) each step takes >= 0.05 s, numbers unchanged: the eviction below, after
# epoch 1's checkpoint, lands while the job runs on any machine.
TRAIN=(hvdtrain train --framework torch --dataset digits --epochs 4 --no-progress
       --fault-slow-from 45:0.05 --output-dir /runs/digits)
mkdir -p "$OUT/mpijob-runs" "$OUT/reference" "$OUT/evict-runs"
emit_mpijob() {
  podman run --rm --name "$MAIN_CONTAINER" "$IMAGE" hvdtrain launch --emit mpijob --image "$IMAGE" \
    -np 2 --slots-per-worker 1 --job-name "$MPIJOB" --pvc hvdtrain-runs -- "${TRAIN[@]}" \
    >"$OUT/mpijob.yaml"
}
MPIJOB_RC=0
REFERENCE_RC=0
step "hvdtrain launch --emit mpijob -np 2 --slots-per-worker 1 (in the image)" mpijob emit_mpijob ||
  MPIJOB_RC=$?
step "reference: horovodrun -np 2 -H localhost:2 ${TRAIN[*]} --resume auto" reference \
  podman run --rm --name "$MAIN_CONTAINER" -v "$OUT/reference:/runs/digits" "$IMAGE" \
  horovodrun -np 2 -H localhost:2 "${TRAIN[@]}" --resume auto || REFERENCE_RC=$?
if [ "$MPIJOB_RC" = 0 ]; then
  step "MPIJob as the operator runs it: 2 worker pods (sshd -De), then the launcher (mpirun)" \
    mpijob "$PY" "$ROOT/scripts/mpijob_contract.py" "$OUT/mpijob.yaml" "$OUT/mpijob" \
    --claim "hvdtrain-runs=$OUT/mpijob-runs" || MPIJOB_RC=$?
fi

# ---- 8. the eviction drill -------------------------------------------------------------------
# The same MPIJob again; once epoch 1's checkpoint is on the claim, worker 1 is stopped as a node
# drain stops a pod (SIGTERM, SIGKILL after the manifest's grace period). Its hvdtrain worker hands
# SIGTERM to its rank: all ranks stop after one step, rank 0 writes the stop checkpoint, mpirun
# exits 75; the worker pod is made again and the launcher started again (OnFailure,
# backoffLimit), and --resume auto continues from the checkpoint (OUTDIR/evict-runs).
EVICT_RC=0
if [ "$MPIJOB_RC" = 0 ]; then
  step "eviction drill: worker 1 stopped after epoch 1, the launcher started again" evict \
    "$PY" "$ROOT/scripts/mpijob_contract.py" "$OUT/mpijob.yaml" "$OUT/evict" \
    --claim "hvdtrain-runs=$OUT/evict-runs" --evict-worker 1 \
    --evict-after-file "$OUT/evict-runs/checkpoint.pt" || EVICT_RC=$?
else
  EVICT_RC=$MPIJOB_RC
fi

# ---- summary ----------------------------------------------------------------------------------
export OUT TOOLS HAS_GIT_DIR PIP_IN_ENV PIP_IN_HISTORY DOCTOR_RC MAIN_RC CLUSTER_RC IMAGE IMAGE_BYTES
export MPIJOB_RC REFERENCE_RC EVICT_RC
export BUILD_SECONDS
TOTAL_SECONDS=$((SECONDS - T_START))
export TOTAL_SECONDS
python3 - <<'PY'
import json, os
env = os.environ
def metrics(name):
    try:
        with open(os.path.join(env["OUT"], name, "metrics.json")) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return {}
    return {"final_test_accuracy": m.get("final_test_accuracy"), "size": m.get("size"),
            "hosts": m.get("hosts")}
summary = {
    "image": env["IMAGE"],
    "image_bytes": int(env["IMAGE_BYTES"]),
    "build_seconds": int(env["BUILD_SECONDS"]),
    "total_seconds": int(env["TOTAL_SECONDS"]),
    "doctor_exit": int(env["DOCTOR_RC"]),
    "main_exit": int(env["MAIN_RC"]),
    "main": metrics("main"),
    "cluster_node1_exit": int(env["CLUSTER_RC"]),
    "cluster": metrics("cluster"),
    "mpijob_exit": int(env["MPIJOB_RC"]),
    "mpijob": metrics("mpijob-runs"),
    "reference_exit": int(env["REFERENCE_RC"]),
    "reference": metrics("reference"),
    "evict_exit": int(env["EVICT_RC"]),
    "evict": metrics("evict-runs"),
    "runtime_build_tools": env["TOOLS"].split(),
    "runtime_has_git_dir": env["HAS_GIT_DIR"] == "true",
    "runtime_pip_env": env["PIP_IN_ENV"].split(),
    "runtime_pip_history": env["PIP_IN_HISTORY"].split(),
}
with open(os.path.join(env["OUT"], "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
PY
say "summary: $OUT/summary.json"

# ---- checks ------------------------------------------------------------------------------------
FAILED=()
[ "$DOCTOR_RC" = 0 ] || FAILED+=("hvdtrain doctor exited $DOCTOR_RC")
[ "$MAIN_RC" = 0 ] || FAILED+=("the main job exited $MAIN_RC")
[ "$CLUSTER_RC" = 0 ] || FAILED+=("the cluster's node1 exited $CLUSTER_RC")
[ "$MPIJOB_RC" = 0 ] || FAILED+=("the MPIJob's launcher exited $MPIJOB_RC (OUTDIR/mpijob/*.log)")
[ "$REFERENCE_RC" = 0 ] || FAILED+=("the MPIJob's horovodrun reference exited $REFERENCE_RC")
[ "$EVICT_RC" = 0 ] || FAILED+=("the eviction drill's last launcher exited $EVICT_RC (OUTDIR/evict/*.log)")
[ -z "$TOOLS" ] || FAILED+=("the runtime image has build tools: $TOOLS")
[ "$HAS_GIT_DIR" = false ] || FAILED+=("the runtime image has /opt/hvdtrain/.git")
[ -z "$PIP_IN_ENV" ] || FAILED+=("the runtime image's environment has $PIP_IN_ENV")
[ -z "$PIP_IN_HISTORY" ] || FAILED+=("the runtime image's history has $PIP_IN_HISTORY")
CHECK=$(python3 - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m, c = s["main"], s["cluster"]
if not m:
    print("no metrics.json from the main job in OUTDIR/main")
elif m["size"] != 2 or (m["final_test_accuracy"] or 0) < 0.989:
    print("main job (MNIST): size %s, final test accuracy %s (want 2, >= 0.989)"
          % (m["size"], m["final_test_accuracy"]))
if not c:
    print("no metrics.json from the cluster in OUTDIR/cluster")
elif c["size"] != 4 or c["hosts"] != 2:
    print("cluster: size %s on %s hosts (want 4 on 2)" % (c["size"], c["hosts"]))
j, r = s["mpijob"], s["reference"]
if not j:
    print("no metrics.json from the MPIJob in OUTDIR/mpijob-runs")
elif j["size"] != 2 or j["hosts"] != 2:
    print("MPIJob: size %s on %s hosts (want 2 on 2)" % (j["size"], j["hosts"]))
elif r and j["final_test_accuracy"] != r["final_test_accuracy"]:
    print("MPIJob: final test accuracy %s, horovodrun's %s (want equal)"
          % (j["final_test_accuracy"], r["final_test_accuracy"]))
PY
)
while IFS= read -r line; do [ -z "$line" ] || FAILED+=("$line"); done <<<"$CHECK"
say "main job: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["main"])' \
  "$OUT/summary.json"); cluster: $(python3 -c \
  'import json,sys; print(json.load(open(sys.argv[1]))["cluster"])' "$OUT/summary.json"); MPIJob:\
 $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["mpijob"])' "$OUT/summary.json")"
say "image $((IMAGE_BYTES / 1000000)) MB, build $BUILD_SECONDS s, whole test $TOTAL_SECONDS s"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf '%s: FAILED: %s\n' "$PROG" "${FAILED[@]}" >&2
  exit 1
fi
say "all checks passed"
