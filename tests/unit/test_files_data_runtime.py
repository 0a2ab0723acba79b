import json
import subprocess
import sys

import numpy as np
import pytest

from hvdtrain import datasets, runtime
from hvdtrain.files import atomic_open, write_json


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "m.json"
    write_json(path, {"a": 1})
    write_json(path, {"a": 2, "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 2, "b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temp files left


def test_failed_write_keeps_the_last_good_file(tmp_path):
    path = tmp_path / "ckpt.bin"
    with atomic_open(path) as f:
        f.write(b"good")
    with pytest.raises(RuntimeError):
        with atomic_open(path) as f:
            f.write(b"half-writ")
            raise RuntimeError("crash mid-write")
    assert path.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.bin"]


def test_digits_split_is_real_and_deterministic():
    a, b = datasets.load_digits(), datasets.load_digits()
    assert a.x_train.shape == (1437, 1, 8, 8) and a.x_test.shape == (360, 1, 8, 8)
    assert a.x_train.dtype == np.float32 and 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
    assert set(np.unique(a.y_test)) == set(range(10))
    np.testing.assert_array_equal(a.y_test, b.y_test)


def test_shard_indices_cover_every_sample_once():
    shards = [datasets.shard_indices(11, r, 3) for r in range(3)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(11))


def test_synthetic_and_unknown_dataset():
    s = datasets.load("synthetic", synthetic_samples=100)
    assert len(s.x_train) + len(s.x_test) == 100
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; use digits, mnist or synthetic"):
        datasets.load("cifar")


@pytest.mark.parametrize("local_size,cores,expected", [(1, 2, 2), (2, 2, 1), (4, 2, 1), (2, 8, 4)])
def test_thread_budget(local_size, cores, expected):
    assert runtime.thread_budget(local_size, cores, env={}) == expected


@pytest.mark.parametrize("value,expected", [("1", 1), ("3", 3), (" 4,2", 4), ("", 4)])
def test_omp_num_threads_sets_the_threads_per_rank(value, expected):
    assert runtime.thread_budget(2, 8, env={"OMP_NUM_THREADS": value}) == expected


@pytest.mark.parametrize("value", ["0", "two", "-1", "\u00b2", ",2"])
def test_a_bad_omp_num_threads_is_named(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS must be a whole number >= 1 .*got "
                                         f"'{value}'"):
        runtime.thread_budget(2, 8, env={"OMP_NUM_THREADS": value})


def test_rank_seed_and_launcher_env(monkeypatch):
    assert runtime.rank_seed(42, 0) == 42
    assert len({runtime.rank_seed(42, r) for r in range(64)}) == 64
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert runtime.launcher_rank() == 3
    with pytest.raises(ValueError, match="local_size must be >= 1"):
        runtime.thread_budget(0)


def test_checkpoint_generations_fall_back_to_the_previous_one(tmp_path):
    from hvdtrain.files import CheckpointError, load_newest, save_rotating
    current, previous = tmp_path / "c.bin", tmp_path / "c.prev.bin"

    def read(path):
        text = path.read_text()
        if not text.startswith("ok"):
            raise ValueError("bad magic")
        return text

    for n in (1, 2):
        save_rotating(current, previous, lambda h, n=n: h.write(f"ok{n}".encode()))
    assert (current.read_text(), previous.read_text()) == ("ok2", "ok1")
    assert load_newest([current, previous], read) == (current, "ok2")
    current.write_bytes(b"\x00garbage")
    assert load_newest([current, previous], read) == (previous, "ok1")
    previous.unlink()
    with pytest.raises(CheckpointError, match=r"c.bin: unreadable \(ValueError: bad magic\); "
                                              r".*c.prev.bin: missing"):
        load_newest([current, previous], read)


def test_python_numpy_rng_state_round_trips_through_json():
    import random
    np.random.seed(3)
    random.seed(3)
    state = json.loads(json.dumps(runtime.python_numpy_rng_state()))
    expected = (np.random.rand(3), random.random())
    np.random.rand(7)
    random.random()
    runtime.set_python_numpy_rng_state(state)
    assert (np.random.rand(3) == expected[0]).all() and random.random() == expected[1]


def test_count_hosts_sums_local_rank_zeros_except_under_elastic(monkeypatch):
    seen = []

    def fake_allreduce(values):  # what three ranks (local ranks 0, 1 | 0) would sum to
        seen.append(values)
        return {"hosts": 2.0}

    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert runtime.count_hosts(1, 1, fake_allreduce) == 2
    assert seen == [{"hosts": 0.0}]
    # Elastic: no collective outside the elastic loop; Horovod's cross_size is used.
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert runtime.count_hosts(0, 3, fake_allreduce) == 3 and len(seen) == 1


@pytest.mark.parametrize("device,gpus,local_rank,local_size,expected", [
    ("auto", 0, 1, 2, "cpu"),      # no GPU: the CPU
    ("cpu", 4, 1, 2, "cpu"),       # asked for the CPU on a GPU host
    ("auto", 2, 1, 2, "cuda:1"),   # one GPU per rank: local_rank's
    ("cuda", 8, 3, 4, "cuda:3"),
])
def test_choose_device(device, gpus, local_rank, local_size, expected):
    assert runtime.choose_device(device, gpus, local_rank, local_size) == expected


@pytest.mark.parametrize("device,gpus,local_size,match", [
    ("cuda", 0, 1, "no CUDA GPU is visible"),
    ("auto", 1, 2, "2 ranks on this host but 1 GPU"),  # NCCL: no two ranks on one GPU
    ("gpu", 1, 1, "device must be one of auto, cpu, cuda"),
])
def test_choose_device_errors_say_what_to_change(device, gpus, local_size, match):
    with pytest.raises(ValueError, match=match):
        runtime.choose_device(device, gpus, 0, local_size)


def test_digits_split_is_cached_and_a_cached_load_skips_scikit_learn(tmp_path):
    """The first load makes the split with scikit-learn and keeps it under HVDTRAIN_CACHE; a
    later process reads the same arrays without importing scikit-learn (about a second a rank)."""
    import subprocess
    import sys
    code = ("import sys, hashlib; from hvdtrain.datasets.digits import load_digits; "
            "s = load_digits(); h = hashlib.sha256(); "
            "[h.update(a.tobytes()) for a in (s.x_train, s.y_train, s.x_test, s.y_test)]; "
            "print('sklearn' in sys.modules, s.x_train.dtype, s.y_train.dtype, h.hexdigest())")
    env = {**__import__("os").environ, "HVDTRAIN_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[0] == "True" and second[0] == "False"  # scikit-learn imported the first time only
    assert first[1:] == second[1:]  # the same arrays, dtypes and bytes
    assert second[1:3] == ["float32", "int64"]
    assert len(list((tmp_path / "datasets" / "digits").glob("*.npz"))) == 1


# What the standard library's http.server, unittest.mock and email import make: 30-40 collections
# when the collector runs (seen: 39); import_frozen makes one full collection first, then none.
FROZEN_CHECK = """
import gc, json, sys
from hvdtrain import runtime
starts = []
gc.callbacks.append(lambda phase, info: phase == "start" and starts.append(info["generation"]))
before = gc.get_freeze_count()
mods = runtime.import_frozen("http.server", "unittest.mock", "email.mime.multipart")
during, frozen = list(starts), gc.get_freeze_count() - before
try:
    runtime.import_frozen("no_such_module_here")
    failed = None
except ImportError as exc:
    failed = type(exc).__name__
after_failure = gc.get_freeze_count() - before - frozen
runtime.import_frozen("http.server")  # imported already: nothing new to freeze
result = {"names": [m.__name__ for m in mods], "during": during, "frozen": frozen,
          "enabled": gc.isenabled(), "failed": failed, "frozen_after_failure": after_failure,
          "frozen_again": gc.get_freeze_count() - before - frozen - after_failure}
open(sys.argv[1], "w").write(json.dumps(result))
"""


def test_import_frozen_pauses_the_collector_and_freezes_what_the_import_made(tmp_path):
    # Its own interpreter: a freeze here would keep pytest's objects out of every later
    # collection of this session.
    out = tmp_path / "frozen.json"
    proc = subprocess.run([sys.executable, "-c", FROZEN_CHECK, str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["names"] == ["http.server", "unittest.mock", "email.mime.multipart"]
    # One full collection before the import (garbage is not frozen), none while it ran.
    assert r["during"] == [2]
    assert r["frozen"] > 10_000  # everything alive then, the new modules' objects among them
    assert r["enabled"] is True and r["failed"] == "ModuleNotFoundError"
    assert r["frozen_after_failure"] == 0  # a failed import freezes nothing
    assert r["frozen_again"] == 0  # nor does one of modules loaded already
