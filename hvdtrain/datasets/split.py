"""The train/test split every dataset loads into, and the unpadded shard used for evaluation."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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



def shard_indices(n: int, rank: int, size: int) -> np.ndarray:
    """Indices ``rank, rank+size, ...`` of ``n`` items: an unpadded shard (for evaluation, where
    every sample must count exactly once across ranks)."""
    return np.arange(rank, n, size)
