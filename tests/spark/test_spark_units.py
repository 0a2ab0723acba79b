"""hvdtrain.spark without a cluster: the rank layout, the command line's checks before Spark starts,
and that the framework adapters never import an engine."""
import subprocess
import sys

from hvdtrain.spark import ranks
from hvdtrain.spark.__main__ import check_train_command


def test_ranks_are_contiguous_per_host_and_task_0_is_rank_0():
    slots = ranks.slot_plan(["b", "a", "b", "a", "c"])
    assert [s.rank for s in slots] == [0, 2, 1, 3, 4]  # b's tasks get 0, 1; a's 2, 3; c's 4
    assert [s.local_rank for s in slots] == [0, 0, 1, 1, 0]
    assert [s.local_size for s in slots] == [2, 2, 2, 2, 1]
    assert [s.cross_rank for s in slots] == [0, 1, 0, 1, 2]
    assert {s.size for s in slots} == {5}


def test_hvdtrain_train_options_are_checked_before_spark_starts():
    assert check_train_command(["hvdtrain", "train", "--dataset", "digits"]) is None
    assert check_train_command(["python", "train.py", "--whatever"]) is None
    assert "--epochs" in check_train_command(["hvdtrain", "train", "--epochs", "0"])
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.spark", "-np", "2", "--", "hvdtrain",
                           "train", "--no-such-option"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--no-such-option" in proc.stderr
    assert "SparkContext" not in proc.stderr and "starting" not in proc.stderr


def test_adapters_import_no_engine():
    code = ("import sys, hvdtrain, hvdtrain.torch, hvdtrain.keras, hvdtrain.spark; "
            "print(sorted(m for m in ('pyspark', 'py4j', 'ray') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
