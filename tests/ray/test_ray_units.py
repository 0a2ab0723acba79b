"""hvdtrain.ray's pieces that need no cluster: the restarted command, the checkpoint files that go
to Ray Train, the driver's checks, and that nothing imports ray before it is used."""
import subprocess
import sys

import pytest

pytest.importorskip("ray.train", reason="needs ray[train] (HVDTRAIN_ENGINES=ray bash "
                    "scripts/setup_engines.sh)")

from hvdtrain.ray.job import checkpoint_files, option_value, restart_argv  # noqa: E402

TRAIN = ["hvdtrain", "train", "--dataset", "digits", "--output-dir", "runs/x"]


def test_a_restarted_train_command_resumes_auto():
    assert restart_argv(TRAIN, 0) == TRAIN
    assert restart_argv(TRAIN, 1) == TRAIN + ["--resume", "auto"]
    assert restart_argv(TRAIN + ["--resume", "yes"], 2) == TRAIN + ["--resume", "yes"]
    assert restart_argv(TRAIN + ["--resume=auto"], 1) == TRAIN + ["--resume=auto"]
    assert restart_argv(["python", "train.py"], 1) == ["python", "train.py"]
    assert option_value(TRAIN, "--output-dir") == "runs/x"
    assert option_value(["hvdtrain", "train", "--output-dir=a"], "--output-dir") == "a"
    assert option_value(TRAIN, "--epochs") is None


def test_checkpoint_files_are_the_last_checkpoint_and_metrics(tmp_path):
    for name in ("checkpoint.pt", "checkpoint.prev.pt", "metrics.json", "checkpoint.npz",
                 "checkpoint.prev.npz", "checkpoint.weights.h5", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "tensorboard").mkdir()
    assert [f.name for f in checkpoint_files(tmp_path)] == [
        "checkpoint.npz", "checkpoint.pt", "checkpoint.weights.h5", "metrics.json"]


def test_importing_hvdtrain_ray_imports_no_ray_and_bad_options_exit_2():
    code = "import sys, hvdtrain, hvdtrain.ray; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.ray", "-np", "2", "--", "hvdtrain",
                           "train", "--epochs", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--epochs must be a whole number >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.ray", "-np", "0", "--", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "-np must be >= 1" in proc.stderr
