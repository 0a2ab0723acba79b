"""docker/ cannot be built here (no Docker engine): lint the Dockerfiles with hadolint and check
that every image installs through scripts/setup.sh, the README's one install path."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
HADOLINT = Path(sys.executable).parent / "hadolint"


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_hadolint_passes(name):
    proc = subprocess.run([str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"),
                           str(DOCKER / name)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && apt-get install -y gcc\n")
    proc = subprocess.run([str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # 'latest' tag


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_images_use_the_same_setup_script(name):
    text = (DOCKER / name).read_text()
    assert "bash scripts/setup.sh" in text
    assert "pip install" not in text  # everything goes through setup.sh
    makefile = (ROOT / "Makefile").read_text()
    assert "bash scripts/setup.sh" in makefile


def test_gpu_image_builds_horovod_with_nccl():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in text and "nvidia/cuda" in text
    assert "HOROVOD_GPU_OPERATIONS" in (ROOT / "scripts" / "setup.sh").read_text()


def test_compose_is_a_two_node_cluster_over_ssh():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"node1", "node2"} <= set(services)
    assert "sshd" in services["node2"]["command"]
    launch = services["node1"]["command"]
    assert "hvdtrain launch --hostfile hostfiles/two-hosts.txt -np 4" in launch
    assert (ROOT / "hostfiles" / "two-hosts.txt").read_text().split() == [
        "node1", "slots=2", "node2", "slots=2"]


def test_mpijob_runs_hvdtrain_with_horovods_mpirun_flags():
    job = yaml.safe_load((DOCKER / "mpijob.yaml").read_text())
    assert job["kind"] == "MPIJob" and job["spec"]["slotsPerWorker"] == 2
    specs = job["spec"]["mpiReplicaSpecs"]
    command = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    joined = " ".join(command)
    assert command[0] == "mpirun" and "-bind-to none -map-by slot" in joined
    assert "-np 4" in joined and specs["Worker"]["replicas"] * 2 == 4
    assert command[command.index("hvdtrain"):][:2] == ["hvdtrain", "train"]
