"""hvdtrain.progress: a bar on a terminal, short lines at a fixed interval in a log file."""
import io
import os
import pty

import pytest

from hvdtrain import progress
from hvdtrain.config import ConfigError, TrainConfig


def test_mode_follows_the_stream_and_the_variable():
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w") as terminal:
            assert progress.mode(True, terminal, env={}) == "bar"
            assert progress.mode(True, terminal, env={"HVDTRAIN_PROGRESS": "lines"}) == "lines"
            assert progress.mode(False, terminal, env={}) == "off"  # not rank 0, --no-progress
    finally:
        os.close(master)
    log = io.StringIO()  # a file or a launcher's pipe: no isatty()
    assert progress.mode(True, log, env={}) == "lines"
    assert progress.mode(True, log, env={"HVDTRAIN_PROGRESS": " AUTO "}) == "lines"
    assert progress.mode(True, log, env={"HVDTRAIN_PROGRESS": "bar"}) == "bar"
    assert progress.mode(True, log, env={"HVDTRAIN_PROGRESS": "off"}) == "off"


@pytest.mark.parametrize("env,message", [
    ({"HVDTRAIN_PROGRESS": "fancy"}, "HVDTRAIN_PROGRESS='fancy' is not one of auto, bar, lines, "
                                     "off"),
    ({"HVDTRAIN_PROGRESS_SECONDS": "0"}, "HVDTRAIN_PROGRESS_SECONDS='0' must be a number of "
                                         "seconds > 0"),
    ({"HVDTRAIN_PROGRESS_SECONDS": "soon"}, "HVDTRAIN_PROGRESS_SECONDS='soon' must be"),
])
def test_bad_variables_fail_validation_before_any_work(tmp_path, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        TrainConfig(output_dir=str(tmp_path)).validate()


def test_lines_print_at_the_interval_each_short_and_complete():
    now = [100.0]
    out = io.StringIO()
    lines = progress.Lines(469, initial=0, desc="epoch 2/15", seconds=30, stream=out,
                           clock=lambda: now[0])
    for _ in range(469):
        now[0] += 0.25  # 4 batches/s: 117 s in all, a line at 30, 60, 90 s
        lines.update()
    lines.close()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.splitlines() == [
        "epoch 2/15: 120/469 batches (26%), 4 batches/s, 1:27 left",
        "epoch 2/15: 240/469 batches (51%), 4 batches/s, 0:57 left",
        "epoch 2/15: 360/469 batches (77%), 4 batches/s, 0:27 left"]


def test_a_resumed_epoch_counts_its_rate_from_where_it_resumed():
    now = [0.0]
    out = io.StringIO()
    lines = progress.Lines(100, initial=60, seconds=5, stream=out, clock=lambda: now[0])
    for _ in range(10):
        now[0] += 1.0
        lines.update()
    assert out.getvalue().splitlines() == ["65/100 batches (65%), 1 batches/s, 0:35 left",
                                           "70/100 batches (70%), 1 batches/s, 0:30 left"]


@pytest.mark.parametrize("value,verbose", [("bar", 1), ("lines", 2), ("off", 0)])
def test_keras_verbose_follows_the_mode(monkeypatch, value, verbose):
    monkeypatch.setenv("HVDTRAIN_PROGRESS", value)
    assert progress.keras_verbose(True) == verbose
    assert progress.keras_verbose(False) == 0  # not rank 0, or --no-progress
    assert progress.keras_callbacks(False, 45, 2) == []


def test_the_torch_bar_is_tqdm_lines_or_nothing(monkeypatch):
    from tqdm import tqdm
    monkeypatch.setenv("HVDTRAIN_PROGRESS", "lines")
    monkeypatch.setenv("HVDTRAIN_PROGRESS_SECONDS", "12.5")
    lines = progress.bar(45, 3, "epoch 1/2")
    assert isinstance(lines, progress.Lines) and (lines.total, lines.n, lines.seconds) == (45, 3, 12.5)
    monkeypatch.setenv("HVDTRAIN_PROGRESS", "bar")
    bar = progress.bar(45, 0, "epoch 1/2")
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setenv("HVDTRAIN_PROGRESS", "off")
    off = progress.bar(45)
    off.update()
    off.close()
    assert not isinstance(off, (tqdm, progress.Lines))
