"""hvdtrain's Keras adapter (mirrors :mod:`hvdtrain.torch`: same concepts, same names)."""
from hvdtrain.keras.adapter import (WarmupCallback, allreduce_sums, broadcast_state, callbacks,
                                    distribute, init, micro_batches_per_epoch, rank_info, ranks_where,
                                    shard_dataset, warmup)

__all__ = ["WarmupCallback", "allreduce_sums", "broadcast_state", "callbacks", "distribute",
           "init", "micro_batches_per_epoch", "rank_info", "ranks_where", "shard_dataset", "warmup"]
