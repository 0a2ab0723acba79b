"""docker/ cannot be built here (no Docker engine): lint the Dockerfiles with hadolint and check
that every image installs through scripts/setup.sh, the README's one install path."""
import re
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
    """The GPU image asks setup.sh for its GPU build (which sets HOROVOD_GPU_OPERATIONS=NCCL) with
    the GPU TensorFlow package, on a CUDA devel image (nvcc), and puts torch's NCCL on the loader
    path as setup.sh's hvdtrain-env.sh does."""
    text = (DOCKER / "Dockerfile.gpu").read_text()
    run = next(line for line in text.splitlines() if "bash scripts/setup.sh" in line)
    assert "HVDTRAIN_GPU=1" in run and "HVDTRAIN_TF_PACKAGE=tensorflow " in run
    assert re.search(r"^FROM nvidia/cuda:[0-9.]+-(cudnn-)?devel-ubuntu", text, re.MULTILINE)
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"^ENV LD_LIBRARY_PATH=/opt/hvdtrain/.venv/lib/python3.11/site-packages/"
                     r"nvidia/nccl/lib:", text, re.MULTILINE)


def _env_names(text):
    """The variables that the Dockerfile's ENV instructions set (continuation lines joined)."""
    joined = re.sub(r"\\\n", " ", text)
    names = []
    for line in joined.splitlines():
        if line.startswith("ENV "):
            names += re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", line[4:])
    return names


def test_gpu_image_keeps_no_credentials_in_its_environment():
    names = _env_names((DOCKER / "Dockerfile.gpu").read_text())
    assert "PATH" in names and "LD_LIBRARY_PATH" in names
    secret = re.compile(r"TOKEN|PASSWORD|SECRET|KEY|INDEX_URL|CREDENTIAL|AUTH", re.IGNORECASE)
    suspicious = [n for n in names if secret.search(n)]
    assert suspicious == []


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
