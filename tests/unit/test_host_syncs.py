"""hvdtrain adds no host synchronisation to a Keras step on the PyTorch backend beyond the one
read of the non-finite guard's decision: counted on the CPU by tests/unit/keras_step_syncs.py,
op by op, as the ops that synchronise the host with a GPU (a tensor made from a Python number,
a number read from a tensor). Before, ``distribute`` added 6 such copies a step (the
learning-rate schedule's constants), ``hvdtrain train``'s step 8 copies and 4 reads, its loss
5 copies a micro-batch, and the loss-scale hooks 5 copies and 3 reads (``one_hot(rank)``'s two,
a second read of the overflow check)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("keras_step_syncs.py")


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    pytest.importorskip("keras")
    pytest.importorskip("horovod.torch")
    out = tmp_path_factory.mktemp("syncs") / "counts.json"
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(PROBE), str(out)], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_distribute_adds_no_host_synchronisation_to_the_step(counts):
    # warmup and a cosine decay, on the schedule's GPU path (its tensor rule)
    assert counts["distribute"] == counts["plain"]


def test_the_loss_scale_hooks_add_no_host_synchronisation(counts):
    # the overflow check read once, where Keras's LossScaleOptimizer reads it anyway
    assert counts["distribute, loss scale"] == counts["plain, loss scale"]


def test_the_trainers_step_adds_only_the_guards_one_read(counts):
    plain, train = counts["plain"], counts["train"]
    assert train["lift_fresh"] == plain["lift_fresh"]
    assert train["_local_scalar_dense"] == plain["_local_scalar_dense"] + 1


def test_the_trainers_loss_makes_no_tensor_from_a_number(counts):
    assert counts["train loss"] == counts["keras loss"]
