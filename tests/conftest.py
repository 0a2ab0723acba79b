"""What the engine suites (tests/spark, tests/ray) share: the horovodrun run their MNIST jobs
must equal step by step, made once per `make test` (both of scripts/test.sh's sessions)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mnist_main_job import MNIST_TORCH_ARGS  # tests/mnist_main_job.py (tests/ is on sys.path)


# scripts/test.sh runs two pytest sessions at once and gives both this folder: what one of them
# made there (under a lock) the other reuses instead of making it again.
SHARED_ENV = "HVDTRAIN_TEST_SHARED"


@pytest.fixture(scope="session")
def horovodrun_mnist_torch(tmp_path_factory) -> SimpleNamespace:
    """``horovodrun -np 2 -H localhost:2 hvdtrain train`` with :data:`MNIST_TORCH_ARGS`, run
    the first time a test asks: ``.out`` its output directory (``metrics.json``,
    ``tensorboard/``), ``.args`` the ``hvdtrain train`` options to repeat through an engine.

    Made once per ``make test``: with ``HVDTRAIN_TEST_SHARED`` set (scripts/test.sh), in that
    folder under a file lock, so that the session of tests/ray and that of tests/spark share one
    run (the second waits for the first's lock, then reads its ``done.json``); without it, once
    per pytest session.

    Raises:
        pytest.fail.Exception: the run exited non-zero (its output is quoted), or another
            session held the lock for over 1,800 s.
    """
    shared = os.environ.get(SHARED_ENV)
    if not shared:
        return _horovodrun_mnist_torch(tmp_path_factory.mktemp("horovodrun-mnist-torch") / "run")
    from filelock import FileLock, Timeout
    root = Path(shared) / "horovodrun-mnist-torch"
    root.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(root / "lock"), timeout=1800):
            done = root / "done.json"
            if done.exists() and json.loads(done.read_text()) == list(MNIST_TORCH_ARGS):
                return SimpleNamespace(out=root / "run", args=list(MNIST_TORCH_ARGS))
            shutil.rmtree(root / "run", ignore_errors=True)  # a run that failed in the other
            made = _horovodrun_mnist_torch(root / "run")
            done.write_text(json.dumps(list(MNIST_TORCH_ARGS)))
            return made
    except Timeout:
        pytest.fail(f"the other pytest session held {root / 'lock'} for over 1,800 s")


def _horovodrun_mnist_torch(out: Path) -> SimpleNamespace:
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
