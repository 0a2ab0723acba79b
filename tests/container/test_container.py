"""tests/container: the images for real, with podman and no image registry.

scripts/container_test.sh installs podman and podman-compose from Debian's packages when missing,
makes the base image with mmdebstrap when podman has none, builds docker/Dockerfile.cpu (the
host's pip settings and Horovod wheel cache lent read-only), runs `hvdtrain doctor` and the 2-rank
main job in the image, then the two-container ssh cluster of docker/compose.yaml, and writes
OUTDIR/summary.json. The test asserts on that file and on the runs' metrics.json, which the
containers wrote to host volumes (OUTDIR/main, OUTDIR/cluster).

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
TIMEOUT = 1800  # seconds: a first build (base image, stack, maybe Horovod) plus the three runs


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


def test_cpu_image_builds_and_trains_alone_and_as_a_two_container_cluster(tmp_path):
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

    # The runtime image: no compilers or build tools, no .git, no pip build argument kept.
    assert summary["runtime_build_tools"] == []
    assert summary["runtime_has_git_dir"] is False
    assert summary["runtime_pip_env"] == []
    assert summary["runtime_pip_history"] == []
    assert summary["image_bytes"] > 0 and summary["build_seconds"] >= 0
