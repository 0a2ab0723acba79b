"""hvdtrain.spark without a cluster: the rank layout, the command line's checks before Spark starts,
and that the framework adapters never import an engine."""
import os
import subprocess
import sys

import pytest

from hvdtrain.launch import ranks
from hvdtrain.launch.engine_args import check_train_command, engine_refusal
from leftovers import left_after  # tests/leftovers.py


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


def test_engines_refuse_elastic_before_they_start(tmp_path):
    # Spark and Ray start a fixed set of ranks: before, `hvdtrain train --elastic` trained there at
    # a fixed size with elastic mode's limits, and Ray's restart added --resume auto, which
    # --elastic refuses (the ranks failed on a flag the user never typed).
    elastic = ["hvdtrain", "train", "--dataset", "digits", "--elastic"]
    assert check_train_command(elastic) is None  # hvdtrain launch --elastic's command
    for engine in ("Spark", "Ray"):
        problem = check_train_command(elastic, engine=engine)
        assert problem.startswith(f"--elastic: {engine} starts a fixed set of ranks"), problem
        assert "hvdtrain launch --elastic" in problem, problem
        # The refusal comes before elastic mode's own option checks
        assert check_train_command([*elastic, "--device", "cuda"], engine=engine) == problem
        assert engine_refusal(["hvdtrain", "train", "--elast"], engine) == problem  # argparse's
    assert check_train_command(elastic[:-1], engine="Ray") is None
    assert engine_refusal(["hvdtrain", "train", "--epochs", "2"], "Ray") is None
    assert engine_refusal(["python", "train.py", "--elastic"], "Ray") is None  # not ours to read
    for engine in ("hvdtrain.spark", "hvdtrain.ray"):
        proc = subprocess.run([sys.executable, "-m", engine, "-np", "2", "--", *elastic],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (engine, proc.stderr[-2000:])
        assert "hvdtrain: error: --elastic:" in proc.stderr, proc.stderr[-2000:]
    from hvdtrain.spark import run_command
    with pytest.raises(ValueError, match="--elastic: Spark starts a fixed set of ranks"):
        run_command(elastic, 2)  # checked before it looks for a SparkContext or makes one


def test_a_command_that_is_not_found_exits_2_before_an_engine_starts(tmp_path):
    # #48 item 1: a typo in the command was a "lost executor" on a cluster and a traceback
    # driver-local; now every engine stops on the driver, exit 2, naming the command.
    for engine, np_ in (("hvdtrain.spark", "2"), ("hvdtrain.spark", "-2"), ("hvdtrain.ray", "2")):
        proc = subprocess.run([sys.executable, "-m", engine, "-np", np_, "--", "hvdtrian",
                               "train", "--dataset", "digits"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (engine, np_, proc.stderr[-2000:])
        assert "command not found: 'hvdtrian'" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    # a path works (relative to the working directory), and --env PATH is where ranks look
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    from hvdtrain.launch.engine_args import find_command
    assert find_command(str(script)) == str(script)
    assert find_command("job.sh", {"PATH": str(tmp_path)}) == str(script)
    assert find_command("job.sh") is None


def test_adapters_import_no_engine():
    code = ("import sys, hvdtrain, hvdtrain.torch, hvdtrain.keras, hvdtrain.spark; "
            "print(sorted(m for m in ('pyspark', 'py4j', 'ray') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_rank_that_raised_is_named_before_the_ranks_horovod_shut_down():
    shut = "HorovodInternalError: Horovod has been shut down. This was caused by an exception"
    # rank 0's collateral failure reported (and even stamped) first: rank 1 still comes first
    order = ranks.cause_first([(0, 100.0, shut), (1, 100.2, "ValueError: boom"),
                               (2, 99.0, "Connection closed by peer")])
    assert [r for r, _, _ in order] == [1, 2, 0]
    # without a collateral marker, the earliest failure first
    assert [r for r, _, _ in ranks.cause_first([(0, 5.0, "a"), (1, 4.0, "b")])] == [1, 0]


FAILING_LOCAL = """
import json, sys
import hvdtrain.spark as hs

def failing_job():
    import horovod.torch as hvd, torch
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom on rank 1")
    hvd.allreduce_(torch.zeros(1))  # rank 0 fails only because rank 1 is gone
    return "unreachable"

try:
    hs.run(failing_job, -2)
except hs.SparkJobError as exc:
    json.dump({"message": str(exc), "codes": exc.exit_codes}, open(sys.argv[1], "w"))
"""


def test_driver_local_run_names_the_rank_that_raised(tmp_path):
    """np < 0 (ranks on the driver, real Horovod over Gloo): the error names rank 1, whose
    function raised, not rank 0, whose all-reduce failed because of it, three times over."""
    import json
    script = tmp_path / "failing.py"
    script.write_text(FAILING_LOCAL)
    for attempt in range(3):
        out = tmp_path / f"err{attempt}.json"
        proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                              text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        err = json.loads(out.read_text())
        assert err["message"].startswith("rank 1 (a process on the driver) exited with 1")
        assert "ValueError: boom on rank 1" in err["message"]
        assert err["codes"] == {"1": 1}


def test_spark_must_be_a_session_or_a_context():
    # A master URL where the session goes (a habit from SparkSession.builder.master) is refused
    # by name before Spark starts, not taken for a SparkContext.
    import pytest

    import hvdtrain.spark as hs
    from hvdtrain.spark.driver import SparkJobError
    with pytest.raises(SparkJobError, match="spark= takes a SparkSession or a SparkContext, not "
                                            "str 'local\\[2\\]'"):
        hs.run(print, num_proc=1, spark="local[2]")


def test_driver_local_ranks_leave_nothing_they_started_behind(tmp_path):
    """#48 item 4: a rank's own children end with it. Rank 1 exits 3; rank 0's shell, killed
    for it, had started a ``sleep`` (as ``-- bash train.sh`` starts ``python train.py``), which
    outlived the job with parent 1. And a rank that ends well leaves no background child."""
    marker = f"173.{os.getpid()}"
    failing = f'if [ "$HOROVOD_RANK" = 1 ]; then exit 3; fi; sleep {marker}; exit 0'
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.spark", "-np", "-2", "--", "sh",
                           "-c", failing], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "rank 1 (a process on the driver) exited with 3" in proc.stderr, proc.stderr[-2000:]
    assert left_after(marker) == []
    marker = f"174.{os.getpid()}"
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.spark", "-np", "-2", "--", "sh",
                           "-c", f"sleep {marker} & echo started"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-2000:]
    assert left_after(marker) == []


def test_ctrl_c_reaches_driver_local_ranks(tmp_path):
    """Each rank runs in a process group of its own (so that it can be ended whole), which a
    terminal's Ctrl-C does not reach: the driver hands SIGINT on to every rank, as horovodrun
    does, and then stops as Ctrl-C stops it."""
    import signal
    import time
    rank = f'{tmp_path}/rank.$HOROVOD_RANK'
    script = (f'trap "touch {rank}.int; exit 9" INT; touch {rank}.ready; '
              'while :; do sleep 0.05; done')
    driver = subprocess.Popen([sys.executable, "-m", "hvdtrain.spark", "-np", "-2", "--", "sh",
                               "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank.{r}.ready").exists() for r in (0, 1)):
            assert driver.poll() is None, driver.communicate()[0][-2000:]
            assert time.monotonic() < deadline, "the ranks did not start in 120 s"
            time.sleep(0.05)
        os.killpg(driver.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: its process group
        output, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert (tmp_path / "rank.0.int").exists() and (tmp_path / "rank.1.int").exists(), output
    assert driver.returncode == -signal.SIGINT, output[-2000:]
    assert left_after(str(tmp_path)) == []


def saved_parts(tmp_path, sizes=(7, 0, 5, 4), group=3):
    """Parquet files of ``sizes`` rows (row groups of ``group``), ids counting on across them, as
    Spark's part files would hold a saved DataFrame: a :class:`SavedDataFrame` of them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hvdtrain.spark.data import SavedDataFrame
    files, first = [], 0
    for i, n in enumerate(sizes):
        ids = np.arange(first, first + n, dtype=np.int64)
        table = pa.table({
            "id": ids,
            "x": pa.array([[float(v), 2.0 * v, -float(v)] for v in ids],
                          pa.list_(pa.float32())),
            "img": pa.array([[[int(v), 1], [2, int(v) + 3]] for v in ids],
                            pa.list_(pa.list_(pa.int32())))})
        name = f"part-{i:05d}.parquet"
        pq.write_table(table, tmp_path / name, row_group_size=group)
        if n:
            files.append((name, n))
        first += n
    return SavedDataFrame(path=str(tmp_path), columns=("id", "x", "img"), files=tuple(files),
                          shapes={"id": (), "x": (3,), "img": (2, 2)})


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_an_equal_shard_of_a_saved_dataframe(tmp_path, drop_last):
    import math

    import numpy as np
    data = saved_parts(tmp_path)
    n = data.rows
    assert n == len(data) == 16
    whole = data.read()
    assert whole["id"].tolist() == list(range(n))
    assert whole["x"].shape == (n, 3) and whole["x"].dtype == np.float32
    assert whole["img"].shape == (n, 2, 2) and whole["img"].dtype == np.int32
    for size in (1, 2, 3, 5, 7, 16, 17):
        if drop_last and size > n:
            with pytest.raises(ValueError, match="every rank would get none"):
                data.shard(0, size, drop_last=True)
            continue
        per = n // size if drop_last else math.ceil(n / size)
        seen = []
        for rank in range(size):
            part = data.shard(rank, size, drop_last=drop_last)
            # DistributedSampler's rule: a contiguous block, padded from the start of the data.
            expect = [(rank * per + j) % n for j in range(per)]
            assert part["id"].tolist() == expect, (size, rank)
            assert (part["x"][:, 1] == 2 * part["id"]).all() and part["x"].shape == (per, 3)
            assert (part["img"][:, 1, 1] == part["id"] + 3).all()
            seen += expect
        assert len(seen) == per * size
        assert set(seen) == (set(range(per * size)) if drop_last else set(range(n)))
    assert list(data.shard(1, 2, columns=["id"])) == ["id"]


def test_a_shard_reads_only_its_row_groups_and_takes_rank_and_size_from_the_launcher(
        tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    data = saved_parts(tmp_path)
    read = []
    real = pq.ParquetFile.read_row_groups

    def spy(self, groups, *args, **kwargs):
        read.append(list(groups))
        return real(self, groups, *args, **kwargs)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    monkeypatch.setenv("HOROVOD_RANK", "2")
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    part = data.shard()  # rows 8-11: the second file's first two row groups (rows 7-9, 10-11)
    assert part["id"].tolist() == [8, 9, 10, 11] and read == [[0, 1]]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), not 4"):
        data.shard(4)
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['y'\]"):
        data.read(["y"])
    with pytest.raises(ValueError, match="size must be a whole number"):
        data.shard(0, 0)


def test_saved_dataframe_paths_read_alike_on_every_process(tmp_path, monkeypatch):
    """Relative paths are made absolute on the driver (ranks run in the executors' working
    directories); Databricks' two spellings; Spark's explicit file:// (its default file system
    may be HDFS); Hadoop's s3a:// read by pyarrow as s3://."""
    from hvdtrain.spark.data import _filesystem, _normal_path, _spark_path
    monkeypatch.chdir(tmp_path)
    assert _normal_path("store/train") == str(tmp_path / "store" / "train")
    assert _normal_path("dbfs:/ml/train") == "/dbfs/ml/train"
    assert _normal_path("hdfs://nn:8020/ml/train") == "hdfs://nn:8020/ml/train"
    assert _spark_path("/dbfs/ml/train") == "dbfs:/ml/train"
    assert _spark_path(str(tmp_path)) == f"file://{tmp_path}"
    fs, where = _filesystem(str(tmp_path))
    assert type(fs).__name__ == "LocalFileSystem" and where == str(tmp_path)
