"""Datasets that work offline, as NumPy arrays shared by both adapters: ``digits``
(:mod:`~hvdtrain.datasets.digits`), ``mnist`` (:mod:`~hvdtrain.datasets.mnist`: its cache, its
download and the ``--data-dir`` readers) and ``synthetic`` (:mod:`~hvdtrain.datasets.synthetic`),
siblings that each return a :class:`~hvdtrain.datasets.split.Split`.

Images are float32 in channels-first layout ``(N, 1, H, W)``; the Keras adapter transposes to
channels-last itself. Labels are int64 class indices ``(N,)``.
"""
from __future__ import annotations

import os

from hvdtrain.datasets.digits import load_digits
from hvdtrain.datasets.mnist import load_mnist
from hvdtrain.datasets.split import Split, shard_indices
from hvdtrain.datasets.synthetic import load_synthetic

__all__ = ["Split", "load", "load_digits", "load_mnist", "load_synthetic", "shard_indices"]


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
