"""benchmarks' side-by-side runs ("np=2 apart" in vs_single.py): synthetic.py's start barrier
and common.run_json_together, with stand-in jobs (a few lines of Python each) instead of
training, so each check takes a second."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402

# A job as vs_single's: waits at synthetic.start_barrier(DIR,N), then writes the time it
# passed to --json-out (or exits 3 at once, when told to fail).
JOB = """import json, sys, time
sys.path.insert(0, {bench!r})
from synthetic import start_barrier
spec, fail, out = sys.argv[1], sys.argv[2] == "fail", sys.argv[-1]
if fail:
    sys.exit(3)
start_barrier(spec, timeout_s=float(sys.argv[3]))
json.dump({{"passed": time.perf_counter()}}, open(out, "w"))
"""


def job(tmp_path, *args):
    script = tmp_path / "job.py"
    script.write_text(JOB.format(bench=str(ROOT / "benchmarks")))
    return [sys.executable, str(script), *args]


def test_processes_pass_the_barrier_together(tmp_path):
    where = tmp_path / "barrier"
    # The second job starts once the first is at the barrier: the first waits for it.
    first = subprocess.Popen([*job(tmp_path, f"{where},2", "ok", "120"), "--json-out",
                              str(tmp_path / "a.json")])
    try:
        deadline = time.monotonic() + 120
        while not (where.exists() and any(where.iterdir())):  # its ready-PID file
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert not (tmp_path / "a.json").exists()
        second_started = time.perf_counter()  # CLOCK_MONOTONIC: the jobs' clock too
        second = subprocess.run([*job(tmp_path, f"{where},2", "ok", "120"), "--json-out",
                                 str(tmp_path / "b.json")], timeout=120)
        assert first.wait(timeout=120) == 0 and second.returncode == 0
    finally:
        if first.poll() is None:
            first.kill()
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["passed"] for n in "ab")
    assert a > second_started  # the first did not pass alone, before the second started
    assert abs(a - b) < 0.5  # they passed together


def test_a_barrier_nobody_else_reaches_times_out(tmp_path):
    proc = subprocess.run([*job(tmp_path, f"{tmp_path / 'b'},2", "ok", "0.3"), "--json-out",
                           str(tmp_path / "a.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "TimeoutError" in proc.stderr
    assert "only 1 arrived" in proc.stderr


def test_run_json_together_returns_each_jobs_json_in_order(tmp_path):
    argv = job(tmp_path, f"{tmp_path / 'b'},3", "ok", "60")
    results = common.run_json_together([argv] * 3, dict(os.environ))
    assert len(results) == 3 and max(r["passed"] for r in results) - min(
        r["passed"] for r in results) < 0.5


def test_one_failed_job_stops_the_others_at_once(tmp_path):
    # Two jobs wait at a barrier for a third that exits 3 before reaching it: the failure is
    # raised within seconds, not after the barrier's 120 s.
    waiting = job(tmp_path, f"{tmp_path / 'b'},3", "ok", "120")
    failing = job(tmp_path, f"{tmp_path / 'b'},3", "fail", "120")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed \(3\)"):
        common.run_json_together([waiting, failing, waiting], dict(os.environ))
    assert time.monotonic() - began < 30
