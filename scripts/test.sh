#!/usr/bin/env bash
# `make test`: every test, in two pytest sessions that run at the same time.
#
#   bash scripts/test.sh PYTHON [pytest options...]
#
# A launch of a real 2-rank job leaves part of the machine idle (the launcher, the ranks'
# imports and their shutdown run one process at a time), about a fifth of the serial suite's time
# on a 2-core machine. So the suites with the most waiting (tests/unit: short processes;
# tests/slurm: the scheduler; tests/container: image builds; tests/gpu: skipped without a GPU)
# run beside tests/parallel, then tests/ray and the files of tests/parallel in BESIDE, to
# even out the two sessions' length; tests/spark runs after tests/parallel in the main session.
# Nothing runs at once that shares a port, a cluster or a test host: tests/parallel alone starts
# sshd test hosts, tests/spark alone a Spark cluster, tests/ray alone a Ray cluster (its fixed
# ports 26380-26949, below the kernel's ephemeral range), and Slurm picks free ports of its own.
# The engines' horovodrun MNIST reference (tests/conftest.py) is made once, by the first session
# that needs it, in HVDTRAIN_TEST_SHARED (under a lock); the other reuses it.
#
# The side session writes its output to a file, printed after both end; the exit status is
# non-zero when either session failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/test.sh PYTHON [pytest options...]}
shift

MAIN=(tests/parallel tests/spark)
# tests/ray moved here from MAIN (#47): in the clean-clone run of 4b0267e main took 37:04 (tests/ray
# about 4 of it), the side 28:42; with it here (1243f30) main 37:24, side 35:43, 38.1 min in all:
# even, but no shorter, since both cores are busy throughout.
SIDE=(tests/unit tests/slurm tests/container tests/gpu tests/ray)
# Files of tests/parallel that run beside it, at the end of the side session, to even out the two
# sessions' length (main 48 min, side 26 in the clean-clone run of 5458830): they start no test
# host, use no rank pool and take no fixed port (horovodrun, mpirun and torchrun --standalone on
# free ports).
# test_log_output, test_horovod_settings_launch and test_console moved here too (#47): in the
# clean-clone run of 1bc381a main took 30:33, the side 27:17; about 75 s of launches between them.
# test_launch_signals and test_horovod_elastic too (#47): in the clean-clone run of ed6e029 main
# took 21:15, the side 22:25 with the image's build stage made again (setup.sh had changed;
# 464 s for tests/container instead of 273 s with it cached), so about 19:15 without; these two
# files took 61 s of main.
# test_launch_signals, test_horovod_elastic and test_horovod_settings_launch back in main (#47): in
# the clean-clone run of 13ab9d1 (hvdtrain train's framework imported with the garbage collector
# paused) main took 16:08, the side 18:04; the three took 64 s of the side. In the run of 9bf5a35
# main took 18:12, the side 16:46: test_horovod_elastic (31 s of main) went back beside it.
BESIDE=(tests/parallel/test_benchmarks.py tests/parallel/test_log_output.py
        tests/parallel/test_console.py tests/parallel/test_horovod_elastic.py
        tests/parallel/test_gloo_loop.py)
for dir in tests/*/; do  # a new suite must be placed in one of the two, or it would never run
    dir=${dir%/}
    [[ $(basename "$dir") == [_.]* ]] && continue  # __pycache__
    if [[ " ${MAIN[*]} ${SIDE[*]} " != *" $dir "* ]]; then
        echo "scripts/test.sh: $dir is in neither MAIN nor SIDE; add it to one" >&2
        exit 2
    fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/hvdtrain-test.XXXXXX")
side_log=$work/side.log
# What one session makes and the other can reuse (tests/conftest.py: the engines' MNIST reference).
export HVDTRAIN_TEST_SHARED=$work/shared
mkdir -p "$HVDTRAIN_TEST_SHARED"
# Every temporary file of both sessions and of what they start (ranks, torchrun, Spark's Python
# workers, mpirun's session directory, pytest's tmp_path) lands in $work, removed at the end: a
# killed rank or worker leaves nothing in /tmp. (Ray's session files stay in /tmp, for the
# length of its socket paths; tests/ray removes them.)
export TMPDIR=$work/t
mkdir -p "$TMPDIR"
# Its own temporary folder and no shared cache: two pytest sessions never write the same file.
"$PY" -m pytest "${SIDE[@]}" "${BESIDE[@]}" --basetemp "$work/tmp" -p no:cacheprovider "$@" \
    >"$side_log" 2>&1 &
side=$!
# Ctrl-C or a kill of make ends the side session too.
trap 'kill "$side" 2>/dev/null; wait "$side" 2>/dev/null; rm -rf "$work"; exit 130' INT TERM

echo "[test] ${SIDE[*]} ${BESIDE[*]}: running beside this session (pid $side), its output follows at the end"
"$PY" -m pytest "${MAIN[@]}" "${BESIDE[@]/#/--ignore=}" "$@"
main_rc=$?
wait "$side"
side_rc=$?
trap - INT TERM

echo
echo "======== ${SIDE[*]} (run beside the session above) ========"
cat "$side_log"
echo
echo "[test] ${MAIN[*]}: exit $main_rc; ${SIDE[*]}: exit $side_rc"
if [ "$main_rc" = 0 ] && [ "$side_rc" = 0 ]; then
    rm -rf "$work"
else  # the failed tests' tmp_path and the jobs' files, to read
    echo "[test] kept $work (TMPDIR of both sessions) for the failures above; rm -rf it after"
fi
if ((main_rc != 0 || side_rc != 0)); then
    exit 1
fi
