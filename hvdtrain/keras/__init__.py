"""hvdtrain's Keras adapter (mirrors :mod:`hvdtrain.torch`: same concepts, same names)."""
from hvdtrain.keras.adapter import (SyncBuffersCallback, WarmupCallback, allreduce_sums,
                                    broadcast_state, callbacks, distribute, init,
                                    micro_batches_per_epoch, rank_info, ranks_where, shard_dataset,
                                    sync_buffers, warmup)

__all__ = ["SyncBuffersCallback", "WarmupCallback", "allreduce_sums", "broadcast_state",
           "callbacks", "distribute", "init", "micro_batches_per_epoch", "rank_info",
           "ranks_where", "shard_dataset", "sync_buffers", "warmup"]
