"""scikit-learn's handwritten digits (8x8, bundled with scikit-learn): the quick-check dataset."""
from __future__ import annotations

import numpy as np

from hvdtrain.datasets.split import Split


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
