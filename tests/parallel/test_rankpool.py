"""The rank pool itself (tests/parallel/rankpool.py), on a real `horovodrun -np 2` pool of its own:
a failing rank fails the test with both ranks' output, a hung collective ends the pool within
the request's timeout with a message naming the test, the next request starts a new pool, and a
request's environment and signal handlers do not leak into the next."""
import json
import signal

import pytest

from jobs import horovodrun, job_env
from rankpool import RankPool, RankPoolError

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
    with pytest.raises(RankPoolError) as err:
        pool.run(code, "hang", tmp_path / "out.json", timeout=8)
    message = str(err.value)
    assert "test_a_hung_collective_ends_the_pool_naming_the_test" in message
    assert "no end within 8 s" in message and "pool ended" in message
    assert not pool.alive
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
