"""What the engine suites (tests/spark, tests/ray) share: the horovodrun run their MNIST jobs
must equal step by step, made once per session."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# The main job (--dataset mnist and its recipe) on PyTorch, every step's loss on TensorBoard.
MNIST_TORCH_ARGS = ("--framework", "torch", "--dataset", "mnist", "--log-every", "1")


@pytest.fixture(scope="session")
def horovodrun_mnist_torch(tmp_path_factory) -> SimpleNamespace:
    """``horovodrun -np 2 -H localhost:2 hvdtrain train`` with :data:`MNIST_TORCH_ARGS`, run
    the first time a test asks: ``.out`` its output directory (``metrics.json``,
    ``tensorboard/``), ``.args`` the ``hvdtrain train`` options to repeat through an engine.

    Raises:
        pytest.fail.Exception: the run exited non-zero (its output is quoted).
    """
    out = tmp_path_factory.mktemp("horovodrun-mnist-torch") / "run"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMPI_MCA_mpi_yield_when_idle": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    argv = [str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", "hvdtrain", "train",
            "--output-dir", str(out), "--no-progress", *MNIST_TORCH_ARGS]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n"
                    f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return SimpleNamespace(out=out, args=list(MNIST_TORCH_ARGS))
