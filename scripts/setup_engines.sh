#!/usr/bin/env bash
# The engines hvdtrain runs on besides its own launchers: Spark (hvdtrain.spark) and Ray
# (hvdtrain.ray). Idempotent and quick when all is there; scripts/setup.sh calls it last.
#
#   bash scripts/setup_engines.sh [PYTHON]     # PYTHON: the environment to install into
#                                              # (default .venv/bin/python)
#
# 1. A Java runtime for Spark when `java` is missing: Debian's default-jre-headless.
# 2. pyspark[connect] (hvdtrain[spark]) and ray[train] (hvdtrain[ray]) at the versions pinned in
#    requirements/constraints.txt. pyspark 4.x comes as a ~450 MB source archive: the first
#    install takes a minute or two (pip caches the wheel it builds).
#
# Settings: HVDTRAIN_ENGINES="spark ray" (default), "spark", "ray" or "none".
# Where a part cannot be installed (no registry, no apt) it warns and goes on: the engine tests
# then skip, saying why; nothing else in hvdtrain needs the engines.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:-$ROOT/.venv/bin/python}
CONSTRAINTS=$ROOT/requirements/constraints.txt
ENGINES=${HVDTRAIN_ENGINES:-spark ray}
log() { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] warning: %s\n' "$*" >&2; }

[ "$ENGINES" = none ] && exit 0
[ -x "$PY" ] || { warn "engines: $PY not found; skipped"; exit 0; }

pinned() {  # the version constraints.txt pins for package $1
  sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" "$CONSTRAINTS" | head -n 1
}
installed() {  # the installed version of distribution $1 in $PY's environment, or nothing
  "$PY" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

want_spark=0 want_ray=0
for e in $ENGINES; do
  case $e in
    spark) want_spark=1 ;;
    ray) want_ray=1 ;;
    *) echo "setup_engines: HVDTRAIN_ENGINES: unknown engine '$e' (spark, ray or none)" >&2; exit 2 ;;
  esac
done

if [ $want_spark = 1 ] && ! command -v java >/dev/null 2>&1; then
  log "installing a Java runtime for Spark (default-jre-headless) ..."
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         default-jre-headless >/dev/null; }; then
    warn "could not install a Java runtime (Spark needs one: apt-get install default-jre-headless)"
  fi
fi

specs=()
if [ $want_spark = 1 ]; then
  v=$(pinned pyspark)
  # [connect]: Spark Connect's client, so that a Connect session is told apart and refused.
  if [ "$(installed pyspark)" != "$v" ] ||
     ! "$PY" -c 'import grpc_status, zstandard, pandas, pyarrow' 2>/dev/null; then
    specs+=("pyspark[connect]==$v")
  fi
fi
if [ $want_ray = 1 ]; then
  v=$(pinned ray)
  # ray[train] brings Ray Train V2's dependencies (pydantic, pyarrow, ...).
  if [ "$(installed ray)" != "$v" ] || ! "$PY" -c 'import ray.train, pydantic' 2>/dev/null; then
    specs+=("ray[train]==$v")
  fi
fi
if [ ${#specs[@]} -gt 0 ]; then
  log "installing ${specs[*]} (pyspark: a ~450 MB source archive the first time) ..."
  start=$SECONDS
  if "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "${specs[@]}"; then
    log "engines installed ($((SECONDS - start)) s)"
  else
    warn "could not install ${specs[*]}; hvdtrain.spark / hvdtrain.ray and their tests need them"
  fi
fi
exit 0
