"""hvdtrain's Keras 3 adapter, on the TensorFlow and PyTorch backends (mirrors
:mod:`hvdtrain.torch`: same concepts, same names).

Modules: :mod:`~hvdtrain.keras.adapter` (init, broadcast, distribute), :mod:`~.optimizer` (what
distribute puts into the optimizer), :mod:`~.callbacks`, :mod:`~.sharding` (data),
:mod:`~.collectives` (Horovod's collectives for the backend in use).
"""
from hvdtrain.keras.adapter import (allreduce_sums, backend, broadcast_state, distribute, init,
                                    micro_batch_count, rank_info, ranks_where,
                                    set_micro_batch_count, sync_buffers)
from hvdtrain.keras.callbacks import (MetricAverageCallback, SyncBuffersCallback, WarmupCallback,
                                      callbacks, warmup)
from hvdtrain.keras.scheduler import WarmupSchedule
from hvdtrain.keras.sharding import ShardedDataset, micro_batches_per_epoch, shard_dataset

__all__ = ["MetricAverageCallback", "ShardedDataset", "SyncBuffersCallback", "WarmupCallback",
           "WarmupSchedule", "allreduce_sums", "backend", "broadcast_state", "callbacks",
           "distribute", "init", "micro_batch_count", "micro_batches_per_epoch", "rank_info",
           "ranks_where", "set_micro_batch_count", "shard_dataset", "sync_buffers", "warmup"]
