"""hvdtrain.ray's pieces that need no cluster: the restarted command, the checkpoint files that go
to Ray Train, the driver's checks, and that nothing imports ray before it is used."""
import subprocess
import sys

import pytest

pytest.importorskip("ray.train", reason="needs ray[train] (HVDTRAIN_ENGINES=ray bash "
                    "scripts/setup_engines.sh)")

from hvdtrain.launch.engine_args import train_config  # noqa: E402
from hvdtrain.ray.job import checkpoint_files, restart_argv  # noqa: E402

TRAIN = ["hvdtrain", "train", "--dataset", "digits", "--output-dir", "runs/x"]


def test_a_restarted_train_command_resumes_auto():
    assert restart_argv(TRAIN, 0) == TRAIN
    assert restart_argv(TRAIN, 1) == TRAIN + ["--resume", "auto"]
    assert restart_argv(TRAIN + ["--resume", "yes"], 2) == TRAIN + ["--resume", "yes"]
    assert restart_argv(TRAIN + ["--resume=auto"], 1) == TRAIN + ["--resume=auto"]
    assert restart_argv(["python", "train.py"], 1) == ["python", "train.py"]


def test_the_output_dir_is_read_as_hvdtrain_train_reads_it():
    # #48 item 2: the directory rank 0 reports from (final numbers, last checkpoint) is the one
    # hvdtrain train writes: its default, an abbreviation argparse accepts, the = form.
    assert str(train_config(TRAIN).output_dir) == "runs/x"
    assert str(train_config(["hvdtrain", "train", "--output-dir=a"]).output_dir) == "a"
    assert str(train_config(["hvdtrain", "train", "--output", "b"]).output_dir) == "b"
    assert str(train_config(["hvdtrain", "train"]).output_dir) == "runs/latest"
    assert train_config(["python", "train.py", "--output-dir", "c"]) is None


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


def _raised(outer, cause):
    try:
        raise outer from cause
    except type(outer) as exc:
        return exc


def test_a_refused_connection_says_what_to_set(monkeypatch):
    # ray.init passes the GCS client's AuthenticationError on as the text of a RuntimeError.
    from hvdtrain.ray.__main__ import connect_error
    refused = _raised(ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"),
                      RuntimeError("Failed to connect to GCS. Last connection error: Traceback"
                                   "\nray.exceptions.AuthenticationError: RPC error: "
                                   "InvalidAuthToken: Authentication token is missing"))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    said = connect_error(refused, "10.0.0.1:6379")
    assert said.startswith("the Ray cluster at 10.0.0.1:6379 runs with token authentication")
    assert "Run with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token" in said
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert connect_error(refused, "10.0.0.1:6379").startswith(
        "the Ray cluster at 10.0.0.1:6379 refused this driver's token: run with the cluster's")
    down = _raised(ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"),
                   RuntimeError("Failed to connect to GCS at address 10.0.0.1:6379 within 20 s"))
    assert connect_error(down, None) == (
        "cannot connect to a Ray cluster: Failed to connect to Ray cluster at 10.0.0.1:6379; "
        "Failed to connect to GCS at address 10.0.0.1:6379 within 20 s")
