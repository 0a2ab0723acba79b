"""tests/spark: hvdtrain.spark on a real Spark standalone cluster (a master and two 1-core workers
on 127.0.0.1), started once for the session by the ``spark_cluster`` fixture and stopped by its
process ids at the end; the fixture then checks that no process of the cluster or of a rank is
left. Skipped, with the reason, where pyspark, Java or Horovod is missing (scripts/setup_engines.sh
installs the first two; `make setup` runs it)."""
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import StandaloneCluster  # noqa: E402

SPARK_GPUS = ["3", "5"]  # the address of the GPU each worker offers (worker index)

MISSING = [what for what, ok in (
    ("pyspark (bash scripts/setup_engines.sh)", importlib.util.find_spec("pyspark") is not None),
    ("java (a JRE; bash scripts/setup_engines.sh)", shutil.which("java") is not None),
    ("Horovod (make setup)", importlib.util.find_spec("horovod") is not None),
) if not ok]


def pytest_collection_modifyitems(config, items):
    if not MISSING:
        return
    skip = pytest.mark.skip(reason="needs " + ", ".join(MISSING))
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    # Each worker also offers one (pretend) GPU, at addresses 3 and 5, for the test of GPU
    # scheduling; applications that ask for no GPU are unaffected.
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"), workers=2,
                                gpus=SPARK_GPUS)
    below = []
    try:
        cluster.start()
        yield cluster
    finally:
        below = cluster.descendants()
        cluster.stop()
    left = [f"{p.pid} {' '.join(p.cmdline())[:200]}" for p in below if _alive(p)]
    assert not left, f"processes left after the cluster stopped: {left}"


def _alive(proc) -> bool:
    import psutil
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
