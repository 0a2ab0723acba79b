"""The training run written once (hvdtrain.run.training.Run), driven by in-memory hooks on one
process: the order of an epoch's end, the checkpoint's record, resume and its errors, the
preemption stop and the divergence stop, read back from the files the run writes. The real
frameworks run the same code under horovodrun -np 2 in tests/parallel."""
import json
import pickle

import pytest

from hvdtrain import guard
from hvdtrain.config import TrainConfig
from hvdtrain.run import preempt
from hvdtrain.run.report import RUN_RESULTS, RunHeader
from hvdtrain.run.training import EPOCH_SUMS, Position, Run
from hvdtrain.runtime import RankInfo

RECORD = "record.pkl"


class FakeHooks:
    """One rank's hooks: collectives are the identity, the model is a number, calls are logged."""

    framework = "torch"
    checkpoint_files = (RECORD, "record.prev.pkl")

    def __init__(self, test=(0.5, 0.75)):
        self.calls, self.test, self.weight = [], test, 1.0
        self.rng = {"state": 7}
        self.skipped = 0

    def versions(self):
        return {"fake": "1"}

    def broadcast_object(self, obj, root_rank=0, name=None):
        self.calls.append(("broadcast_object", name))
        return obj

    def allgather_object(self, obj, name=None):
        self.calls.append(("allgather_object", name))
        return [obj]

    def allreduce_sums(self, sums, name):
        self.calls.append(("allreduce_sums", name))
        return dict(sums)

    def sync_buffers(self):
        self.calls.append(("sync_buffers", None))

    def evaluate(self):
        self.calls.append(("evaluate", None))
        return self.test

    def rng_state(self):
        return dict(self.rng)

    def set_rng_state(self, state):
        self.calls.append(("set_rng_state", state["state"]))
        self.rng = dict(state)

    def counters(self):
        return {"skipped": self.skipped, "overflows": 0}

    def restore_counters(self, counters):
        self.skipped = counters.get("skipped", 0)

    def save(self, output_dir, record):
        self.calls.append(("save", record["epoch"]))
        (output_dir / RECORD).write_bytes(pickle.dumps({"weight": self.weight, **record}))

    def load(self, output_dir):
        payload = pickle.loads((output_dir / RECORD).read_bytes())
        self.weight = payload.pop("weight")
        return payload

    def checksum(self):
        return self.weight


INFO = RankInfo(rank=0, local_rank=0, size=1, local_size=1, threads=1, seed=42)


def _run(tmp_path, hooks=None, **options):
    cfg = TrainConfig(output_dir=str(tmp_path), tensorboard=False, warmup_epochs=0.0, **options)
    cfg.validate()
    run = Run(cfg, INFO, preempt.Preemption(enabled=False), hooks or FakeHooks(), num_classes=10)
    return run


def _sums(loss=2.0, correct=60, n=100, seconds=2.0):
    return {"loss": loss * n, "correct": correct, "n": n, "processed": n, "seconds": seconds}


def test_an_epochs_end_sums_syncs_evaluates_then_saves_and_records(tmp_path):
    run = _run(tmp_path)
    run.open(100, 20, 10, None, Position())
    run.hooks.calls.clear()
    metrics = run.end_epoch(0, _sums(), lr=0.1, steps=10, step=10)
    names = [name for name, _ in run.hooks.calls]
    assert names == ["allreduce_sums", "sync_buffers", "evaluate", "allgather_object", "save"]
    assert (metrics.train_loss, metrics.train_accuracy) == (2.0, 0.6)
    assert (metrics.test_loss, metrics.test_accuracy, metrics.samples_per_sec) == (0.5, 0.75, 50.0)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["epochs"][0]["train_accuracy"] == 0.6 and written["final_test_accuracy"] == 0.75
    record = pickle.loads((tmp_path / RECORD).read_bytes())
    assert (record["epoch"], record["batch"], record["step"], record["size"]) == (1, 0, 10, 1)
    assert record["rng_per_rank"] == [{"state": 7}] and record["partial_per_rank"] is None
    assert set(EPOCH_SUMS) == set(_sums())


def test_a_resumed_run_continues_from_the_record(tmp_path):
    first = _run(tmp_path)
    first.open(100, 20, 10, None, Position())
    first.hooks.weight = 3.0
    first.hooks.skipped = 2
    first.end_epoch(0, _sums(), lr=0.1, steps=10, step=10)

    hooks = FakeHooks()
    hooks.rng = {"state": 0}
    second = _run(tmp_path, hooks, resume="yes")
    resumed = second.resume()
    assert hooks.weight == 3.0 and hooks.rng == {"state": 7}  # model and RNG back
    at = second.position(resumed)
    assert (at.epoch, at.batch, at.partial, at.moved) == (1, 0, None, None)
    report = second.open(100, 20, 10, resumed, at)
    assert [e.epoch for e in report.epochs] == [1]
    assert report.header["resumed_from"] == {"epoch": 1, "size": 1, "global_batch": 16,
                                             "batch": 0}
    assert report.header["skipped_steps"] == 2


def test_resume_auto_without_a_checkpoint_starts_fresh_and_yes_refuses(tmp_path):
    assert _run(tmp_path, resume="auto").resume() is None
    with pytest.raises(SystemExit, match="--resume"):
        _run(tmp_path, resume="yes").resume()


def test_an_incomplete_record_is_refused_on_every_rank_before_any_work(tmp_path):
    (tmp_path / RECORD).write_bytes(pickle.dumps({"weight": 1.0, "epoch": 1}))
    with pytest.raises(SystemExit, match="lacks size, global_batch, metrics"):
        _run(tmp_path, resume="yes").resume()


def test_a_mid_epoch_checkpoint_at_another_batch_size_restarts_that_epoch(tmp_path):
    run = _run(tmp_path, batch_size=16)
    run.open(100, 20, 10, None, Position())
    run.save(0, 3, {"loss_sum": 1.0}, [], step=3)
    second = _run(tmp_path, batch_size=8, resume="yes")
    resumed = second.resume()
    at = second.position(resumed)
    assert (at.epoch, at.batch, at.partial) == (0, 0, None)
    assert "--batch-size 16 -> 8" in at.moved
    same = _run(tmp_path, batch_size=16, resume="yes")
    at = same.position(same.resume())
    assert (at.epoch, at.batch, at.partial) == (0, 3, {"loss_sum": 1.0})


def test_the_preemption_stop_checkpoints_mid_epoch_records_and_exits_75(tmp_path):
    run = _run(tmp_path)
    run.open(100, 20, 10, None, Position())
    with pytest.raises(preempt.Preempted) as stop:
        run.preempted_stop("SIGTERM", epoch=0, batch=4, step=4, partial={"loss_sum": 2.5})
    assert stop.value.code == preempt.EXIT_PREEMPTED == 75
    record = pickle.loads((tmp_path / RECORD).read_bytes())
    assert (record["epoch"], record["batch"], record["partial_per_rank"]) == (
        0, 4, [{"loss_sum": 2.5}])
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["preempted"]["signal"] == "SIGTERM" and written["preempted"]["batch"] == 4
    assert run.hooks.calls[-1] == ("broadcast_object", "hvdtrain.preempt.done")


def test_a_diverged_epoch_is_recorded_but_not_checkpointed(tmp_path):
    run = _run(tmp_path)
    run.open(100, 20, 10, None, Position())
    run.end_epoch(0, _sums(loss=1.0), lr=0.1, steps=10, step=10)
    with pytest.raises(guard.DivergenceError):
        run.end_epoch(1, _sums(loss=5.0, correct=5), lr=0.1, steps=10, step=20)
    assert pickle.loads((tmp_path / RECORD).read_bytes())["epoch"] == 1  # the epoch before
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert [e["epoch"] for e in written["epochs"]] == [1, 2] and written["diverged"]


def test_finish_says_whether_the_ranks_agree(tmp_path):
    run = _run(tmp_path)
    run.open(100, 20, 10, None, Position())
    result = run.finish()
    assert result["ranks_agree"] is True
    assert set(result) == set(RunHeader.__dataclass_fields__) | set(RUN_RESULTS)
    assert json.loads((tmp_path / "metrics.json").read_text())["ranks_agree"] is True


@pytest.mark.parametrize("size", [3, 6])
def test_adasum_at_a_world_size_horovod_cannot_take_is_refused_before_any_work(tmp_path, size):
    """--op adasum at 3 ranks: Horovod 0.28.1's Adasum takes powers of 2 only. hvdtrain train
    says so in its own terms (--op average) on every rank as soon as the size is known, before
    logging or signal handlers are set up, instead of a traceback from distribute(). (At 2 ranks
    it trains: tests/parallel.)"""
    from hvdtrain.run import training
    cfg = TrainConfig(output_dir=str(tmp_path), op="adasum", lr_scaling="none").validate()
    info = RankInfo(rank=0, local_rank=0, size=size, local_size=size, threads=1, seed=42)
    with pytest.raises(SystemExit, match=rf"--op adasum needs a power-of-2 number of ranks "
                                         rf".*got {size}: use --op average"):
        training.start(cfg, lambda seed, device: info)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_adasum_at_a_power_of_2_ranks_starts(tmp_path, monkeypatch, size):
    """The sizes Horovod's Adasum takes go on (logging and the signal handlers, which would
    change this pytest process, replaced by stand-ins that record the call)."""
    from hvdtrain.run import training
    calls = []
    monkeypatch.setattr(training, "setup_logging", lambda rank: calls.append(("logging", rank)))
    monkeypatch.setattr(training.preempt, "taken", lambda: calls.append("signals") or "taken")
    cfg = TrainConfig(output_dir=str(tmp_path), op="adasum", lr_scaling="none").validate()
    info = RankInfo(rank=0, local_rank=0, size=size, local_size=size, threads=1, seed=42)
    assert training.start(cfg, lambda seed, device: info) == (info, "taken")
    assert calls == [("logging", 0), "signals"]
