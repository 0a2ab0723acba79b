"""Small Keras 3 models for the bundled datasets (the same architecture as hvdtrain.torch.models),
for either Keras backend."""
from __future__ import annotations

import keras


def build_model(num_classes: int = 10, image_size: int = 8, dropout: float = 0.0,
                batchnorm: bool = False) -> keras.Model:
    """The CNN of :class:`hvdtrain.torch.models.DigitsCNN`, channels-last: input
    ``(B, S, S, 1)``, output logits ``(B, num_classes)`` in float32 whatever the global
    mixed-precision policy (Keras's advice: keep the outputs that feed the loss in float32).
    ``dropout``: probability of the dropout before the last layer (none when 0, the default, as
    in the PyTorch model); ``batchnorm``: ``BatchNormalization`` after each convolution. From 16 px up (MNIST's 28) a
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
        *([layers.Dropout(dropout)] if dropout > 0 else []),
        layers.Dense(num_classes),
        layers.Activation("linear", dtype="float32"),
    ], name="digits_cnn")
    model.build((None, image_size, image_size, 1))
    return model


# The transformer LM's sizes, shared with the PyTorch model.
GPT_VOCAB, GPT_CONTEXT, GPT_WIDTH, GPT_LAYERS, GPT_HEADS = 512, 64, 256, 4, 4


class TransformerBlock(keras.layers.Layer):
    """The pre-norm causal transformer block of :class:`hvdtrain.torch.models.TinyGPT`'s:
    ``(B, T, W) -> (B, T, W)``."""

    def __init__(self, width: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        layers = keras.layers
        # epsilon as torch.nn.LayerNorm's (Keras's default is 1e-3)
        self.ln1 = layers.LayerNormalization(epsilon=1e-5)
        self.ln2 = layers.LayerNormalization(epsilon=1e-5)
        self.attn = layers.MultiHeadAttention(heads, width // heads)
        self.up = layers.Dense(4 * width, activation="gelu")
        self.down = layers.Dense(width)

    def call(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        return x + self.down(self.up(self.ln2(x)))


class TinyGPT(keras.Model):
    """:class:`hvdtrain.torch.models.TinyGPT` in Keras 3: token + position embedding, causal
    self-attention blocks, a final LayerNormalization and an output head tied to the token
    embedding. Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab)`` (float32)."""

    def __init__(self, vocab: int = GPT_VOCAB, context: int = GPT_CONTEXT, width: int = GPT_WIDTH,
                 layers: int = GPT_LAYERS, heads: int = GPT_HEADS, **kwargs):
        super().__init__(name="tiny_gpt", **kwargs)
        self.tok = keras.layers.Embedding(vocab, width)
        self.pos = keras.layers.Embedding(context, width)
        self.blocks = [TransformerBlock(width, heads) for _ in range(layers)]
        self.ln = keras.layers.LayerNormalization(epsilon=1e-5)

    def call(self, idx):
        x = self.tok(idx) + self.pos(keras.ops.arange(keras.ops.shape(idx)[1]))
        for block in self.blocks:
            x = block(x)
        logits = keras.ops.matmul(self.ln(x), keras.ops.transpose(self.tok.embeddings))
        return keras.ops.cast(logits, "float32")


def bench_model(name: str, num_classes: int = 10, image_size: int = 32) -> keras.Model:
    """The benchmark models of :func:`hvdtrain.torch.models.bench_model`, channels-last: ``mnist``
    ``(B, 28, 28, 1)``, ``cnn``/``dense`` ``(B, S, S, 3)``, ``gpt`` token ids ``(B, 64)``; built on
    return.

    Raises:
        ValueError: unknown ``name``.
    """
    layers = keras.layers
    if name == "mnist":
        return build_model(num_classes, 28)
    if name == "gpt":
        model = TinyGPT()
        model(keras.ops.zeros((1, GPT_CONTEXT), "int32"))  # builds every layer
        return model
    if name == "cnn":
        body = [layers.Conv2D(32, 3, padding="same", activation="relu"),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
                layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(num_classes)]
    elif name == "dense":
        body = [layers.Flatten(), layers.Dense(2048, activation="relu"),
                layers.Dense(2048, activation="relu"), layers.Dense(num_classes)]
    else:
        raise ValueError(f"unknown benchmark model {name!r}; use {', '.join(BENCH_MODELS)}")
    model = keras.Sequential(body, name=f"bench_{name}")
    model.build((None, image_size, image_size, 3))
    return model


BENCH_MODELS = ("mnist", "cnn", "dense", "gpt")
