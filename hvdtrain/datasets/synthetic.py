"""Random images whose labels depend on them: for throughput runs and tests."""
from __future__ import annotations

import numpy as np

from hvdtrain.datasets.split import Split


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
