"""tests/slurm: hvdtrain under a real one-node Slurm cluster on this machine.

The session fixture ``slurm_cluster`` runs ``scripts/slurm_cluster.sh install`` (apt-get installs
Debian's slurmctld, slurmd, slurm-client and munge when they are missing), then ``start`` in a
temporary directory, and ``stop`` at the end of the session. It yields the environment to run
Slurm's clients with: this process's environment (less any SLURM_* variables of an enclosing
job) plus SLURM_CONF and a PATH that starts with this interpreter's bin directory, so that
``srun ... python`` runs the venv's Python.

The tests are skipped, with the script's reason, only where Slurm cannot be installed (the script
exits 3: not root, no apt-get, apt-get failed); any other failure to start the cluster is an error.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
BIN = Path(sys.executable).parent
CANNOT_INSTALL = 3  # the script's exit status when Slurm is missing and cannot be installed
INSTALL_TIMEOUT = 900  # seconds: apt-get update + install on a slow mirror
START_TIMEOUT = 180  # the script itself gives up after 60 s (SLURM_CLUSTER_TIMEOUT)
STOP_TIMEOUT = 120


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def _failure(what: str, proc: subprocess.CompletedProcess) -> str:
    return (f"scripts/slurm_cluster.sh {what} exited {proc.returncode}\n"
            f"--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The environment (a dict) for Slurm's clients (srun, sbatch, squeue, scancel, scontrol)
    against a running one-node cluster; its directory (slurm.conf, logs) is SLURM_CONF's."""
    proc = _script("install", timeout=INSTALL_TIMEOUT)
    if proc.returncode == CANNOT_INSTALL:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        pytest.skip(lines[-1] if lines else "scripts/slurm_cluster.sh install: cannot install Slurm")
    if proc.returncode != 0:
        pytest.fail(_failure("install", proc), pytrace=False)

    cluster_dir = tmp_path_factory.mktemp("slurm")
    try:
        proc = _script("start", str(cluster_dir), timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        _script("stop", str(cluster_dir), timeout=STOP_TIMEOUT)
        raise
    if proc.returncode != 0:
        _script("stop", str(cluster_dir), timeout=STOP_TIMEOUT)
        pytest.fail(_failure(f"start {cluster_dir}", proc), pytrace=False)
    exports = [line for line in proc.stdout.splitlines() if line.startswith("export SLURM_CONF=")]
    assert exports, _failure(f"start {cluster_dir} printed no export line", proc)
    conf = exports[-1].split("=", 1)[1]
    assert Path(conf).is_file(), f"{conf} (from `start {cluster_dir}`) does not exist"

    # An enclosing Slurm job's variables (SLURM_JOB_ID, ...) would point srun at that job.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = conf
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    try:
        yield env
    finally:
        proc = _script("stop", str(cluster_dir), timeout=STOP_TIMEOUT)
        if proc.returncode != 0:
            pytest.fail(_failure(f"stop {cluster_dir}", proc), pytrace=False)
