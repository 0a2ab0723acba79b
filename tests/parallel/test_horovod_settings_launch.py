"""Under a plain `horovodrun -np 2` (no tuning flags), every rank's init() chooses Horovod's runtime
settings itself before hvd.init(), a variable the user set wins, and metrics.json says which
applied and who chose them; both adapters (hvdtrain.launch.tuning.rank_settings)."""
import json
import sys

import pytest

from jobs import horovodrun, job_env

CYCLE, YIELD = "HOROVOD_CYCLE_TIME", "OMPI_MCA_mpi_yield_when_idle"
WAKE = "HOROVOD_CYCLE_WAKE"


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_plain_horovodrun_gets_the_cpu_rule_and_the_users_variable_wins(tmp_path, framework):
    import subprocess
    env = job_env()
    env.pop(YIELD, None)  # a user's shell: nothing set but their own fusion threshold
    env.pop(CYCLE, None)
    env.pop(WAKE, None)
    env["HOROVOD_FUSION_THRESHOLD"] = str(32 * 2**20)
    proc = subprocess.run(horovodrun(2, "hvdtrain", "train", "--framework", framework, "--epochs",
                                     "1", "--no-progress", "--device", "cpu", "--output-dir",
                                     str(tmp_path)),
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    settings = json.loads((tmp_path / "metrics.json").read_text())["horovod_settings"]
    # This Horovod wakes its thread when work is enqueued (patch 08): the cycle stays Horovod's.
    assert settings[WAKE] == {"value": "1", "by": "hvdtrain", "why": settings[WAKE]["why"]}
    assert settings[CYCLE]["value"] == "1" and settings[CYCLE]["by"] == "default"
    assert settings[YIELD]["value"] == "1" and settings[YIELD]["by"] == "hvdtrain"
    assert settings["HOROVOD_FUSION_THRESHOLD"] == {"value": str(32 * 2**20), "by": "user",
                                                    "why": "set in the environment"}


def _job(tmp_path, source: str, cycle_ms: str = "3000") -> dict:
    """Run the job ``source`` under horovodrun -np 2 with HOROVOD_CYCLE_TIME=``cycle_ms`` and
    the wake on; return the JSON its rank 0 wrote."""
    import subprocess
    job, out = tmp_path / "job.py", tmp_path / "out.json"
    job.write_text(source)
    env = {**job_env(), CYCLE: cycle_ms, WAKE: "1"}
    proc = subprocess.run(horovodrun(2, sys.executable, str(job), str(out)), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


WAKE_JOB = """
import json, sys, time
import torch
import horovod.torch as hvd
hvd.init()
x = torch.ones(4)
hvd.allreduce(x, name="grad")  # the first time a name is negotiated in full; then cached
start = time.perf_counter()
for i in range(10):  # the same name every time, as a training step's gradients
    hvd.allreduce(x, name="grad")
elapsed = time.perf_counter() - start
if hvd.rank() == 0:
    json.dump({"elapsed": elapsed}, open(sys.argv[1], "w"))
"""


def test_woken_thread_answers_without_waiting_for_the_cycle(tmp_path):
    # Horovod patch 08 (scripts/horovod_patches/08-cycle-wake.patch): with HOROVOD_CYCLE_WAKE=1 a
    # request (of a name negotiated before, as every step's gradients are) ends the background
    # thread's sleep, so 10 all-reduces in a row under a 3 s cycle take far less than one
    # cycle. Without the wake each would wait out up to a cycle (about 30 s for the 10, measured
    # 10.0 s for 10 at a 1 s cycle), so this fails, and does not race the machine's speed.
    assert _job(tmp_path, WAKE_JOB)["elapsed"] < 3.0


PUT_BACK_JOB = """
import json, sys, time
import torch
import horovod.torch as hvd
hvd.init()
x = torch.ones(4)
for name in ("a", "b"):  # negotiated once in full, in the same order: cached from here on
    hvd.allreduce(x, name=name)
start = time.perf_counter()
if hvd.rank() == 0:
    handles = [hvd.allreduce_async(x, name="a"), hvd.allreduce_async(x, name="b")]
else:  # b first; a 0.2 s later, so rank 0 holds a while b is done
    handles = [hvd.allreduce_async(x, name="b")]
    time.sleep(0.2)
    handles.append(hvd.allreduce_async(x, name="a"))
for h in handles:
    hvd.synchronize(h)
elapsed = time.perf_counter() - start
if hvd.rank() == 0:
    json.dump({"elapsed": elapsed}, open(sys.argv[1], "w"))
"""


def test_work_put_back_for_a_late_rank_is_negotiated_again_at_once(tmp_path):
    # Rank 0 asks for a and b; rank 1 for b, then a 0.2 s later. The negotiation that does b
    # puts rank 0's a back; patch 08 negotiates again at once (waiting inside the collective for
    # rank 1's a) instead of sleeping out rank 0's 3 s cycle: about 0.2 s, not 3 s.
    assert 0.1 < _job(tmp_path, PUT_BACK_JOB)["elapsed"] < 3.0


IDLE_JOB = """
import json, sys, time
import torch
import horovod.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(4), name="warm")
cpu, wall = time.process_time(), time.perf_counter()
time.sleep(2)  # idle: only Horovod's background thread runs
share = (time.process_time() - cpu) / (time.perf_counter() - wall)
shares = hvd.allgather_object(share)
if hvd.rank() == 0:
    json.dump({"cpu_share": shares}, open(sys.argv[1], "w"))
"""


def test_idle_ranks_do_not_poll_a_core(tmp_path):
    # Upstream times a cycle from its start, so the rank that waited in a negotiation for its
    # peer starts the next at once and waits again, every cycle: idle, one of two ranks used
    # 0.999 of a CPU (0.033 the other) at Horovod's 1 ms cycle. Patch 08 (revision >= 3) sleeps a
    # whole cycle after each negotiation: both ranks idle. A share of CPU time, not a speed.
    shares = _job(tmp_path, IDLE_JOB, cycle_ms="1")["cpu_share"]
    assert len(shares) == 2 and max(shares) < 0.3, shares
