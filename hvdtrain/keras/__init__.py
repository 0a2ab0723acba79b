"""hvdtrain's Keras 3 adapter, on the TensorFlow and PyTorch backends (mirrors
:mod:`hvdtrain.torch`: same concepts, same names)."""
from hvdtrain.keras.adapter import (MetricAverageCallback, ShardedDataset, SyncBuffersCallback,
                                    WarmupCallback, WarmupSchedule, allreduce_sums, backend,
                                    broadcast_state, callbacks, distribute, init,
                                    micro_batch_count, micro_batches_per_epoch, rank_info,
                                    ranks_where, set_micro_batch_count, shard_dataset,
                                    sync_buffers, warmup)

__all__ = ["MetricAverageCallback", "ShardedDataset", "SyncBuffersCallback", "WarmupCallback",
           "WarmupSchedule", "allreduce_sums", "backend", "broadcast_state", "callbacks",
           "distribute", "init", "micro_batch_count", "micro_batches_per_epoch", "rank_info",
           "ranks_where", "set_micro_batch_count", "shard_dataset", "sync_buffers", "warmup"]
