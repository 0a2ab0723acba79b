"""The one-node Slurm cluster of conftest.py works: `srun --mpi=pmix` starts two tasks."""
from __future__ import annotations

import subprocess

TIMEOUT = 120  # seconds, for every command

# Each task writes out/<SLURM_PROCID>: the result comes from the files, not from srun's stdout.
WRITE_RANK = ("import os, pathlib; r = os.environ['SLURM_PROCID']; "
              "pathlib.Path('out', r).write_text(os.environ['SLURM_NTASKS'] + '\\n')")


def test_srun_pmix_starts_two_tasks(slurm_cluster, tmp_path):
    mpi = subprocess.run(["srun", "--mpi=list"], env=slurm_cluster, capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert mpi.returncode == 0, mpi.stderr
    assert "pmix" in (mpi.stdout + mpi.stderr).split(), mpi.stdout + mpi.stderr

    (tmp_path / "out").mkdir()
    proc = subprocess.run(["srun", "--mpi=pmix", "-n", "2", "-O", "python", "-c", WRITE_RANK],
                          cwd=tmp_path, env=slurm_cluster, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"srun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["0", "1"], written
    assert [(tmp_path / "out" / r).read_text() for r in written] == ["2\n", "2\n"]
