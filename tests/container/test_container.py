"""tests/container: the images for real, with podman and no image registry.

scripts/container_test.sh installs podman and podman-compose from Debian's packages when missing,
makes the base image with mmdebstrap when podman has none, builds docker/Dockerfile.cpu (the
host's pip settings and Horovod wheel cache lent read-only), runs `hvdtrain doctor` and the 2-rank
main job in the image, the two-container ssh cluster of docker/compose.yaml, and the MPIJob that
`hvdtrain launch --emit mpijob` writes, run as Kubeflow's MPI Operator would run it
(scripts/mpijob_contract.py) beside a horovodrun reference, and writes OUTDIR/summary.json. The
test asserts on that file and on the runs' metrics.json, which the containers wrote to host
volumes (OUTDIR/main, OUTDIR/cluster, OUTDIR/mpijob-runs, OUTDIR/reference).

Skipped, with the script's reason, only where podman, podman-compose or mmdebstrap cannot be
installed (the script exits 3: not root, no apt-get, apt-get failed); any other failure fails.
The first run takes about 13 minutes on 2 cores (build included), a rerun with the image's layers
cached about 3.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "container_test.sh"
CANNOT_INSTALL = 3  # the script's exit status when podman & co. are missing and cannot be installed
# seconds: a first build (base image, stack, maybe Horovod; 13 minutes) plus the seven runs (main
# job, cluster, reference, MPIJob, drill: 556 s in all with the build cached, on a busy machine)
TIMEOUT = 2700


def _run_script(out: Path) -> tuple[int, list[str]]:
    """Run the script, echoing its output as it comes (pytest -s shows it); its status and lines.
    On a timeout it gets SIGTERM first, so that its trap removes what it started."""
    proc = subprocess.Popen(["bash", str(SCRIPT), str(out)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        pytest.fail(f"scripts/container_test.sh ran past {TIMEOUT} s; its output:\n"
                    + "\n".join(lines[-60:]), pytrace=False)
    reader.join(timeout=10)
    return proc.returncode, lines


def _metrics(run_dir: Path) -> dict:
    path = run_dir / "metrics.json"
    assert path.is_file(), f"no {path}: the container did not write its run to the host volume"
    return json.loads(path.read_text())


def test_cpu_image_builds_and_trains_alone_as_a_cluster_and_as_an_mpijob(tmp_path):
    out = tmp_path / "container_test"
    rc, lines = _run_script(out)
    if rc == CANNOT_INSTALL:
        reasons = [line for line in lines if "cannot install" in line]
        pytest.skip(reasons[-1] if reasons else "scripts/container_test.sh: cannot install podman")
    assert rc == 0, (f"scripts/container_test.sh {out} exited {rc}; its output:\n"
                     + "\n".join(lines[-60:]))

    summary = json.loads((out / "summary.json").read_text())
    print(json.dumps(summary, indent=2, sort_keys=True))
    assert summary["doctor_exit"] == 0

    main = _metrics(out / "main")
    assert summary["main_exit"] == 0
    assert main["size"] == 2 and main["hosts"] == 1
    # The README's main job: MNIST, cached in the image at build time (no download when it runs).
    assert main["dataset"] == "mnist" and main["train_samples"] == 60000
    # The recipe's 4 epochs reach 98.9 % (99.02 % seen, as under horovodrun on the host); the engine
    # suites run one epoch of it and lean on this check for the PyTorch figure.
    assert main["final_test_accuracy"] >= 0.989, main["final_test_accuracy"]
    assert summary["main"]["final_test_accuracy"] == main["final_test_accuracy"]

    cluster = _metrics(out / "cluster")
    assert summary["cluster_node1_exit"] == 0
    assert cluster["size"] == 4 and cluster["hosts"] == 2, (cluster["size"], cluster["hosts"])
    assert cluster["final_test_accuracy"] >= 0.9, cluster["final_test_accuracy"]

    # Kubernetes, as Kubeflow's MPI Operator would run the MPIJob that `hvdtrain launch --emit
    # mpijob` wrote (scripts/mpijob_contract.py): two worker pods, then the launcher's mpirun
    # over ssh with the operator's key; the same numbers as horovodrun -np 2 in one container.
    assert summary["mpijob_exit"] == 0 and summary["reference_exit"] == 0
    contract = json.loads((out / "mpijob" / "contract.json").read_text())
    assert contract["launcher_exit"] == 0
    assert contract["launcher_env"]["OMPI_MCA_orte_default_hostfile"] == "/etc/mpi/hostfile"
    assert {"id_rsa", "id_rsa.pub", "authorized_keys"} <= set(
        contract["launcher_mounts"]["/root/.ssh"])
    assert contract["launcher_command"][:1] == ["mpirun"]
    assert contract["launcher_command"][-2:] == ["--resume", "auto"]
    job, ref = _metrics(out / "mpijob-runs"), _metrics(out / "reference")
    assert (job["size"], job["hosts"]) == (2, 2) and (ref["size"], ref["hosts"]) == (2, 1)
    assert len(job["epochs"]) == len(ref["epochs"]) == 4
    for got, want in zip(job["epochs"], ref["epochs"]):
        for key in ("train_loss", "test_accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (key, got, want)
    assert job["final_test_accuracy"] == ref["final_test_accuracy"] >= 0.9

    # The eviction drill: worker 1 stopped as a node drain stops a pod, after epoch 1's checkpoint.
    assert summary["evict_exit"] == 0
    drill = json.loads((out / "evict" / "contract.json").read_text())
    first, again = drill["attempts"]  # the launcher, and the one started after it failed
    evicted = first["evicted"]
    # Its hvdtrain worker ended after its rank had, well within the grace period (no SIGKILL).
    assert evicted["exit"] == 0 and evicted["stop_seconds"] < drill["grace_period_s"], evicted
    assert first["launcher_exit"] == 75 and again["launcher_exit"] == 0  # EX_TEMPFAIL, then done
    stopped = json.loads((out / "evict" / "hvdtrain-runs-metrics-0.json").read_text())
    # Mid-epoch, after epoch 1's checkpoint (epoch 2 at least: from step 45 each step takes
    # >= 0.05 s, and the eviction comes as soon as that checkpoint exists).
    assert stopped["preempted"]["signal"] == "SIGTERM" and stopped["preempted"]["epoch"] >= 2
    resumed = _metrics(out / "evict-runs")
    assert resumed["preempted"] is None
    assert resumed["resumed_from"]["epoch"] == stopped["preempted"]["epoch"] - 1
    assert resumed["resumed_from"]["batch"] == stopped["preempted"]["batch"] > 0
    # Resumed to what the uninterrupted MPIJob trained: the same epochs, the same weights.
    assert len(resumed["epochs"]) == 4
    for got, want in zip(resumed["epochs"], job["epochs"]):
        for key in ("train_loss", "test_accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (key, got, want)
    import torch
    a = torch.load(out / "evict-runs" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(out / "mpijob-runs" / "checkpoint.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) <= 1e-6

    # The runtime image: no compilers or build tools, no .git, no pip build argument kept.
    assert summary["runtime_build_tools"] == []
    assert summary["runtime_has_git_dir"] is False
    assert summary["runtime_pip_env"] == []
    assert summary["runtime_pip_history"] == []
    assert summary["image_bytes"] > 0 and summary["build_seconds"] >= 0
