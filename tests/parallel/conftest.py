"""The rank pools tests/parallel shares (tests/parallel/rankpool.py): a live 2-rank job per
environment (the PyTorch pool, a Keras pool per backend), started by the first test that asks
for it and kept until the last test that uses a pool: the modules with such tests run first
(`pytest_collection_modifyitems`). An idle pool's rank costs about 0.05 of a core.
A pool with Horovod's dynamic timeline ends with the test that asked for it: its rank 0's
timeline writer spins on sched_yield (Horovod's TimelineWriter::WriterLoop), seen taking 0.66
of a core, mostly system time, through the launched jobs of the tests after it (#47).

    def test_x(ranks):            # the PyTorch pool
        ranks.run(script("torch_broadcast.py"), "--out", out)

    def test_y(keras_ranks):      # the pool of the test's `backend` (a fixture or a parameter)
        keras_ranks.run(script("keras_broadcast.py"), "--out", out)

    train(ranks, out, "--epochs", "2")   # `hvdtrain train` inside the pool's ranks
"""
from __future__ import annotations

from pathlib import Path

import pytest

from hvdtrain import runtime
from jobs import horovodrun, job_env, keras_env, train_in
from rankpool import TIMELINE_ENV, RankPool

SIZE = 2
HERE = Path(__file__).resolve().parent
_SESSION_POOLS: list["Pools"] = []  # the session's Pools, for pytest_runtest_teardown


class Pools:
    """The live :class:`RankPool` of each environment its ranks start with.

    Args:
        root: the pools' folders go under it.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.live: dict[tuple, RankPool] = {}
        self.made = 0

    def get(self, env: dict | None = None) -> RankPool:
        """The pool whose ranks start with ``env`` on top of :func:`jobs.job_env` (Keras reads
        its backend once, at import; Horovod its settings once, at ``hvd.init()``)."""
        key = tuple(sorted((env or {}).items()))
        self.close_timeline(but=key)
        if key not in self.live:
            self.made += 1
            name = "pool " + (" ".join(f"{k}={v}" for k, v in key) or "(no variables)")
            self.live[key] = RankPool(self.root / f"pool{self.made}", horovodrun(SIZE),
                                      {**job_env(), **dict(key)}, name=name)
        return self.live[key]

    def keras(self, backend: str, **env) -> RankPool:
        """The pool whose Keras runs on ``backend``. On TensorFlow its ranks start with the
        intra- and inter-op threads ``hvdtrain.keras.init`` gives a launched rank: TensorFlow
        takes them once, when its runtime starts, and a script that starts it first without
        ``init`` (Horovod's own API) would leave every later run in the pool on other thread
        counts, whose sums round differently (seen: 0.099 apart after 2 epochs)."""
        if backend == "tensorflow":
            threads = str(runtime.thread_budget(SIZE))
            env = {"TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": threads, **env}
        return self.get({**keras_env(backend), **env})

    def close_timeline(self, but: tuple = ()) -> None:
        """End every live pool whose ranks run Horovod's dynamic timeline (except ``but``)."""
        for key in [k for k in self.live if k != but and dict(k).keys() & TIMELINE_ENV.keys()]:
            self.live.pop(key).close()

    def close(self) -> None:
        """End every live pool: all are asked to stop first, then waited for, so that their
        shutdowns (Horovod's, then the interpreter's: about 4 s a pool on a busy machine) run
        at the same time, not one after another (#47)."""
        for pool in self.live.values():
            pool.stop()
        while self.live:
            self.live.popitem()[1].close()


@pytest.fixture(scope="session")
def pools(tmp_path_factory) -> Pools:
    pools = Pools(tmp_path_factory.mktemp("rankpools"))
    _SESSION_POOLS.append(pools)
    yield pools
    pools.close()
    _SESSION_POOLS.remove(pools)


# The fixtures that hand a test a pool: a test needs the pools when one of them is among the
# fixtures it asks for, directly or through other fixtures (pytest's closure, item.fixturenames).
POOL_FIXTURES = frozenset({"pools", "ranks", "keras_ranks", "train_here"})
_LAST_POOL_TEST: list[str] = []  # node id of the last test of the session that needs the pools


def _needs_pools(item) -> bool:
    return not POOL_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def _in_this_folder(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The modules of tests/parallel whose tests use the rank pools run first, the modules that
    only launch jobs of their own after them (each module stays whole, in its order, so its
    module-scoped jobs are made once), and the pools end after the last test that uses them: an
    idle pool's ranks negotiate every cycle (the 3 pools, 6 ranks, took 0.32 of a core while both
    cores were kept busy), which the launch-only modules (about 10 minutes: elastic, signals,
    preflight...) paid for in full (#47)."""
    ours = [i for i, item in enumerate(items) if _in_this_folder(item)]
    if not ours:
        return
    block = items[ours[0]:ours[-1] + 1]
    if len(block) != len(ours):  # tests of this folder not in one run: leave the order alone
        return
    modules: dict[Path, list] = {}
    for item in block:
        modules.setdefault(Path(str(item.path)), []).append(item)
    needs = {item.nodeid for item in block if _needs_pools(item)}
    uses = {path: any(i.nodeid in needs for i in its) for path, its in modules.items()}
    ordered = [i for path, its in modules.items() if uses[path] for i in its]
    ordered += [i for path, its in modules.items() if not uses[path] for i in its]
    items[ours[0]:ours[-1] + 1] = ordered
    _LAST_POOL_TEST[:] = [i.nodeid for i in ordered if i.nodeid in needs][-1:]


def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses the pools, and after the last test of tests/parallel, end
    the pools: the tests that follow (launches of their own, then tests/spark in the same
    session, scripts/test.sh) would otherwise share the cores with their idle ranks. A later
    test that asks for a pool starts it again."""
    if (item.nodeid in _LAST_POOL_TEST or nextitem is None or not _in_this_folder(nextitem)):
        for pools in _SESSION_POOLS:
            pools.close()


@pytest.fixture(autouse=True)
def _end_timeline_pools():
    """After each test of tests/parallel: no timeline pool outlives its test. (It asks for no
    pool itself, so that only the tests that use one count as needing the pools.)"""
    yield
    for pools in _SESSION_POOLS:
        pools.close_timeline()


@pytest.fixture
def ranks(pools) -> RankPool:
    """The 2-rank pool for PyTorch code (and ``hvdtrain train --framework torch``)."""
    return pools.get()


@pytest.fixture
def keras_ranks(pools, backend) -> RankPool:
    """The 2-rank pool whose Keras runs on ``backend`` (the test's ``backend``)."""
    return pools.keras(backend)


@pytest.fixture
def train_here(pools):
    """``train_here(out, *args, framework="torch", backend="tensorflow", check=True)``:
    ``hvdtrain train --no-progress`` with ``args`` inside the ranks of the pool for the framework
    (:func:`jobs.train_in`); its :class:`rankpool.Done` (``.returncode``, ``.text``)."""
    return lambda out, *args, **kw: train_in(pools, out, "--no-progress", *args, **kw)
