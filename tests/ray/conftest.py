"""tests/ray: hvdtrain.ray on a real local Ray cluster (a head and one worker node, 1 CPU each,
on 127.0.0.1), started once per module by the ``ray_cluster`` fixture and stopped by its process
groups at the end; the fixture then checks that no process of the cluster or of a rank is left.
Skipped, with the reason, where ray[train] or Horovod is missing (``HVDTRAIN_ENGINES=ray bash
scripts/setup_engines.sh`` installs ray; `make setup` runs it)."""
import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from raycluster import LocalRayCluster  # noqa: E402


def _missing() -> list[str]:
    found = []
    try:
        import ray.train  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as exc:
        found.append(f"ray[train] ({exc}; HVDTRAIN_ENGINES=ray bash scripts/setup_engines.sh)")
    if importlib.util.find_spec("horovod") is None:
        found.append("Horovod (make setup)")
    return found


MISSING = _missing()


def pytest_collection_modifyitems(config, items):
    if not MISSING:
        return
    skip = pytest.mark.skip(reason="needs " + ", ".join(MISSING))
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    cluster = LocalRayCluster(tmp_path_factory.mktemp("ray-cluster"), workers=1)
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
    import time
    deadline = time.monotonic() + 10  # killed daemons are reaped by init, not at once
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.2)
    return True
