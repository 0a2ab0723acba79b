"""scikit-learn's handwritten digits (8x8, bundled with scikit-learn): the quick-check dataset."""
from __future__ import annotations

import os
import tempfile
from importlib import metadata

import numpy as np

from hvdtrain.datasets.split import Split


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's bundled handwritten digits: 1,797 real 8x8 images of 10 classes, no download.

    The split is stratified and depends only on ``seed`` (the same on every rank and run). Pixel
    values (0..16) are divided by 16. The split is kept under
    ``<cache_dir()>/datasets/digits/`` (an ``.npz`` per scikit-learn version, test fraction and
    seed, written atomically): a process that finds it there does not import scikit-learn,
    which takes about a second per rank.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed (the message says how to get it).
    """
    from hvdtrain.datasets.mnist import cache_dir
    try:
        version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        version = None
    cached = (cache_dir() / "datasets" / "digits" /
              f"split-sklearn{version}-test{test_fraction!r}-seed{seed}.npz")
    if version is not None and cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as f:
                return Split(f["x_train"], f["y_train"], f["x_test"], f["y_test"],
                             num_classes=10, name="digits")
        except Exception:  # noqa: BLE001 - unreadable (truncated zip, ...): made again below
            pass
    try:
        from sklearn.datasets import load_digits as _load
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the digits dataset comes with scikit-learn: pip install "
                                  "'hvdtrain[digits]' (or scikit-learn), or use --dataset "
                                  "synthetic") from exc

    bunch = _load()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                              stratify=y)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp.npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache: load from scikit-learn every time
    return Split(x_tr, y_tr, x_te, y_te, num_classes=10, name="digits")
