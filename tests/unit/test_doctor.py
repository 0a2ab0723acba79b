import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.doctor import notes, parse_check_build, problems

FULL = """Horovod v0.28.1:

Available Frameworks:
    [X] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo
"""


def test_parse_full_build():
    info = parse_check_build(FULL)
    assert info.version == "0.28.1"
    assert info.available("Frameworks") == ["TensorFlow", "PyTorch"]
    assert info.available("Controllers") == ["MPI", "Gloo"]
    assert info.available("Tensor Operations") == ["MPI", "Gloo"]
    assert problems(info) == []


def test_build_with_pytorch_only_is_usable_and_says_what_keras_needs():
    info = parse_check_build(FULL.replace("[X] TensorFlow", "[ ] TensorFlow"))
    assert problems(info) == []
    (note,) = notes(info)
    assert "--framework keras will not run" in note and "HOROVOD_WITH_TENSORFLOW=1" in note


def test_build_without_any_framework_is_reported_with_the_fix():
    text = FULL.replace("[X] PyTorch", "[ ] PyTorch").replace("[X] TensorFlow", "[ ] TensorFlow")
    (issue,) = problems(parse_check_build(text))
    assert "without PyTorch or TensorFlow support" in issue
    assert "HOROVOD_WITH_PYTORCH=1" in issue and "HOROVOD_WITH_TENSORFLOW=1" in issue


def test_build_without_controllers():
    text = FULL.replace("[X] MPI", "[ ] MPI").replace("[X] Gloo", "[ ] Gloo")
    assert any("no controller" in p for p in problems(parse_check_build(text)))


def test_not_check_build_output():
    with pytest.raises(ValueError, match="not the output of 'horovodrun --check-build'"):
        parse_check_build("command not found")


def _doctor(env_path):
    exe = Path(sys.executable).parent / "hvdtrain"
    env = dict(os.environ, PATH=env_path)
    return subprocess.run([str(exe), "doctor"], capture_output=True, text=True, env=env,
                          timeout=300)


def test_doctor_on_this_machine_reports_a_usable_build():
    proc = _doctor(f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    assert "Horovod:            0.28.1" in proc.stdout
    assert "TensorFlow, PyTorch" in proc.stdout and "MPI, Gloo" in proc.stdout
    assert "Open MPI" in proc.stdout and "status:             ok" in proc.stdout


def _fake_horovodrun(tmp_path, text):
    """A horovodrun on PATH whose --check-build prints ``text``."""
    fake = tmp_path / "horovodrun"
    fake.write_text("#!/bin/sh\ncat <<'OUT'\n" + text + "OUT\n")
    fake.chmod(0o755)
    return f"{tmp_path}{os.pathsep}{os.environ['PATH']}"


def test_doctor_passes_a_pytorch_only_build_with_a_note(tmp_path):
    proc = _doctor(_fake_horovodrun(tmp_path, FULL.replace("[X] TensorFlow", "[ ] TensorFlow")))
    assert proc.returncode == 0, proc.stderr
    assert "--framework keras will not run" in proc.stderr
    assert "status:             ok" in proc.stdout


def test_doctor_fails_on_a_build_without_frameworks(tmp_path):
    text = FULL.replace("[X] PyTorch", "[ ] PyTorch").replace("[X] TensorFlow", "[ ] TensorFlow")
    proc = _doctor(_fake_horovodrun(tmp_path, text))
    assert proc.returncode == 1
    assert "Horovod was built without PyTorch or TensorFlow support" in proc.stderr
    assert "status:             NOT usable" in proc.stdout
