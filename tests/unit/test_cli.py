"""Bad input to `hvdtrain train` fails before any framework or Horovod is loaded."""
import json
import subprocess
import sys

import pytest

PROBE = ("import json, sys; from hvdtrain.cli import main; rc = main(sys.argv[1:]); "
         "print(json.dumps({'rc': rc, 'loaded': sorted(m for m in ('torch', 'tensorflow', "
         "'horovod') if m in sys.modules)}))")


def train(tmp_path, *args):
    argv = [sys.executable, "-c", PROBE, "train", "--output-dir", str(tmp_path / "out"), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--backward-passes-per-step", "0"], "--backward-passes-per-step must be a whole number >= 1; got 0"),
    (["--batch-size", "0"], "--batch-size must be a whole number >= 1; got 0"),
    (["--framework", "mxnet"], "--framework must be one of torch, keras; got 'mxnet'"),
    (["--dataset", "cifar"], "--dataset must be one of digits, synthetic; got 'cifar'"),
    (["--output-dir", "/proc/nope"], "--output-dir '/proc/nope' is not writable"),
])
def test_bad_input_fails_before_any_work(tmp_path, args, message):
    result, stderr = train(tmp_path, *args)
    assert result == {"rc": 2, "loaded": []}
    assert f"hvdtrain: error: {message}" in stderr


def test_non_integer_option_is_rejected_by_the_parser(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.cli", "train", "--epochs", "two"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--epochs: invalid int value: 'two'" in proc.stderr
