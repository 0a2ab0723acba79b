"""A job's output written to a file reads well (issue 38): under horovodrun every rank's stderr
is a pipe, so rank 0 prints short progress lines at a fixed interval (hvdtrain.progress), and
Keras one line per epoch, instead of carriage-return bars that pile up into one line of tens of
kilobytes."""
import re
import subprocess

import pytest

from jobs import TIMEOUT, Console, horovodrun, job_env

LONGEST = 500  # characters: what a person can still read in a log


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_a_jobs_log_file_has_short_lines_and_progress_lines(tmp_path, framework):
    log = tmp_path / "log"
    argv = horovodrun(2, "hvdtrain", "train", "--framework", framework, "--dataset", "digits",
                      "--epochs", "2", "--output-dir", str(tmp_path / "run"))
    # A short interval, so that the 45-step epochs print progress lines at all.
    env = {**job_env(), "HVDTRAIN_PROGRESS_SECONDS": "0.05"}
    env.pop("HVDTRAIN_PROGRESS", None)
    with open(log, "w") as out:
        proc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    lengths = sorted(len(line) for line in text.splitlines())
    assert lengths[-1] <= LONGEST, [line[:200] for line in text.splitlines()
                                    if len(line) > LONGEST]
    assert "\r" not in text and "\b" not in text  # no bar redrawn in place
    rank0 = Console(text).rank(0)
    progress = re.findall(r"^epoch ([12])/2: (\d+)/(\d+) batches \(\d+%\), [\d.e+]+ batches/s",
                          rank0, re.M)
    assert progress, rank0[-3000:]
    assert all(int(done) <= int(total) for _, done, total in progress)
    assert "epoch 1/2" not in Console(text).rank(1)  # rank 0 alone shows progress
    if framework == "keras":  # verbose=2: one line per epoch, with the loss
        assert len(re.findall(r"^\s*\d+/\d+ - \d+s - .*loss: [\d.]+", rank0, re.M)) == 2, \
            rank0[-3000:]
