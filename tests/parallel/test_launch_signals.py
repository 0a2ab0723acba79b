"""Signals to `hvdtrain launch` under real launchers (horovodrun over MPI, horovodrun --gloo,
mpirun), with no hostfile (the launch runs on this host, as `horovodrun -np 2` does):

- Ctrl-C stops every rank within seconds, whatever the launcher (before: with horovodrun over
  MPI the SIGINT reached `/bin/sh -c mpirun ...` only, and the ranks ran on to their end);
- a rank is what its own launcher marked: an inherited `SLURM_PROCID` (an sbatch shell's) or an
  inherited `HVDTRAIN_LAUNCH_ID` (another launch's) makes no other process a rank;
- a signal while the ranks are still importing their framework ends in a stop checkpoint and
  exit 75, on both frameworks (before: the default action killed the ranks);
- `--yield-when-idle off` reaches the ranks and the record says who chose it.

What the ranks saw comes from files they write, never from forwarded output.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import BIN, job_env

EXIT_PREEMPTED = 75
LAUNCHERS = {"horovodrun": [], "horovodrun-gloo": ["--gloo"], "mpirun": ["--launcher", "mpirun"]}

# A rank that records its pid and environment, then sleeps; on SIGTERM it writes 'term' and
# exits 75 (as hvdtrain train does after its checkpoint).
RANK = """\
import json, os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "x"))
def term(*_):
    (out / f"term-{rank}").write_text("term")
    sys.exit(75)
if "--trap" in sys.argv:
    signal.signal(signal.SIGTERM, term)
(out / f"env-{rank}.json").write_text(json.dumps(dict(os.environ)))
from hvdtrain.files import atomic_open
with atomic_open(out / f"pid-{rank}", "w") as f:  # written whole: read as soon as it exists
    f.write(str(os.getpid()))
time.sleep(float(sys.argv[2]))
(out / f"slept-{rank}").write_text("slept")
"""


def launch(tmp_path, *launch_args, rank_args=("45",), env=None):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    argv = [str(BIN / "hvdtrain"), "launch", "-np", "2", *launch_args, "--", sys.executable,
            str(script), str(tmp_path), *rank_args]
    return subprocess.Popen(argv, env={**job_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(paths, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            pytest.fail(f"the launch ended first (exit {proc.returncode}):\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"no {paths} within {timeout} s"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_ctrl_c_stops_every_rank_within_seconds_whatever_the_launcher(tmp_path, launcher):
    proc = launch(tmp_path, *LAUNCHERS[launcher])
    try:
        wait_for([tmp_path / "pid-0", tmp_path / "pid-1"], proc)
        pids = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
        time.sleep(1)
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's foreground process group
        output, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{launcher}: the launch exited {proc.returncode} {seconds:.1f} s after SIGINT")
    deadline = time.monotonic() + 30  # an event with a deadline for a loaded machine
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), f"ranks left running after Ctrl-C:\n{output}"
    assert seconds < 15, output
    assert proc.returncode != 0
    assert not any((tmp_path / f"slept-{r}").exists() for r in (0, 1))


def test_inherited_slurm_procid_and_launch_id_mark_no_rank(tmp_path):
    # A process of "another job": the launch id the new launch inherits, and a rank variable.
    decoy_dir = tmp_path / "decoy"
    decoy_dir.mkdir()
    (tmp_path / "rank.py").write_text(RANK)
    decoy = subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), str(decoy_dir), "60",
                              "--trap"],
                             env={**job_env(), "HVDTRAIN_LAUNCH_ID": "f" * 32,
                                  "HOROVOD_RANK": "0"})
    inherited = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "", "HVDTRAIN_LAUNCH_ID": "f" * 32}
    inherited.pop("SLURM_JOB_ID")  # not inside an allocation: only the inherited rank variable
    proc = launch(tmp_path, "--gloo", rank_args=("60", "--trap"), env=inherited)
    try:
        wait_for([tmp_path / "pid-0", tmp_path / "pid-1", decoy_dir / "pid-0"], proc)
        proc.send_signal(signal.SIGTERM)  # as scancel or a pod's stop does
        output, _ = proc.communicate(timeout=60)
    finally:
        for p in (proc, decoy):
            if p.poll() is None:
                p.kill()
    assert "handed to 2 rank(s) on this host" in output, output
    assert (tmp_path / "term-0").exists() and (tmp_path / "term-1").exists()
    assert not (decoy_dir / "term-0").exists(), "another launch's rank got our SIGTERM"
    seen = json.loads((tmp_path / "env-0.json").read_text())
    assert seen["HVDTRAIN_LAUNCH_ID"] != "f" * 32 and len(seen["HVDTRAIN_LAUNCH_ID"]) == 32
    # horovodrun --gloo reports the ranks' own status (before: -15, its supervisors killed)
    # (Horovod's "status code -15" and "Exit code: -15"; the output also holds tmp_path, where
    # pytest's numbered folder "pytest-15N" held a "-15" of its own.)
    assert "exit with status code 75" in output, output
    assert not re.search(r"code:? -15\b", output), output


def ranks_started(marker: str) -> list[int]:
    """Rank processes (not their shells or launchers) whose command line holds ``marker``."""
    from hvdtrain.launch.signals import NOT_RANKS
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = b"\0" + (d / "environ").read_bytes()
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if marker.encode() in cmd and comm not in NOT_RANKS and (
                b"\0HOROVOD_RANK=" in env or b"\0OMPI_COMM_WORLD_RANK=" in env):
            found.append(int(d.name))
    return found


@pytest.mark.parametrize("framework,sig", [("torch", signal.SIGUSR1), ("keras", signal.SIGTERM)])
def test_signal_while_the_ranks_import_ends_in_a_stop_checkpoint(tmp_path, framework, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [str(BIN / "hvdtrain"), "launch", "-np", "2", "--", str(BIN / "hvdtrain"), "train",
         "--framework", framework, "--dataset", "digits", "--epochs", "1", "--no-progress",
         "--output-dir", str(out)],
        env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(ranks_started(str(out))) < 2:  # the rank processes exist: Python starts
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.01)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    stopped = json.loads((out / "metrics.json").read_text())["preempted"]
    print(f"{framework} {signal.Signals(sig).name} during import: {stopped}")
    assert stopped["signal"] == signal.Signals(sig).name and stopped["epoch"] == 1
    assert stopped["step"] >= 1  # stopped at the first optimizer step, checkpointed
    assert any(out.glob("checkpoint*")), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_yield_when_idle_off_reaches_the_ranks_and_the_record_says_who(tmp_path, launcher):
    out = tmp_path / "run"
    extra = ["--launcher", "mpirun"] if launcher == "mpirun" else []
    env = {**job_env(), "OMPI_MCA_mpi_yield_when_idle": "1"}  # as `make` exports it
    # A few steps of synthetic data: busy-polling ranks on shared cores make every step slow
    # (one epoch of digits took 60 s in a busy clean-clone run), and the setting is what counts.
    done = subprocess.run(
        [str(BIN / "hvdtrain"), "launch", "-np", "2", *extra, "--yield-when-idle", "off", "--",
         str(BIN / "hvdtrain"), "train", "--framework", "torch", "--dataset", "synthetic",
         "--synthetic-samples", "160", "--epochs", "1", "--no-progress", "--output-dir",
         str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "busy-poll" in done.stderr
    record = json.loads((out / "metrics.json").read_text())
    found = [v for k, v in _walk(record) if k == "OMPI_MCA_mpi_yield_when_idle"]
    assert found, "no OMPI_MCA_mpi_yield_when_idle in metrics.json"
    setting = found[0]
    assert setting["value"] == "0" and setting["by"] == "hvdtrain launch", setting
    assert "--yield-when-idle off" in setting["why"]


def _walk(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)
