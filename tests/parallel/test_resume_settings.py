"""What a `--resume` does with the options given at the resume, both trainers, on 2 real
ranks: `hvdtrain train` inside the session's rank pools, the elastic run under a real `hvdtrain
launch --elastic` (issue #37, items 6 and 7). Every number comes from the files the jobs
write (checkpoints, metrics.json), never from their output.

- Optimizer settings are this run's, the state the checkpoint's: `--momentum` and `--lr` at a
  resume are used (before, PyTorch's restored param groups kept the checkpoint's momentum while
  the record said the new one; Keras refused a change of momentum to or from 0).
- A new `--init-loss-scale` at an fp16 resume starts the loss scale there on both trainers
  (before, both went on with the checkpoint's scale).
- `-k 1` -> `-k 2` at a resume works on both trainers (before, Keras refused it).
- A failed elastic run's checkpoint continues at a fixed size (before, every rank crashed on the
  elastic epochs' extra `samples`/`sizes`).
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs import BIN, run

FRAMEWORKS = pytest.mark.parametrize("framework", ["torch", "keras"])
COMMON = ["--dataset", "digits", "--warmup-epochs", "0", "--no-progress"]


def train(train_here, out, *args, framework):
    return train_here(out, *COMMON, *args, framework=framework)


def metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())


def torch_checkpoint(out, name="checkpoint.pt"):
    return torch.load(Path(out) / name, weights_only=True)


def keras_checkpoint(out, name="checkpoint.npz"):
    """``(record, {optimizer key: array})`` of a Keras checkpoint, read without pickle. A
    checkpoint from before ``optimizer_keys`` were saved gets position keys (``#3``), and under
    fp16 the loss-scale optimizer's own variables, which Keras lists first, their names."""
    with np.load(Path(out) / name, allow_pickle=False) as archive:
        record = json.loads(str(archive["record"]))
        names = sorted(n for n in archive.files if n.startswith("optimizer/"))
        if "optimizer_keys" in archive.files:
            keys = json.loads(str(archive["optimizer_keys"]))
        else:
            keys = [f"#{i}" for i in range(len(names))]
            if record["config"]["precision"] == "fp16":
                keys[:4] = ["outer/iteration", "outer/learning_rate", "outer/step_counter",
                            "outer/dynamic_scale"]
        return record, {k: archive[n] for k, n in zip(keys, names)}


@FRAMEWORKS
def test_resume_uses_the_momentum_and_lr_given_at_the_resume(train_here, tmp_path, framework):
    train(train_here, tmp_path, "--epochs", "1", "--momentum", "0.9", framework=framework)
    train(train_here, tmp_path, "--epochs", "2", "--momentum", "0.0", "--lr", "0.01", "--resume",
          framework=framework)
    m = metrics(tmp_path)
    assert m["resumed_from"]["epoch"] == 1 and len(m["epochs"]) == 2
    assert m["config"]["momentum"] == 0.0
    # The new base rate, scaled x2 for 2 ranks (no warmup): 0.04 before, 0.02 after.
    assert [e["lr"] for e in m["epochs"]] == pytest.approx([0.04, 0.02])
    if framework == "torch":
        new, old = torch_checkpoint(tmp_path), torch_checkpoint(tmp_path, "checkpoint.prev.pt")
        assert new["config"]["momentum"] == 0.0
        assert {g["momentum"] for g in old["optimizer"]["param_groups"]} == {0.9}
        # Before: 0.9, the checkpoint's, restored by load_state_dict.
        assert {g["momentum"] for g in new["optimizer"]["param_groups"]} == {0.0}
        # At momentum 0 the buffers are dropped (a later resume at 0.9 starts them afresh, as
        # Keras starts a new slot at zero), as the momentum slots are on Keras.
        state_new, state_old = new["optimizer"]["state"], old["optimizer"]["state"]
        assert state_old and all("momentum_buffer" in s for s in state_old.values())
        assert not any("momentum_buffer" in s for s in state_new.values())
        # ... while the weights did train.
        assert any(not torch.equal(new["model"][k], old["model"][k]) for k in new["model"])
    else:
        record, optimizer = keras_checkpoint(tmp_path)
        _, before = keras_checkpoint(tmp_path, "checkpoint.prev.npz")
        assert record["config"]["momentum"] == 0.0
        assert any(k.endswith(":momentum") for k in before)
        # The optimizer ran without momentum slots (before: the resume was refused).
        assert not any(k.endswith(":momentum") for k in optimizer), sorted(optimizer)
        assert int(optimizer["inner/iteration"]) == 2 * m["steps_per_epoch"]


@FRAMEWORKS
def test_resume_with_another_init_loss_scale_starts_the_scale_there(train_here, tmp_path,
                                                                   framework):
    train(train_here, tmp_path, "--epochs", "1", "--precision", "fp16", framework=framework)
    train(train_here, tmp_path, "--epochs", "2", "--precision", "fp16", "--init-loss-scale", "8",
          "--resume", framework=framework)
    if framework == "torch":
        first = torch_checkpoint(tmp_path, "checkpoint.prev.pt")["scaler"]["scale"]
        last = torch_checkpoint(tmp_path)["scaler"]["scale"]
    else:
        first = keras_checkpoint(tmp_path, "checkpoint.prev.npz")[1]["outer/dynamic_scale"]
        last = keras_checkpoint(tmp_path)[1]["outer/dynamic_scale"]
    assert float(first) > 8.0
    # 45 steps at scale 8: no overflow, and no growth before 2,000 clean steps.
    assert float(last) == 8.0
    assert metrics(tmp_path)["config"]["init_loss_scale"] == 8.0


@FRAMEWORKS
def test_resume_from_k1_to_k2_on_both_trainers(train_here, tmp_path, framework):
    train(train_here, tmp_path, "--epochs", "1", framework=framework)
    train(train_here, tmp_path, "--epochs", "2", "-k", "2", "--resume", framework=framework)
    m = metrics(tmp_path)
    assert m["global_batch"] == 64 and m["backward_passes_per_step"] == 2
    steps = [e["optimizer_steps"] for e in m["epochs"]]
    assert steps[0] == 45 and steps[1] == m["steps_per_epoch"] in (22, 23), steps
    assert m["ranks_agree"] is True
    if framework == "keras":
        record, optimizer = keras_checkpoint(tmp_path)
        assert record["step"] == 2 * m["steps_per_epoch"]
        # The momentum slots carried over, the accumulators came new and end the epoch empty.
        accumulators = [v for k, v in optimizer.items() if k.endswith(":gradient_accumulator")]
        assert len(accumulators) == 8 and all(not a.any() for a in accumulators)
        assert all(optimizer[k].any() for k in optimizer if k.endswith(":momentum"))


@FRAMEWORKS
def test_a_failed_elastic_run_continues_at_a_fixed_size(train_here, tmp_path, framework):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    out = tmp_path / "run"
    run([str(BIN / "hvdtrain"), "launch", "--elastic", "--min-np", "2", "--max-np", "2", "-np",
         "2", "--host-discovery-script", str(discover), "--network-interfaces", "lo", "--",
         "hvdtrain", "train", "--elastic", "--framework", framework, "--dataset", "digits",
         "--no-progress", "--epochs", "2", "--output-dir", str(out)], timeout=300)
    elastic = metrics(out)
    assert elastic["elastic"] is True and [e["sizes"] for e in elastic["epochs"]] == [[2], [2]]
    # Before: TypeError: EpochMetrics.__init__() got an unexpected keyword argument 'samples'.
    train(train_here, out, "--epochs", "3", "--resume", framework=framework)
    m = metrics(out)
    assert m["elastic"] is False and m["resumed_from"]["epoch"] == 2
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3]
    for before, after in zip(elastic["epochs"], m["epochs"]):
        assert after["test_accuracy"] == before["test_accuracy"]
        assert after["train_loss"] == before["train_loss"]
    assert m["epochs"][2]["optimizer_steps"] == m["steps_per_epoch"] == 45
    step = (torch_checkpoint(out) if framework == "torch" else keras_checkpoint(out)[0])["step"]
    assert step == 3 * 45  # the position recomputed for this run
    assert m["ranks_agree"] is True and m["epochs"][2]["test_accuracy"] > 0.5
