"""Watching a run (issue 16), ``hvdtrain train`` on 2 real ranks (the session's rank pools) for
both trainers: TensorBoard's event
files (read back with TensorBoard's own reader) hold the numbers of ``metrics.json``; a run that
diverges stops with exit 1 and keeps the last good checkpoint; a healthy run is not stopped."""
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


FRAMEWORKS = ["torch", "keras"]


def scalars(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def train(train_here, framework, out, *options, check=True):
    return train_here(out, "--dataset", "digits", *options, framework=framework, check=check)


def checkpoint_epoch(framework, out):
    if framework == "torch":
        from hvdtrain.torch import checkpoint
        return checkpoint.load(out)["epoch"]
    from hvdtrain.keras import checkpoint
    return checkpoint.load(out)["record"]["epoch"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensorboard_holds_the_runs_numbers(train_here, tmp_path, framework):
    out = tmp_path / "run"
    train(train_here, framework, out, "--epochs", "3", "-k", "2", "--log-every", "5")
    metrics = json.loads((out / "metrics.json").read_text())
    got = scalars(out / "tensorboard")
    for field in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr",
                  "samples_per_sec"):
        expected = [(e["epoch"], e[field]) for e in metrics["epochs"]]
        assert [s for s, _ in got[f"epoch/{field}"]] == [s for s, _ in expected], field
        for (_, value), (_, want) in zip(got[f"epoch/{field}"], expected):
            assert value == pytest.approx(want, rel=1e-6), field
    assert {v for _, v in got["epoch/global_batch"]} == {metrics["global_batch"]} == {64}
    # A point every 5 optimizer steps over the whole run, each all-reduce shared by k = 2
    # micro-batches, at the rates of the warmup schedule.
    steps = metrics["steps_per_epoch"] * 3
    assert [s for s, _ in got["step/lr"]] == list(range(5, steps + 1, 5))
    assert {v for _, v in got["step/allreduces_per_micro_batch"]} == {0.5}
    assert {v for _, v in got["step/global_batch"]} == {64}
    lrs = [v for _, v in got["step/lr"]]
    assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(metrics["scaled_lr"], rel=1e-6)
    assert all(0 <= v <= 1 for _, v in got["step/accuracy"])
    assert all(v > 0 for _, v in got["step/loss"] + got["step/samples_per_sec"])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_diverging_run_stops_with_an_error_and_keeps_the_last_good_checkpoint(train_here,
                                                                                tmp_path,
                                                                                framework):
    out = tmp_path / "run"
    proc = train(train_here, framework, out, "--epochs", "4", "--lr", "20", "--warmup-epochs", "0",
                 check=False)
    assert proc.codes == {0: 1, 1: 1}, proc.text[-3000:]  # every rank exits 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]  # stopped after epoch 2
    assert metrics["diverged"].startswith("training diverged in epoch 2 (after warmup)")
    assert checkpoint_epoch(framework, out) == 1  # epoch 2 was not saved over epoch 1
    assert "hvdtrain: error: training diverged in epoch 2" in proc.rank(0)
    assert "--no-divergence-check" in proc.rank(0)
    # The same run with the check off trains all its epochs.
    proc = train(train_here, framework, tmp_path / "on", "--epochs", "3", "--lr", "20",
                 "--warmup-epochs",
                 "0", "--no-divergence-check")
    assert len(json.loads((tmp_path / "on" / "metrics.json").read_text())["epochs"]) == 3
