import pytest

from hvdtrain.doctor import parse_check_build, problems

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


def test_build_without_pytorch_is_reported_with_the_fix():
    info = parse_check_build(FULL.replace("[X] PyTorch", "[ ] PyTorch"))
    (issue,) = problems(info)
    assert "without PyTorch support" in issue and "HOROVOD_WITH_PYTORCH=1" in issue


def test_build_without_controllers():
    text = FULL.replace("[X] MPI", "[ ] MPI").replace("[X] Gloo", "[ ] Gloo")
    assert any("no controller" in p for p in problems(parse_check_build(text)))


def test_not_check_build_output():
    with pytest.raises(ValueError, match="not the output of 'horovodrun --check-build'"):
        parse_check_build("command not found")
