"""Datasets that work offline, as NumPy arrays shared by both adapters.

Images are float32 in channels-first layout ``(N, 1, H, W)``; the Keras adapter transposes to
channels-last itself. Labels are int64 class indices ``(N,)``.

MNIST (its cache, its download and the ``--data-dir`` readers) lives in :mod:`hvdtrain.mnist`;
:func:`load_mnist` is re-exported here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from hvdtrain.mnist import load_mnist  # hvdtrain.mnist imports Split from here when it runs


@dataclass(frozen=True)
class Split:
    """A train/test split.

    Attributes:
        x_train: ``(N_train, 1, H, W)`` float32 in [0, 1].
        y_train: ``(N_train,)`` int64 in ``[0, num_classes)``.
        x_test: ``(N_test, 1, H, W)`` float32.
        y_test: ``(N_test,)`` int64.
        num_classes: number of classes.
        name: dataset name.
    """
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's bundled handwritten digits: 1,797 real 8x8 images of 10 classes, no download.

    The split is stratified and depends only on ``seed`` (the same on every rank and run). Pixel
    values (0..16) are divided by 16.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed (the message says how to get it).
    """
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
    return Split(x_tr, y_tr, x_te, y_te, num_classes=10, name="digits")


def load_synthetic(num_samples: int = 2048, image_size: int = 8, num_classes: int = 10,
                   test_fraction: float = 0.2, seed: int = 0) -> Split:
    """Random images with labels that depend on them (class = argmax of 10 fixed projections),
    so a model can learn something; for throughput runs and tests. Shape ``(N, 1, S, S)``."""
    rng = np.random.default_rng(seed)
    x = rng.random((num_samples, 1, image_size, image_size), dtype=np.float32)
    w = rng.standard_normal((image_size * image_size, num_classes)).astype(np.float32)
    y = (x.reshape(num_samples, -1) @ w).argmax(axis=1).astype(np.int64)
    n_test = max(1, int(round(num_samples * test_fraction)))
    return Split(x[n_test:], y[n_test:], x[:n_test], y[:n_test], num_classes, name="synthetic")


def load(name: str, *, test_fraction: float = 0.2, seed: int = 0,
         synthetic_samples: int = 2048, data_dir: str | os.PathLike | None = None) -> Split:
    """Load dataset ``name``: ``"digits"``, ``"mnist"`` or ``"synthetic"``.

    ``test_fraction`` and ``seed`` make the split of digits and synthetic; MNIST has its own fixed
    split (60,000 training, 10,000 test images), so they do not apply to it. ``data_dir`` is for
    MNIST only (see :func:`load_mnist`).

    Raises:
        ValueError: unknown name, or ``data_dir`` given for another dataset.
    """
    if data_dir is not None and name != "mnist":
        raise ValueError(f"a data directory applies to mnist only, not to {name!r}")
    if name == "digits":
        return load_digits(test_fraction, seed)
    if name == "mnist":
        return load_mnist(data_dir)
    if name == "synthetic":
        return load_synthetic(synthetic_samples, test_fraction=test_fraction, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; use digits, mnist or synthetic")


def shard_indices(n: int, rank: int, size: int) -> np.ndarray:
    """Indices ``rank, rank+size, ...`` of ``n`` items: an unpadded shard (for evaluation, where
    every sample must count exactly once across ranks)."""
    return np.arange(rank, n, size)
