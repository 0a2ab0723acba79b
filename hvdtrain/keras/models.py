"""Small Keras 3 models for the bundled datasets (the same architecture as hvdtrain.torch.models),
for either Keras backend."""
from __future__ import annotations

import keras


def build_model(num_classes: int = 10, image_size: int = 8,
                batchnorm: bool = False) -> keras.Model:
    """The CNN of :class:`hvdtrain.torch.models.DigitsCNN`, channels-last: input
    ``(B, S, S, 1)``, output logits ``(B, num_classes)`` in float32 whatever the global
    mixed-precision policy (Keras's advice: keep the outputs that feed the loss in float32).
    ``batchnorm``: ``BatchNormalization`` after each convolution. From 16 px up (MNIST's 28) a
    max-pooling follows the first convolution, as in the PyTorch model. Built (weights exist) on
    return."""
    layers = keras.layers

    def conv(filters):
        if not batchnorm:
            return [layers.Conv2D(filters, 3, padding="same", activation="relu")]
        return [layers.Conv2D(filters, 3, padding="same"), layers.BatchNormalization(),
                layers.Activation("relu")]

    model = keras.Sequential([
        *conv(16), *([layers.MaxPool2D(2)] if image_size >= 16 else []), *conv(32),
        layers.MaxPool2D(2),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(num_classes),
        layers.Activation("linear", dtype="float32"),
    ], name="digits_cnn")
    model.build((None, image_size, image_size, 1))
    return model


def bench_model(name: str, num_classes: int = 10, image_size: int = 32) -> keras.Model:
    """The benchmark models of :func:`hvdtrain.torch.models.bench_model`, channels-last input
    ``(B, S, S, 3)``; built on return.

    Raises:
        ValueError: unknown ``name``.
    """
    layers = keras.layers
    if name == "cnn":
        body = [layers.Conv2D(32, 3, padding="same", activation="relu"),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
                layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(num_classes)]
    elif name == "dense":
        body = [layers.Flatten(), layers.Dense(2048, activation="relu"),
                layers.Dense(2048, activation="relu"), layers.Dense(num_classes)]
    else:
        raise ValueError(f"unknown benchmark model {name!r}; use cnn or dense")
    model = keras.Sequential(body, name=f"bench_{name}")
    model.build((None, image_size, image_size, 3))
    return model
