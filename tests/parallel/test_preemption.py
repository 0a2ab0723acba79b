"""Preemption under real `horovodrun -np 2` jobs, both trainers (the uninterrupted references and
the resumes run in the session's rank pools: `hvdtrain train` inside 2 long-lived ranks): SIGTERM or SIGUSR1 on one rank
mid-epoch stops every rank after the same optimizer step, rank 0 writes a mid-epoch checkpoint,
the job exits 75, and `--resume auto` continues to the same weights as an uninterrupted run.
`--resume auto` with no checkpoint starts fresh. The Slurm drill (scancel) is in tests/slurm/."""
import signal
import time

import numpy as np
import pytest

from jobs import Console
from test_reliability import load_checkpoint, metrics, pids_of, start, train

# A cosine schedule: the rate changes at every step, so a resumed run on another point of the
# curve would show in the weights and the recorded rates.
ARGS = ["--dataset", "synthetic", "--synthetic-samples", "6000", "--no-progress", "--epochs",
        "3", "-k", "2", "--warmup-epochs", "1", "--lr-schedule", "cosine"]
# 4,800 training samples / (2 ranks x 16 x k=2) = 75 optimizer steps per epoch. The signalled
# run's steps from epoch 2 on take >= 0.04 s each, so epoch 2 lasts >= 3 s on any machine and a
# signal sent 0.3 s after epoch 1 is recorded lands in it (unslowed, an epoch took 0.3 s on a
# fast machine). Only the signalled run is slowed; the math is the same.
SLOW_FROM_EPOCH_2 = ["--fault-slow-from", "75:0.04"]
EXIT_PREEMPTED = 75


def wait_for_file(path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before it could be signalled"
        if path.exists():
            return
        time.sleep(0.02)
    pytest.fail(f"no {path} within {timeout} s")


def preempt(out, args, framework, sig, rank="1"):
    """Start a job, signal one rank mid-epoch 2, return (proc, output, seconds from the signal to
    the job's exit)."""
    proc = start(train(out, *args, framework=framework))
    try:
        wait_for_file(out / "metrics.json", proc)  # epoch 1 done
        time.sleep(0.3)  # into epoch 2
        ranks = {r: pid for pid, r in pids_of(str(out)).items() if r is not None}
        signalled = time.monotonic()
        import os
        os.kill(ranks[rank], sig)
        output, _ = proc.communicate(timeout=300)
        return proc, output, time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()


# Keras gets SIGUSR1 here, PyTorch SIGTERM: PyTorch's SIGUSR1 mid-epoch (and Slurm's requeue,
# shared code: hvdtrain.run.preempt) is the drill of tests/slurm, Keras's SIGTERM the signal of
# test_launch_signals (#47: the Keras Slurm drill, 99 s, is gone; its assertions live in the two).
@pytest.mark.parametrize("framework,sig", [("torch", signal.SIGTERM), ("keras", signal.SIGUSR1)])
def test_signal_mid_epoch_checkpoints_and_resume_auto_matches_an_uninterrupted_run(
        train_here, tmp_path, framework, sig):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    extra = ["--dropout", "0.1"] if framework == "torch" else []  # RNG restored mid-epoch too
    train_here(whole, *ARGS, *extra, framework=framework)
    proc, output, seconds = preempt(broken, [*ARGS, *extra, *SLOW_FROM_EPOCH_2, "--resume", "auto"],
                                    framework, sig)
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    stopped = metrics(broken)["preempted"]
    print(f"{framework}: {stopped}; job exited {seconds:.2f} s after the signal")
    assert stopped["signal"] == sig.name and stopped["epoch"] == 2
    assert 0 < stopped["batch"] and stopped["batch"] % 2 == 0  # after a whole step of k=2
    record, _ = load_checkpoint(broken, framework)
    assert record["epoch"] == 1 and record["batch"] == stopped["batch"]
    assert "not a Slurm job: not requeued" in Console(output).text
    train_here(broken, *ARGS, *extra, "--resume", "auto", framework=framework)
    resumed, reference = metrics(broken), metrics(whole)
    assert resumed["resumed_from"]["batch"] == stopped["batch"] and resumed["preempted"] is None
    diff = np.abs(load_checkpoint(broken, framework)[1] - load_checkpoint(whole, framework)[1])
    print(f"{framework}: resumed vs uninterrupted, max |weight difference| = {diff.max():.3g}")
    assert diff.max() <= 1e-6
    for a, b in zip(resumed["epochs"], reference["epochs"]):
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["optimizer_steps"] == b["optimizer_steps"] and a["lr"] == pytest.approx(b["lr"])
    rates = [e["lr"] for e in reference["epochs"]]  # each epoch's first step: warmup, then down
    assert rates[1] > rates[2] > 0


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_resume_auto_without_a_checkpoint_starts_fresh(train_here, tmp_path, framework):
    proc = train_here(tmp_path, "--epochs", "1", "--resume", "auto", framework=framework)
    m = metrics(tmp_path)
    assert m["resumed_from"] is None and len(m["epochs"]) == 1
    assert "--resume auto: no checkpoint" in proc.text


def test_hvdtrain_launch_passes_sigusr1_on_to_the_ranks(tmp_path):
    # mpirun hands SIGUSR1 to its ranks; hvdtrain launch must hand it to mpirun, not die of it.
    import subprocess
    import sys

    from jobs import BIN, job_env
    rank = tmp_path / "rank.py"
    got = tmp_path / "got-usr1"
    rank.write_text("import signal, time, pathlib\n"
                    f"signal.signal(signal.SIGUSR1, lambda *a: pathlib.Path({str(got)!r})"
                    ".write_text('yes'))\n"
                    f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('')\n"
                    "deadline = time.time() + 60\n"
                    f"while not pathlib.Path({str(got)!r}).exists() and time.time() < deadline:\n"
                    "    time.sleep(0.05)\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    proc = subprocess.Popen([str(BIN / "hvdtrain"), "launch", "--launcher", "mpirun",
                             "--hostfile", str(hostfile), "--", sys.executable, str(rank)],
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        import os
        os.kill(proc.pid, signal.SIGUSR1)  # the launcher, as sbatch --signal=B:USR1 does
        assert proc.wait(timeout=120) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert got.read_text() == "yes"


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_sigterm_to_hvdtrain_launch_reaches_the_ranks_through_every_launcher(tmp_path, launcher):
    # Before: horovodrun died of the signal at once (exit 241) and its ranks trained on,
    # orphaned; mpirun handed SIGTERM on but SIGKILLed the ranks about 1 s later (exit 1), so a
    # step of 1.5 s never reached its checkpoint. Now the ranks get the signal themselves.
    from jobs import BIN
    out = tmp_path / "run"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    # Epoch 1 at full speed (75 steps), then every optimizer step takes > 1.5 s.
    proc = start([str(BIN / "hvdtrain"), "launch", "--launcher", launcher, "--hostfile",
                  str(hostfile), "-np", "2", "--", str(BIN / "hvdtrain"), "train", "--framework",
                  "torch", "--output-dir", str(out), *ARGS, "--fault-slow-from", "75:1.5"])
    try:
        wait_for_file(out / "metrics.json", proc)  # epoch 1 done: the ranks handle signals
        time.sleep(0.3)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the launcher, as scancel or a pod's stop does
        output, _ = proc.communicate(timeout=120)
        seconds = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    stopped = metrics(out)["preempted"]
    print(f"{launcher}: {stopped}; exited {seconds:.2f} s after the signal")
    assert stopped["signal"] == "SIGTERM" and stopped["epoch"] == 2 and stopped["batch"] > 0
    assert stopped["seconds_to_checkpoint"] > 0
    record, _ = load_checkpoint(out, "torch")
    assert record["epoch"] == 1 and record["batch"] == stopped["batch"]
    deadline = time.monotonic() + 60  # the launcher has ended; its ranks go within seconds
    while pids_of(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_of(str(out)) == {}, "ranks left running after the launcher ended"
