"""The rank pool itself (tests/parallel/rankpool.py), on a real `horovodrun -np 2` pool of its own:
a failing rank fails the test with both ranks' output, a hung collective ends the pool within
the request's timeout with a message naming the test, the next request starts a new pool, and a
request's environment and signal handlers do not leak into the next."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jobs import horovodrun, job_env
from rankpool import RankPool, RankPoolError

from hvdtrain.launch.procfs import session_members

RANK_CODE = """
import json, os, signal, sys
import torch
import horovod.torch as hvd
hvd.init()
what, out = sys.argv[1], sys.argv[2]
if what == "fail" and hvd.rank() == 1:
    raise RuntimeError("rank one fails here")
if what == "hang" and hvd.rank() == 0:  # rank 1 never joins: a hung collective
    hvd.allreduce(torch.ones(1), name="only.rank0")
if what == "cross":  # each rank waits for a collective the other never starts
    open(f"{out}.waiting{hvd.rank()}", "w").close()
    hvd.allreduce(torch.ones(1), name=f"only.rank{hvd.rank()}")
if what == "leak":
    os.environ["LEAKED_BY_A_TEST"] = "1"
    signal.signal(signal.SIGUSR2, lambda *a: None)
print(f"rank {hvd.rank()} says {what}", flush=True)
if hvd.rank() == 0:
    json.dump({"leaked": os.environ.get("LEAKED_BY_A_TEST"),
               "usr2": str(signal.getsignal(signal.SIGUSR2)),
               "size": hvd.size()}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-pool")
    pool = RankPool(root, horovodrun(2), {**job_env(), "HVDTRAIN_OWN_POOL": "1"}, name="own")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    path = tmp_path_factory.mktemp("code") / "rank_code.py"
    path.write_text(RANK_CODE)
    return path


def test_a_failing_rank_fails_the_test_with_both_ranks_output(pool, code, tmp_path):
    with pytest.raises(RankPoolError) as err:
        pool.run(code, "fail", tmp_path / "out.json")
    message = str(err.value)
    assert "test_a_failing_rank_fails_the_test_with_both_ranks_output" in message
    assert "RuntimeError: rank one fails here" in message
    assert "--- rank 0" in message and "--- rank 1 (exit 1)" in message


def test_a_hung_collective_ends_the_pool_naming_the_test(pool, code, tmp_path):
    pool.run(code, "ok", tmp_path / "out.json")
    session = pool.proc.pid  # the launcher's session: it, mpirun and the ranks
    assert len(session_members(session)) >= 4
    with pytest.raises(RankPoolError) as err:
        pool.run(code, "hang", tmp_path / "out.json", timeout=8)
    message = str(err.value)
    assert "test_a_hung_collective_ends_the_pool_naming_the_test" in message
    assert "no end within 8 s" in message and "pool ended" in message
    assert not pool.alive and session_members(session) == []
    # The next request starts a new pool and runs.
    starts = pool.starts
    done = pool.run(code, "ok", tmp_path / "out.json")
    assert pool.starts == starts + 1 and done.codes == {0: 0, 1: 0}
    assert "rank 0 says ok" in done.rank(0) and "rank 1 says ok" in done.rank(1)


def test_a_requests_environment_and_signals_do_not_leak(pool, code, tmp_path):
    pool.run(code, "leak", tmp_path / "leak.json", env={"GIVEN_FOR_ONE_REQUEST": "1"})
    assert json.loads((tmp_path / "leak.json").read_text())["leaked"] == "1"
    pool.run(code, "after", tmp_path / "after.json")
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["leaked"] is None and after["size"] == 2
    assert after["usr2"] == str(signal.SIG_DFL)


# A test process that owns a pool and is killed while each rank waits in a collective the other
# never starts (as a mismatched allgather does): what a pytest killed in a hung test leaves.
# Neither rank gets back to its loop, where it would see the test process gone.
OWNER = """
import sys
from jobs import horovodrun, job_env
from rankpool import RankPool
folder, code, out = sys.argv[1:]
RankPool(folder, horovodrun(2), job_env(), name="owned").run(code, "cross", out, timeout=600)
"""


def test_a_pool_ends_when_its_test_process_is_killed_in_a_hung_collective(code, tmp_path):
    folder, here = tmp_path / "owned", Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(here), os.environ.get("PYTHONPATH")]))}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(folder), str(code),
                              str(tmp_path / "out.json")], env=env, stdin=subprocess.DEVNULL)
    session = None  # the pool's, once found; None again once seen empty
    try:
        waiting = [tmp_path / f"out.json.waiting{r}" for r in (0, 1)]
        deadline = time.monotonic() + 300
        while not all(p.exists() for p in waiting):
            assert owner.poll() is None, f"the owner ended first (exit {owner.returncode})"
            assert time.monotonic() < deadline, "the ranks did not reach the collective in 300 s"
            time.sleep(0.1)
        rank = next(p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
                    if str(folder / "start1") in " ".join(p.info["cmdline"] or ()))
        session = os.getsid(rank)  # the launcher's, which mpirun and the ranks keep
        assert len(session_members(session)) >= 4  # launcher, mpirun, 2 ranks
        assert not list((folder / "start1").glob("000001.rank*.json"))  # both still in it
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 120
        while (left := session_members(session)):
            assert time.monotonic() < deadline, f"still running 120 s after: {left}"
            time.sleep(0.2)
        session = None
    finally:  # a failure here leaves nothing running either
        owner.kill()
        owner.wait()
        for pid in session_members(session) if session else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
