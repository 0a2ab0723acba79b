"""Faults: under real `horovodrun` jobs a killed rank, a killed job resumed, a resume at another
world size and data that does not divide among 3 ranks; in the session's rank pools (`hvdtrain
train` inside 2 long-lived ranks) a corrupt checkpoint, a NaN on one rank and resumes with another
k; both trainers where both apply."""
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs import Console, horovodrun, job_env, run

CRASH_BOUND_S = 60  # the job must be gone this long after a rank dies (measured: see README)
SLOW = ["--dataset", "synthetic", "--synthetic-samples", "20000", "--no-progress"]
FRAMEWORKS = pytest.mark.parametrize("framework", ["torch", "keras"])
CHECKPOINT = {"torch": ("checkpoint.pt", "checkpoint.prev.pt"),
              "keras": ("checkpoint.npz", "checkpoint.prev.npz")}


def train(out, *args, np_=2, framework="torch"):
    return horovodrun(np_, "hvdtrain", "train", "--framework", framework, "--output-dir",
                      str(out), *args)


def load_checkpoint(out, framework):
    """``(record, flat float64 weights)`` of the run's newest checkpoint, read the way hvdtrain
    reads it (torch: weights_only=True; keras: no pickle)."""
    path = Path(out) / CHECKPOINT[framework][0]
    if framework == "torch":
        ckpt = torch.load(path, weights_only=True)
        weights = [v.reshape(-1).double().numpy() for v in ckpt["model"].values()]
        return ckpt, np.concatenate(weights)
    with np.load(path, allow_pickle=False) as archive:
        record = json.loads(str(archive["record"]))
        weights = [archive[n].reshape(-1).astype(np.float64)
                   for n in sorted(archive.files) if n.startswith("model/")]
    return record, np.concatenate(weights)


def metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())


def wait_for_epoch(out, epoch, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the expected epoch"
        try:
            if len(metrics(out)["epochs"]) >= epoch:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    pytest.fail(f"no epoch {epoch} within {timeout} s")


def pids_of(marker):
    """PIDs whose command line contains ``marker``, with their OMPI rank."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker not in (d / "cmdline").read_bytes().decode(errors="replace"):
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((e.split(b"=", 1)[1].decode() for e in env
                     if e.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        found[int(d.name)] = rank
    return found


def start(argv):
    return subprocess.Popen(argv, env=job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@FRAMEWORKS
def test_killed_rank_ends_the_job_with_its_rank_named(tmp_path, framework):
    proc = start(train(tmp_path, "--epochs", "200", *SLOW, framework=framework))
    try:
        wait_for_epoch(tmp_path, 1, proc)
        victim = [pid for pid, rank in pids_of(str(tmp_path)).items() if rank == "1"]
        assert len(victim) == 1
        os.kill(victim[0], signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=CRASH_BOUND_S)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"job ended {elapsed:.1f} s after rank 1 was killed")
    assert proc.returncode != 0
    seen = Console(output).text
    assert "rank 1" in seen and "signal 9" in seen, output[-2000:]
    deadline = time.monotonic() + 60  # the launcher has ended; its ranks go within seconds
    while pids_of(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_of(str(tmp_path)) == {}, "processes were left behind"
    record, weights = load_checkpoint(tmp_path, framework)
    assert record["epoch"] >= 1 and record["size"] == 2 and np.isfinite(weights).all()


@FRAMEWORKS
def test_job_killed_after_epoch_2_resumes_to_the_same_weights(train_here, tmp_path, framework):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    args = ["--dataset", "synthetic", "--synthetic-samples", "10000", "--no-progress",
            "--epochs", "4", "-k", "2"]
    train_here(whole, *args, framework=framework)  # the uninterrupted run, in the pool
    # 8,000 training samples / (2 ranks x 16 x k=2) = 125 optimizer steps per epoch: from the
    # first step of epoch 3 (step 250) each step takes >= 0.05 s, so epoch 3 lasts >= 6 s on any
    # machine, and the kill below lands in it (an epoch of 10,000 samples took 0.5 s on a fast
    # machine, and the ranks used to finish the run before they died).
    proc = start(train(broken, *args, "--fault-slow-from", "250:0.05", framework=framework))
    try:
        wait_for_epoch(broken, 2, proc)
        # A node failure: the launcher and the ranks die together (each rank runs in a process
        # group of its own, so killing the launcher's group alone leaves them training on).
        ranks = [pid for pid, rank in pids_of(str(broken)).items() if rank is not None]
        assert len(ranks) == 2, ranks
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(metrics(broken)["epochs"]) == 2
    train_here(broken, *args, "--resume", framework=framework)  # the restart: in the pool too
    resumed, reference = metrics(broken), metrics(whole)
    assert resumed["resumed_from"]["epoch"] == 2 and len(resumed["epochs"]) == 4
    diff = np.abs(load_checkpoint(broken, framework)[1] - load_checkpoint(whole, framework)[1])
    assert diff.max() <= 1e-6
    for a, b in zip(resumed["epochs"], reference["epochs"]):
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)


@FRAMEWORKS
def test_resume_at_another_world_size_rescales_the_lr(train_here, tmp_path, framework):
    train_here(tmp_path, "--epochs", "2", "--warmup-epochs", "0", framework=framework)
    run(train(tmp_path, "--epochs", "3", "--warmup-epochs", "0", "--resume", "--no-progress",
              np_=1, framework=framework))
    m = metrics(tmp_path)
    assert m["resumed_from"] == {"epoch": 2, "size": 2, "global_batch": 32, "batch": 0}
    assert m["size"] == 1 and m["global_batch"] == 16
    lrs = [e["lr"] for e in m["epochs"]]
    assert lrs[:2] == pytest.approx([0.04, 0.04]) and lrs[2] == pytest.approx(0.02)


@FRAMEWORKS
def test_corrupt_checkpoint_falls_back_to_the_previous_one(train_here, tmp_path, framework):
    newest, previous = CHECKPOINT[framework]
    train_here(tmp_path, "--epochs", "3", framework=framework)
    ckpt = tmp_path / newest
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])  # truncated
    proc = train_here(tmp_path, "--epochs", "4", "--resume", framework=framework)
    assert f"{newest} is unreadable" in proc.text
    m = metrics(tmp_path)
    assert m["resumed_from"]["epoch"] == 2 and len(m["epochs"]) == 4
    # Neither file usable: a clear error, non-zero exit, nothing trained.
    (tmp_path / newest).write_bytes(b"garbage")
    (tmp_path / previous).write_bytes(b"garbage")
    proc = train_here(tmp_path, "--epochs", "5", "--resume", framework=framework, check=False)
    assert proc.returncode != 0
    assert "--resume: no usable checkpoint" in proc.text


@FRAMEWORKS
def test_nan_on_one_rank_skips_the_step_on_all_ranks(train_here, tmp_path, framework):
    proc = train_here(tmp_path, "--epochs", "2", "--fault-nan-at", "1:5", framework=framework)
    assert "non-finite loss on rank(s) [1] at optimizer step 5" in proc.text
    m = metrics(tmp_path)
    assert m["skipped_steps"] == 1 and m["ranks_agree"] is True
    assert all(np.isfinite(e["train_loss"]) for e in m["epochs"])
    assert m["epochs"][0]["optimizer_steps"] == 44  # 45 per epoch, one skipped
    # Throughput counts every sample trained on, the skipped step's too (before, the PyTorch
    # trainer counted only finite ones, Keras all): both epochs processed the same samples.
    processed = [e["samples_per_sec"] * e["seconds"] for e in m["epochs"]]
    assert processed[0] == pytest.approx(processed[1], rel=1e-9)


@FRAMEWORKS
def test_nan_with_stop_ends_the_job_with_a_clear_message(train_here, tmp_path, framework):
    proc = train_here(tmp_path, "--epochs", "2", "-k", "2", "--fault-nan-at", "0:3",
                      "--on-nonfinite", "stop", framework=framework, check=False)
    assert proc.codes == {0: 1, 1: 1}  # every rank stops with exit status 1
    assert "non-finite loss on rank(s) [0] at optimizer step 3" in proc.text
    assert "--on-nonfinite stop" in proc.text
    # Rank 0 recorded the stop before the ranks stopped together (no epoch was finished).
    m = metrics(tmp_path)
    assert m["nonfinite_stop"].startswith("non-finite loss on rank(s) [0] at optimizer step 3")
    assert m["nonfinite_stop"].endswith("stopped (--on-nonfinite stop). Lower --lr or check the data")
    assert m["epochs"] == [] and m["diverged"] is None
    # The counters are recorded in the first epoch too (before: the PyTorch trainer wrote
    # skipped_steps null and no overflow_steps when it stopped before an epoch's end).
    assert m["skipped_steps"] == 0 and m["overflow_steps"] == 0 and m["elastic"] is False


@FRAMEWORKS
def test_data_that_does_not_divide_among_ranks(tmp_path, framework):
    # 1001 samples over 3 ranks (oversubscribed). torch: DistributedSampler pads to equal shards;
    # keras: every rank runs the same number of micro-batches of its repeated shard.
    run(train(tmp_path, "--dataset", "synthetic", "--synthetic-samples", "1001", "--epochs", "2",
              "--no-progress", np_=3, framework=framework))
    m = metrics(tmp_path)
    assert m["size"] == 3 and m["ranks_agree"] is True and len(m["epochs"]) == 2


def test_keras_torch_backend_nan_with_accumulation_skips_one_step_and_trains_on(train_here,
                                                                               tmp_path):
    # The torch backend resets Keras's gradient accumulators by multiplying them by 0, which
    # keeps a NaN; the skipped step must leave them at 0, or every later step would be skipped.
    proc = train_here(tmp_path, "--epochs", "3", "-k", "2", "--fault-nan-at", "1:5",
                      framework="keras", backend="torch")
    assert "non-finite loss on rank(s) [1] at optimizer step 5" in proc.text
    m = metrics(tmp_path)
    assert m["versions"]["keras_backend"] == "torch"
    assert m["skipped_steps"] == 1 and m["ranks_agree"] is True
    # 718 samples per rank -> 45 batches of 16 -> 44 micro-batches = 22 steps, one skipped.
    assert [e["optimizer_steps"] for e in m["epochs"]] == [21, 22, 22]
    accuracy = [e["test_accuracy"] for e in m["epochs"]]  # it goes on learning after the skip
    assert accuracy[0] < accuracy[1] < accuracy[2] and accuracy[2] > 0.6


def test_keras_resume_with_another_k_starts_whole_groups(train_here, tmp_path):
    # Before: the micro-batch counter of a -k 2 checkpoint (44 micro-batches) was kept under
    # -k 3, so the first resumed step applied one micro-batch's gradient / 3 and the run ended
    # in the middle of a group: 29 optimizer steps, accumulators not empty.
    train_here(tmp_path, "--epochs", "1", "-k", "2", framework="keras")
    train_here(tmp_path, "--epochs", "2", "-k", "3", "--resume", framework="keras")
    m = metrics(tmp_path)
    assert m["steps_per_epoch"] == 15  # 45 micro-batches of k=3 per epoch
    record, _ = load_checkpoint(tmp_path, "keras")
    assert record["step"] == 2 * 15
    assert [e["optimizer_steps"] for e in m["epochs"]] == [22, 15]
