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
    """The GPU image asks setup.sh for its GPU build (which sets HOROVOD_GPU_OPERATIONS=NCCL) on a
    CUDA devel image (nvcc), runs Keras on its PyTorch backend (the GPU build has no TensorFlow
    ops), and puts torch's NCCL on the loader path as setup.sh's hvdtrain-env.sh does."""
    text = (DOCKER / "Dockerfile.gpu").read_text()
    run = next(line for line in text.splitlines() if "bash scripts/setup.sh" in line)
    assert "HVDTRAIN_GPU=1" in run and "HVDTRAIN_TF_PACKAGE" not in run
    assert "KERAS_BACKEND" in _env_names(text) and "    KERAS_BACKEND=torch" in text
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


def test_mpijob_example_is_what_hvdtrain_launch_emits(capsys):
    """docker/mpijob.yaml is `hvdtrain launch --emit mpijob` with the options in its comments:
    the example cannot drift from what the command writes (and tests/container runs)."""
    text = (DOCKER / "mpijob.yaml").read_text()
    made_with = text.split("# Made with:\n#   hvdtrain ", 1)[1].split("\n", 1)[0]
    from hvdtrain.cli import main
    assert main(made_with.split()) == 0
    assert yaml.safe_load(capsys.readouterr().out) == yaml.safe_load(text)


def test_mpijob_runs_hvdtrain_with_horovods_mpirun_flags():
    job = yaml.safe_load((DOCKER / "mpijob.yaml").read_text())
    assert job["kind"] == "MPIJob" and job["spec"]["slotsPerWorker"] == 2
    specs = job["spec"]["mpiReplicaSpecs"]
    command = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    joined = " ".join(command)
    assert command[0] == "mpirun" and "-bind-to none -map-by slot" in joined
    assert "-np 4" in joined and specs["Worker"]["replicas"] * 2 == 4
    assert command[command.index("hvdtrain"):][:2] == ["hvdtrain", "train"]


def _dockerignored(path, patterns):
    """Whether docker's (and podman's) .dockerignore rules leave PATH out of the build context:
    a pattern matches the path or one of its parent directories; `*` stays within one path
    element, `**` crosses them; a later `!pattern` brings a path back."""
    def regex(pattern):
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.match(p) for p in prefixes):
            excluded = not keep
    return excluded


def test_dockerignore_leaves_out_the_hosts_venv_git_and_runs():
    """Without .dockerignore, `COPY . .` took the host's .venv into the image and the build failed
    (docs/stack.md, "Containers without a registry")."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for path in (".venv", ".venv/bin/python3.11", ".git", ".git/HEAD", "runs",
                 "runs/demo-torch/metrics.json", "hvdtrain/__pycache__/cli.cpython-311.pyc",
                 ".pytest_cache/v/cache/nodeids"):
        assert _dockerignored(path, patterns), path
    # What the images' build and runs need stays in.
    for path in ("setup.py", "README.md", "requirements/constraints.txt", "scripts/setup.sh",
                 "scripts/patch_horovod.sh", "hvdtrain/__init__.py", "hvdtrain/torch/__init__.py",
                 "hostfiles/two-hosts.txt", "tests/unit/test_docker.py", "docker/Dockerfile.cpu"):
        assert not _dockerignored(path, patterns), path


def _stages(text):
    """The Dockerfile's stages: [(FROM line, the lines up to the next FROM)], comments dropped."""
    stages = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if line.startswith("FROM "):
            stages.append((line, []))
        elif stages and line.strip() and not line.lstrip().startswith("#"):
            stages[-1][1].append(line)
    return stages


def _apt_packages(lines):
    packages = []
    for line in lines:
        for m in re.finditer(r"apt-get install ([^&]*)", line):
            packages += [w for w in m.group(1).split() if not w.startswith("-")]
    return packages


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_runtime_stage_has_the_venv_and_no_build_tools_or_build_arguments(name):
    """Multi-stage: setup.sh builds in the first stage; the image is the last one, which gets the
    venv at the path it was made for and installs runtime packages only."""
    stages = _stages((DOCKER / name).read_text())
    assert len(stages) == 2, [frm for frm, _ in stages]
    (build_from, build), (runtime_from, runtime) = stages
    assert build_from.endswith(" AS build") and runtime_from.endswith(" AS runtime")
    assert any("bash scripts/setup.sh" in line for line in build)
    assert not any("scripts/setup.sh" in line for line in runtime)
    assert "COPY --from=build /opt/hvdtrain/.venv /opt/hvdtrain/.venv" in runtime
    assert "WORKDIR /opt/hvdtrain" in build and "WORKDIR /opt/hvdtrain" in runtime
    packages = _apt_packages(runtime)
    assert {"openmpi-bin", "openssh-client", "openssh-server"} <= set(packages)
    tools = [p for p in packages
             if p in {"g++", "gcc", "make", "cmake", "git", "build-essential"} or p.endswith("-dev")]
    assert tools == []
    assert not any(line.startswith("ARG PIP_") for line in runtime)
    assert not [n for n in _env_names((DOCKER / name).read_text()) if n.startswith("PIP_")]
    if name == "Dockerfile.cpu":  # the venv's python is the base image's: the same base
        assert build_from.split()[1] == runtime_from.split()[1]
    else:  # the same CUDA and Ubuntu, devel to build, runtime to run
        assert build_from.split()[1].replace("-devel-", "-runtime-") == runtime_from.split()[1]


def test_compose_waits_for_node2s_sshd_and_ends_with_node1():
    text = (DOCKER / "compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    # No one-shot service: its exit would end `up --abort-on-container-exit` early.
    assert set(services) == {"node1", "node2"}
    assert services["node1"]["depends_on"]["node2"]["condition"] == "service_healthy"
    assert "ssh-keyscan" in " ".join(services["node2"]["healthcheck"]["test"])  # sshd answers
    assert "ssh-keygen" in services["node2"]["command"]
    assert "--exit-code-from node1" in text and "--abort-on-container-exit" not in text
    assert "--output-dir /out" in services["node1"]["command"]
    assert any(v.endswith(":/out") for v in services["node1"]["volumes"])


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_build_stage_copies_what_setup_sh_reads(name):
    """The build stage runs setup.sh before the rest of the project is copied (so that editing the
    code does not rebuild the stack): every file setup.sh reads from the checkout must be there."""
    (_, build), _ = _stages((DOCKER / name).read_text())
    copied = []
    for line in build:
        if line.startswith("COPY ") and "--from" not in line:
            copied += line.split()[1:-1]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    read = set(re.findall(r"\$ROOT/([A-Za-z0-9_./-]+)", setup)) - {".venv"}  # .venv: its output
    assert {"requirements/constraints.txt", "scripts/patch_horovod.sh", "setup.py"} <= read
    for path in sorted(read | {"scripts/setup.sh", "hvdtrain/__init__.py"}):
        assert any(path == c or (c.endswith("/") and path.startswith(c)) for c in copied), path
