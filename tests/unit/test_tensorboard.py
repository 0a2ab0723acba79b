"""hvdtrain.tensorboard: what Board and StepMeter write, read back with TensorBoard's own reader."""
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hvdtrain.run.report import EpochMetrics, RunReport
from hvdtrain.tensorboard import EPOCH_FIELDS, Board, StepMeter


def scalars(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_epoch_scalars_equal_the_report(tmp_path):
    report = RunReport(tmp_path, {"global_batch": 64}, is_root=True, tensorboard=True)
    for epoch in (1, 2):
        report.add(EpochMetrics(epoch, 1.0 / epoch, 0.5 + epoch / 10, 0.8 / epoch, 0.9, 0.02,
                                100, 3.5, 1234.5))
    report.board.close()
    got = scalars(tmp_path / "tensorboard")
    for field in EPOCH_FIELDS:
        assert [s for s, _ in got[f"epoch/{field}"]] == [1, 2]
        for (_, value), e in zip(got[f"epoch/{field}"], report.epochs):
            assert value == pytest.approx(getattr(e, field), rel=1e-6)
    assert got["epoch/global_batch"] == [(1, 64.0), (2, 64.0)]


def test_step_points_from_running_sums(tmp_path):
    board = Board(tmp_path, enabled=True, is_root=True)
    meter = StepMeter(board, every=2, global_batch=64, samples_per_micro_batch=32)  # k = 2
    meter.start(now=10.0)
    assert not meter.due(1) and meter.due(2)
    # 2 steps = 4 micro-batches of 16 samples on rank 0, 2 all-reduces, 2 seconds
    meter.point(2, now=12.0, lr=0.01, loss_sum=64.0, correct=48, seen=64, micro_batches=4,
                allreduces=2)
    meter.point(4, now=13.0, lr=0.02, loss_sum=96.0, correct=112, seen=128, micro_batches=8,
                allreduces=4)
    board.close()
    got = scalars(tmp_path / "tensorboard")
    assert got["step/loss"] == [(2, 1.0), (4, 0.5)]
    assert got["step/accuracy"] == [(2, 0.75), (4, 1.0)]
    assert got["step/lr"] == [(2, pytest.approx(0.01)), (4, pytest.approx(0.02))]
    assert got["step/samples_per_sec"] == [(2, 64.0), (4, 128.0)]  # 4 x 32 / 2 s, 4 x 32 / 1 s
    assert got["step/allreduces_per_micro_batch"] == [(2, 0.5), (4, 0.5)]  # 1/k
    assert got["step/global_batch"] == [(2, 64.0), (4, 64.0)]


def test_other_ranks_and_disabled_runs_write_nothing(tmp_path):
    for enabled, is_root in ((True, False), (False, True)):
        board = Board(tmp_path, enabled=enabled, is_root=is_root)
        meter = StepMeter(board, every=1, global_batch=8, samples_per_micro_batch=8)
        meter.start(0.0)
        assert not meter.due(1)
        meter.point(1, 1.0, 0.1, 1.0, 1, 1, 1, 1)
        board.epoch(EpochMetrics(1, 1, 1, 1, 1, 1, 1, 1, 1), 8)
        board.close()
    assert not (tmp_path / "tensorboard").exists()


def test_the_board_closes_on_the_way_out_of_a_failed_loop(tmp_path):
    board = Board(tmp_path, enabled=True, is_root=True)
    with pytest.raises(RuntimeError):
        with board:
            board.step(1, {"loss": 2.5})
            raise RuntimeError("a non-finite loss stopped the run")
    assert not board.enabled  # closed: the event reached the disk
    assert scalars(tmp_path / "tensorboard")["step/loss"] == [(1, 2.5)]


def test_elastic_epochs_survive_a_lost_rank_0(tmp_path):
    # The first rank 0 writes epoch 1 and dies before epoch 2's points; the worker that is rank 0
    # after the reset starts its own event file with the committed epochs it has not written.
    # TensorBoard's reader gets every epoch, with the global batch at each epoch's last size
    # (epoch 1 twice, from both files, with the same numbers).
    import time
    from types import SimpleNamespace

    from hvdtrain.config import TrainConfig
    from hvdtrain.run.elastic import ElasticReport

    cfg = TrainConfig(batch_size=16, tensorboard=True)
    history = [{**vars(EpochMetrics(e, 1.0 / e, 0.5 + e / 10, 0.8 / e, 0.8 + e / 100, 0.02, 45,
                                    1.5, 900.0)), "samples": 1438, "sizes": sizes}
               for e, sizes in ((1, [3]), (2, [3, 2]), (3, [2]))]
    state = SimpleNamespace(history=history[:1], skipped=0, epoch=1)
    first = ElasticReport(tmp_path, {}, state, cfg, lambda: 3, lambda: True, None)
    first.board_epochs(state.history)
    first.close()  # as good as a SIGKILL: Board.epoch flushed already
    # Event files are named by the second (then the pid) and read in that order: the second
    # file must be named by a later second than the first (at most 1 s to wait).
    first_file, = (tmp_path / "tensorboard").iterdir()
    named = int(first_file.name.split(".")[3])  # events.out.tfevents.SECONDS.HOST.PID...
    while int(time.time()) <= named:
        time.sleep(0.01)
    state.history = history
    second = ElasticReport(tmp_path, {}, state, cfg, lambda: 2, lambda: True, None)
    second.board_epochs(state.history[:2])
    second.board_epochs(state.history)  # epoch 3 only: 1 and 2 are on its file already
    second.close()
    got = scalars(tmp_path / "tensorboard")
    assert [s for s, _ in got["epoch/test_accuracy"]] == [1, 1, 2, 3]
    for step, value in got["epoch/test_accuracy"]:
        assert value == pytest.approx(history[step - 1]["test_accuracy"], rel=1e-6)
    assert got["epoch/global_batch"] == [(1, 48.0), (1, 48.0), (2, 32.0), (3, 32.0)]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    idle = ElasticReport(tmp_path / "other", {}, state, cfg, lambda: 2, lambda: False, None)
    idle.board_epochs(history)  # not rank 0: no file at all
    assert not (tmp_path / "other").exists()


def test_a_diverged_epoch_trained_again_after_a_reset_is_written_again(tmp_path):
    # The divergence stop writes epoch 2 and holds; a worker lost in the hold makes the survivors
    # train epoch 2 again: its new numbers and epoch 3 reach the (same process's) events.
    from types import SimpleNamespace

    from hvdtrain.config import TrainConfig
    from hvdtrain.run.elastic import ElasticReport

    def entry(epoch, acc):
        return {**vars(EpochMetrics(epoch, 1.0, acc, 1.0, acc, 0.02, 45, 1.5, 900.0)),
                "samples": 1438, "sizes": [2]}

    state = SimpleNamespace(history=[entry(1, 0.9)], skipped=0, epoch=1)
    report = ElasticReport(tmp_path, {}, state, TrainConfig(tensorboard=True), lambda: 2,
                           lambda: True, None)
    report.board_epochs(state.history)
    report.board_epochs(state.history + [entry(2, 0.1)], last_tentative=True)
    state.history = [entry(1, 0.9), entry(2, 0.93), entry(3, 0.95)]
    report.board_epochs(state.history)
    report.close()
    got = scalars(tmp_path / "tensorboard")["epoch/test_accuracy"]
    assert [(s, round(v, 4)) for s, v in got] == [(1, 0.9), (2, 0.1), (2, 0.93), (3, 0.95)]
