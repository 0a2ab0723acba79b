"""hvdtrain's PyTorch adapter (mirrors :mod:`hvdtrain.keras`: same concepts, same names)."""
from hvdtrain.accumulation import MicroBatch
from hvdtrain.torch.adapter import (Warmup, allreduce_sums, broadcast_state,
                                    convert_sync_batchnorm, distribute, init, micro_batches,
                                    rank_info, ranks_where, sync_buffers, warmup)

__all__ = ["MicroBatch", "Warmup", "allreduce_sums", "broadcast_state", "convert_sync_batchnorm",
           "distribute", "init", "micro_batches", "rank_info", "ranks_where", "sync_buffers",
           "warmup"]
