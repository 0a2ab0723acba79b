"""Small Keras models for the bundled datasets (the same architecture as hvdtrain.torch.models)."""
from __future__ import annotations

import tensorflow as tf


def build_model(num_classes: int = 10, image_size: int = 8) -> tf.keras.Model:
    """The CNN of :class:`hvdtrain.torch.models.DigitsCNN`, channels-last: input
    ``(B, S, S, 1)``, output logits ``(B, num_classes)``. Built (weights exist) on return."""
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.MaxPool2D(2),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(num_classes),
    ], name="digits_cnn")
    model.build((None, image_size, image_size, 1))
    return model
