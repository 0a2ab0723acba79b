"""Horovod Elastic on one host as Horovod's own users run it (issue 37, items 9 and 10): Horovod's
TF2 elastic state (``hvd.elastic.TensorFlowKerasState``) with Keras 3 and with Keras 2, under
``horovodrun --host-discovery-script``; ``hvd.init()`` after ``hvd.shutdown()`` (what an elastic
reset does) with the cycle time and fusion threshold set; and ``hvdtrain launch --elastic`` on one
host without ``--network-interfaces``, which must start rather than wait without a word."""
import json
import os
import signal
import subprocess
import sys

import pytest

from jobs import BIN, job_env, run, script
from testhosts import SHARED_CORES_ENV


def discovery_script(tmp_path, text="localhost:2\n"):
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\nprintf '{text}'\n")
    path.chmod(0o755)
    return str(path)


def finished(argv: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``argv`` in a session of its own: ``(exit status, stdout and stderr)``. Still running
    after ``timeout`` seconds: its whole session is killed (its process group, by id) and the
    status is None."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


@pytest.mark.parametrize("keras", ["keras3", "keras2"])
def test_horovods_tf2_elastic_state_restores_the_committed_state(tmp_path, keras):
    # Before (scripts/horovod_patches/09-*): on Keras 3 every rank stopped in the state's
    # constructor, horovod/tensorflow/elastic.py _save_model: "TypeError: 'list' object is not
    # callable" (optimizer.variables() is a list there); on Keras 2 a state made before its
    # optimizer's first step restored none of the optimizer's slots (a zip over the shorter list).
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", discovery_script(tmp_path), "--network-interfaces", "lo",
            *script("tf_elastic_keras3.py"), str(out)]
    env = {**SHARED_CORES_ENV, **({"TF_USE_LEGACY_KERAS": "1"} if keras == "keras2" else {})}
    proc = run(argv, timeout=400, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    package = "keras." if keras == "keras3" else "tf_keras."
    for r in records:
        assert r["optimizer_module"].startswith(package), r
        assert r["size"] == 2 and r["entries"] == 2 and r["resets"] == 1, r
        # The failure came after uncommitted work that changed the weights, the momentum
        # buffers and the step count (by 2)...
        moved = r["uncommitted_vs_committed"]
        assert moved["model"] > 1e-3 and moved["slots"] > 1e-6 and moved["optimizer"] >= 2, r
        # ...and the reset put back every committed value, on each rank before the broadcast.
        assert r["restored_vs_committed"] == {"model": 0.0, "optimizer": 0.0, "slots": 0.0}, r
        assert r["committed_batch"] == 3 and r["batch_after_restore"] == 3, r
        assert r["final_batch"] == 5 and r["iterations"] == 1 + 3 + 2, r
        # A state made before the optimizer's first step saved its slots (the step count, in
        # Keras 3 the learning rate, and one momentum buffer per weight) and restores them too.
        assert r["unbuilt_optimizer_variables_saved"] == (6 if keras == "keras3" else 5), r
        moved = r["unbuilt_trained_vs_saved"]
        assert moved["model"] > 1e-3 and moved["slots"] > 1e-6, r
        assert r["unbuilt_restored_vs_saved"] == {"model": 0.0, "optimizer": 0.0, "slots": 0.0}, r
        assert r["unbuilt_epoch_after_restore"] == 0, r
        assert r["rank_spread"] == 0.0, r


def test_launch_elastic_on_this_host_starts_without_network_interfaces(tmp_path):
    # Before: the discovery script printing localhost:2 and no --network-interfaces, horovodrun
    # waited for a second host to compare network interfaces, without a word, for its 600 s
    # elastic timeout. Now hvdtrain launch passes the loopback interface.
    out = tmp_path / "out"
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nimport horovod.torch as hvd\nhvd.init()\n"
                      "open(f'{sys.argv[1]}/rank{hvd.rank()}', 'w').write(str(hvd.size()))\n")
    argv = [str(BIN / "hvdtrain"), "launch", "--elastic", "-np", "2", "--min-np", "1",
            "--max-np", "2", "--host-discovery-script", discovery_script(tmp_path), "--",
            sys.executable, str(worker), str(out)]
    code, output = finished(argv, {**job_env(), **SHARED_CORES_ENV}, 180)
    assert code is not None, \
        f"hvdtrain launch --elastic still running after 180 s:\n{output[-4000:]}"
    assert code == 0, output[-4000:]
    assert "--network-interfaces lo" in output  # the printed command line says what was added
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert {p.read_text() for p in out.iterdir()} == {"2"}


@pytest.fixture(scope="module")
def reinit(tmp_path_factory):
    """tests/parallel/torch_reinit.py under horovodrun --gloo, with the user's cycle time and
    fusion threshold: its exit status, its output and the folder of the ranks' records. A job
    still running after 180 s (a hung collective: Horovod's stall inspector says nothing under
    Gloo here) is ended, its whole session, and its status is None."""
    out = tmp_path_factory.mktemp("reinit")
    argv = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2",
            *script("torch_reinit.py"), str(out)]
    env = {**job_env(), **SHARED_CORES_ENV, "HOROVOD_CYCLE_TIME": "10",
           "HOROVOD_FUSION_THRESHOLD": "4194304"}
    code, output = finished(argv, env, 180)
    if code is None:
        output += "\n(ended after 180 s: a hung collective?)"
    return code, output[-12000:], out


def test_horovod_initialises_again_with_the_users_cycle_time_and_fusion_threshold(reinit):
    # Before (scripts/horovod_patches/14-*): with both variables set, the second hvd.init() wrote
    # its defaults past the end of the autotuner's emptied vector, and every rank died with a
    # segmentation fault (exit 139) in the new background thread; an elastic job died so at its
    # first reset (a worker lost or added). (With the cycle time alone it ran on, its fusion
    # threshold 1 MiB instead of 128 after the reset; Horovod has no call that reads it back.)
    code, output, out = reinit
    for rank in (0, 1):
        assert (out / f"rank{rank}.json").exists(), output
        inits = json.loads((out / f"rank{rank}.json").read_text())
        assert [(i["rank"], i["size"]) for i in inits] == [(rank, 2)] * 3, inits
        assert [i["average"] for i in inits] == [[0.5 + n] * 4 for n in range(3)], inits


def test_an_unnamed_allreduce_after_process_sets_that_left_ranks_out(reinit):
    """Rank 0 all-reduced twice on its own process set, rank 1 once; the all-reduce of both
    without a name then ends with the sum (before scripts/horovod_patches/16-*: it waited
    forever)."""
    code, output, out = reinit
    assert code == 0, output
    assert [json.loads((out / f"rank{r}.sets.json").read_text()) for r in (0, 1)] == [[1.0]] * 2
