"""hvdtrain: synchronous data-parallel training for PyTorch and tf.keras on Horovod.

Framework adapters live in :mod:`hvdtrain.torch` and :mod:`hvdtrain.keras`; this package root
imports neither framework.
"""
__version__ = "0.2.0"
