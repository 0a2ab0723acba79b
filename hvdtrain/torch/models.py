"""Small PyTorch models for the bundled datasets."""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """A small CNN for ``(B, 1, S, S)`` images (S divisible by 2, e.g. 8 for digits; by 4 from
    16 up, e.g. 28 for MNIST).

    conv3x3(1->16) -> ReLU -> [maxpool2 when S >= 16] -> conv3x3(16->32) -> ReLU -> maxpool2 ->
    dense(32*(S/2)^2 -> 64), or 32*(S/4)^2 with the first pooling, -> ReLU -> [dropout(p)] ->
    dense(64 -> num_classes). The first pooling makes 28x28 MNIST 3.6x cheaper per image
    (1.1 M multiply-adds forward instead of 4.1 M) and leaves digits' 8x8 model unchanged. No batch norm, and no dropout unless
    ``dropout > 0``, so by default a data-parallel step equals a single-process step on the same
    samples exactly. With ``batchnorm=True`` a ``BatchNorm2d`` follows each convolution (then
    each rank normalises with its own batch's statistics, and the running statistics need
    ``hvdtrain.torch.sync_buffers`` to agree across ranks). Output: logits ``(B, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, image_size: int = 8, dropout: float = 0.0,
                 batchnorm: bool = False):
        super().__init__()
        norm = (lambda c: [nn.BatchNorm2d(c)]) if batchnorm else (lambda c: [])
        pool_first = image_size >= 16
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), *norm(16), nn.ReLU(),
            *([nn.MaxPool2d(2)] if pool_first else []),
            nn.Conv2d(16, 32, 3, padding=1), *norm(32), nn.ReLU(),
            nn.MaxPool2d(2))
        side = image_size // (4 if pool_first else 2)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * side ** 2, 64), nn.ReLU(),
            nn.Dropout(dropout) if dropout > 0 else nn.Identity(),
            nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(num_classes: int = 10, image_size: int = 8, dropout: float = 0.0,
                batchnorm: bool = False) -> nn.Module:
    """The model ``hvdtrain train`` uses for ``(B, 1, image_size, image_size)`` inputs
    (``dropout``: probability of the dropout before the last layer, 0 for none; ``batchnorm``:
    BatchNorm after each convolution)."""
    return DigitsCNN(num_classes, image_size, dropout, batchnorm)


# The benchmarks' transformer LM (both frameworks): vocabulary, context (tokens), width, blocks,
# attention heads. 3.3 M parameters; a sample is one sequence of GPT_CONTEXT tokens.
GPT_VOCAB, GPT_CONTEXT, GPT_WIDTH, GPT_LAYERS, GPT_HEADS = 512, 64, 256, 4, 4


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``, with causal
    self-attention (``F.scaled_dot_product_attention``) and a 4x GELU MLP. ``(B, T, W) ->
    (B, T, W)``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(w, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT-style language model: token + learned position embedding, pre-norm causal
    self-attention blocks, a final LayerNorm and an output head tied to the token embedding
    (Press & Wolf 2017; as GPT-2 and nanoGPT). Input token ids ``(B, T)`` (int64, T <=
    ``context``), output next-token logits ``(B, T, vocab)``."""

    def __init__(self, vocab: int = GPT_VOCAB, context: int = GPT_CONTEXT, width: int = GPT_WIDTH,
                 layers: int = GPT_LAYERS, heads: int = GPT_HEADS):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(TransformerBlock(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.ln(self.blocks(x)) @ self.tok.weight.T


def bench_model(name: str, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """Benchmark models (mirrored in hvdtrain.keras.models).

    * ``"mnist"``: the MNIST CNN ``hvdtrain train`` uses (:class:`DigitsCNN` at 28x28), input
      ``(B, 1, 28, 28)`` whatever ``image_size``.
    * ``"cnn"``: input ``(B, 3, S, S)``; conv3x3(3->32) -> conv3x3(32->64) -> maxpool2 ->
      conv3x3(64->64) -> maxpool2 -> dense(64*(S/4)^2 -> 64) -> dense(64 -> classes); 319,178
      parameters at S=32, compute-bound.
    * ``"dense"``: input ``(B, 3, S, S)``; flatten -> dense(3*S^2 -> 2048) -> dense(2048 ->
      2048) -> dense(2048 -> classes); 10.5 M parameters (42 MB of gradients per step) at S=32,
      communication-bound.
    * ``"gpt"``: :class:`TinyGPT`, token ids ``(B, 64)`` -> logits ``(B, 64, 512)``; 3.3 M
      parameters.

    Raises:
        ValueError: unknown ``name``.
    """
    if name == "mnist":
        return DigitsCNN(num_classes, 28)
    if name == "gpt":
        return TinyGPT()
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * (image_size // 4) ** 2, 64), nn.ReLU(),
            nn.Linear(64, num_classes))
    if name == "dense":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(3 * image_size ** 2, 2048), nn.ReLU(),
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, num_classes))
    raise ValueError(f"unknown benchmark model {name!r}; use {', '.join(BENCH_MODELS)}")


BENCH_MODELS = ("mnist", "cnn", "dense", "gpt")
