"""What the engine suites (tests/spark, tests/ray) share: the horovodrun run their MNIST jobs
must equal step by step, made once per session."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mnist_main_job import MNIST_TORCH_ARGS  # tests/mnist_main_job.py (tests/ is on sys.path)


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


# Keras reads keras.json (backend, float type, image layout) from KERAS_HOME, else ~/.keras: this
# session and every process it starts get their own, set here (when pytest loads this file,
# before any test module imports keras) so a user's settings never reach a test; removed at exit.
# A pytest run inside a rank of such a session keeps the session's. tests/spark and tests/ray
# give their clusters' processes their own as well.
def _own_keras_home() -> str:
    import atexit
    import shutil
    import tempfile
    path = tempfile.mkdtemp(prefix="hvdtrain-keras-home-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


if not os.path.basename(os.environ.get("KERAS_HOME", "")).startswith("hvdtrain-keras-home-"):
    os.environ["KERAS_HOME"] = _own_keras_home()
