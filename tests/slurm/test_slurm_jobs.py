"""hvdtrain under a real one-node Slurm cluster (conftest.py): srun's ranks train like
horovodrun's, `hvdtrain launch` needs no hostfile inside salloc, and the preemption drill of the
job script users copy (slurm/train.sbatch): a signal mid-epoch, a checkpoint within a step, the job
requeued and resumed to the weights of an uninterrupted run, for both frameworks.

Numbers come from files the jobs write (metrics.json, checkpoints, per-task output files), never
from the launchers' forwarded output."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "slurm" / "train.sbatch"
TIMEOUT = 600
DRILL = ["--dataset", "synthetic", "--synthetic-samples", "6000", "--epochs", "3", "-k", "2",
         "--warmup-epochs", "1"]
# 4,800 training samples / (2 ranks x 16 x k=2) = 75 optimizer steps per epoch; the drilled
# job's steps from epoch 2 on take >= 0.04 s each (epoch 2 >= 3 s), so a signal sent 0.3 s
# after epoch 1 is recorded lands in epoch 2 on any machine. The math is unchanged.
SLOW_FROM_EPOCH_2 = ["--fault-slow-from", "75:0.04"]


def run(argv, env, cwd, check=True):
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {proc.returncode}\n--- stdout\n"
                    f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    return proc


def metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())


def weights(out, framework):
    """The newest checkpoint's weights, flat float64."""
    if framework == "torch":
        import torch
        ckpt = torch.load(Path(out) / "checkpoint.pt", weights_only=True)
        return np.concatenate([v.reshape(-1).double().numpy() for v in ckpt["model"].values()])
    with np.load(Path(out) / "checkpoint.npz", allow_pickle=False) as archive:
        return np.concatenate([archive[n].reshape(-1).astype(np.float64)
                               for n in sorted(archive.files) if n.startswith("model/")])


def job_state(env, job):
    """``(JobState, Restarts)`` from ``scontrol show job``."""
    text = run(["scontrol", "show", "job", "-o", job], env, "/").stdout
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    return fields.get("JobState"), int(fields.get("Restarts", 0))


def wait_state(env, job, states, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, restarts = job_state(env, job)
        if state in states:
            return state, restarts
        time.sleep(0.2)
    pytest.fail(f"job {job} not in {states} within {timeout} s (now {job_state(env, job)})")


def submit(env, cwd, out, *args, extra=()):
    """sbatch slurm/train.sbatch with its output directory ``out``; returns the job id."""
    proc = run(["sbatch", "--parsable", *extra, str(SBATCH), *args],
               {**env, "HVDTRAIN_OUTPUT_DIR": str(out)}, cwd)
    return proc.stdout.strip().split(";")[0]


def test_srun_ranks_train_like_horovodrun_and_only_rank_0_reports_errors(slurm_cluster,
                                                                          tmp_path):
    args = ["hvdtrain", "train", "--epochs", "2", "--no-progress"]
    run(["srun", "--mpi=pmix", "-n", "2", *args, "--output-dir", "srun"], slurm_cluster, tmp_path)
    run(["horovodrun", "-np", "2", "-H", "localhost:2", *args, "--output-dir", "hvd"],
        slurm_cluster, tmp_path)
    a, b = metrics(tmp_path / "srun"), metrics(tmp_path / "hvd")
    assert a["size"] == b["size"] == 2
    assert [e["test_accuracy"] for e in a["epochs"]] == [e["test_accuracy"] for e in b["epochs"]]
    assert [e["train_loss"] for e in a["epochs"]] == [e["train_loss"] for e in b["epochs"]]
    assert np.array_equal(weights(tmp_path / "srun", "torch"), weights(tmp_path / "hvd", "torch"))
    # Bad input under srun: each task's output in its own file; only rank 0 says it.
    proc = run(["srun", "--mpi=pmix", "-n", "2", "-o", "task-%t.txt", "hvdtrain", "train",
                "--epochs", "0", "--output-dir", "bad"], slurm_cluster, tmp_path, check=False)
    assert proc.returncode != 0
    said = [(tmp_path / f"task-{t}.txt").read_text() for t in (0, 1)]
    assert "hvdtrain: error: --epochs must be a whole number >= 1" in said[0]
    assert "error" not in said[1]


def test_launch_inside_salloc_takes_hosts_and_np_from_the_allocation(slurm_cluster, tmp_path):
    # horovodrun (the default launcher) gets -H <this host>:2 from the allocation.
    run(["salloc", "-n", "2", "hvdtrain", "launch", "--", "hvdtrain", "train", "--epochs", "1",
         "--no-progress", "--output-dir", "out"], slurm_cluster, tmp_path)
    m = metrics(tmp_path / "out")
    assert m["size"] == 2 and m["hosts"] == 1 and len(m["epochs"]) == 1


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory):
    """``reference(framework)``: the output directory of the uninterrupted DRILL job of
    ``framework`` through slurm/train.sbatch, submitted once per module and compared with by
    every drill of that framework (the USR1 and the SIGTERM drill share PyTorch's)."""
    done = {}

    def get(framework):
        if framework not in done:
            where = tmp_path_factory.mktemp(f"slurm-reference-{framework}")
            job = submit(slurm_cluster, where, where / "reference", "--framework", framework,
                         *DRILL)
            assert wait_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}) == \
                ("COMPLETED", 0)
            done[framework] = where / "reference"
        return done[framework]
    return get


def drill(env, tmp_path, reference, framework, sig, requeue):
    """The DRILL job signalled mid-epoch 2, beside its uninterrupted reference; returns
    (reference dir, drill dir, the job id, seconds from the signal until the job left
    RUNNING)."""
    args = ["--framework", framework, *DRILL]
    ref, out = reference(framework), tmp_path / "drill"
    # Steps from epoch 2 on take >= 0.04 s (75 steps an epoch: >= 3 s), so the signal lands in
    # epoch 2 on any machine (test_preemption.SLOW_FROM_EPOCH_2).
    job = submit(env, tmp_path, out, *args, *SLOW_FROM_EPOCH_2,
                 *([] if requeue else ["--no-requeue"]))
    deadline = time.monotonic() + TIMEOUT
    while not (out / "metrics.json").exists():  # epoch 1 is done
        assert time.monotonic() < deadline and job_state(env, job)[0] in ("PENDING", "RUNNING")
        time.sleep(0.05)
    time.sleep(0.3)  # into epoch 2
    signalled = time.monotonic()
    run(["scancel", f"--signal={sig}", job], env, tmp_path)
    while job_state(env, job)[0] == "RUNNING":
        time.sleep(0.05)
    return ref, out, job, time.monotonic() - signalled


# PyTorch only (#47): the requeue is shared code (hvdtrain.run.preempt.requeue, rank 0, either
# trainer); Keras's stop on SIGUSR1 mid-epoch and its resume to the same weights are asserted by
# tests/parallel/test_preemption.py (Keras gets SIGUSR1 there). The Keras drill took 99 s.
@pytest.mark.parametrize("framework", ["torch"])
def test_preemption_drill_usr1_requeues_and_resumes_to_the_same_weights(slurm_cluster, tmp_path,
                                                                        reference, framework):
    ref, out, job, seconds = drill(slurm_cluster, tmp_path, reference, framework, "USR1",
                                   requeue=True)
    stopped = metrics(out)["preempted"]  # written by the stopped run, before the requeue
    print(f"{framework}: {stopped}; the job left RUNNING {seconds:.2f} s after scancel")
    assert stopped["signal"] == "SIGUSR1" and stopped["epoch"] == 2 and stopped["batch"] > 0
    state, restarts = wait_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED"})
    assert (state, restarts) == ("COMPLETED", 1)
    m = metrics(out)
    assert m["preempted"] is None and m["resumed_from"]["batch"] == stopped["batch"]
    diff = np.abs(weights(out, framework) - weights(ref, framework)).max()
    print(f"{framework}: requeued and resumed vs uninterrupted: max |weight difference| {diff}")
    assert diff <= 1e-6
    assert [e["test_accuracy"] for e in m["epochs"]] == pytest.approx(
        [e["test_accuracy"] for e in metrics(ref)["epochs"]], abs=1e-9)


def test_sigterm_checkpoints_without_requeue_and_a_resubmission_resumes(slurm_cluster,
                                                                        tmp_path, reference):
    ref, out, job, seconds = drill(slurm_cluster, tmp_path, reference, "torch", "TERM",
                                   requeue=False)
    state, restarts = wait_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED"})
    assert restarts == 0 and state != "COMPLETED"  # exit 75: not a success, not requeued
    stopped = metrics(out)["preempted"]
    assert stopped["signal"] == "SIGTERM" and stopped["batch"] > 0
    print(f"SIGTERM: {stopped}; the job left RUNNING {seconds:.2f} s after scancel")
    job = submit(slurm_cluster, tmp_path, out, "--framework", "torch", *DRILL)
    assert wait_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}) == \
        ("COMPLETED", 0)
    assert np.abs(weights(out, "torch") - weights(ref, "torch")).max() <= 1e-6


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_scancel_of_a_job_launched_with_mpirun_ends_in_a_stop_checkpoint(slurm_cluster, tmp_path,
                                                                          launcher):
    # scancel signals every process of the job, mpirun included; mpirun hands SIGTERM to the
    # ranks and (Open MPI's default) SIGKILLs them 1 s later, before a step of 3 s and its
    # checkpoint are done. hvdtrain launch starts mpirun with SIGTERM blocked; under horovodrun
    # (/bin/sh -c mpirun, a shell that clears the mask) through its mpirun shim (#48).
    out = tmp_path / "drill"
    job = submit({**slurm_cluster, "HVDTRAIN_LAUNCHER": launcher}, tmp_path, out,
                 "--framework", "torch", *DRILL, "--fault-slow-from", "75:3", "--no-requeue")
    deadline = time.monotonic() + TIMEOUT
    while not (out / "metrics.json").exists():  # epoch 1 is done
        assert time.monotonic() < deadline and job_state(slurm_cluster, job)[0] in (
            "PENDING", "RUNNING")
        time.sleep(0.05)
    time.sleep(0.3)  # into epoch 2, whose steps take 3 s
    run(["scancel", job], slurm_cluster, tmp_path)
    state, restarts = wait_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED"})
    stopped = metrics(out)["preempted"]
    print(f"mpirun under scancel: {state}, {stopped}")
    assert stopped is not None, "the ranks were killed before their stop checkpoint"
    assert stopped["signal"] == "SIGTERM" and stopped["epoch"] == 2 and stopped["batch"] > 0
    import torch
    record = torch.load(out / "checkpoint.pt", weights_only=True)
    assert record["epoch"] == 1 and record["batch"] == stopped["batch"]
