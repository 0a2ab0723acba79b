"""hvdtrain's PyTorch adapter (mirrors :mod:`hvdtrain.keras`: same concepts, same names)."""
from hvdtrain.accumulation import MicroBatch
from hvdtrain.torch.adapter import (allreduce_sums, broadcast_state, distribute, init,
                                    micro_batches, rank_info, ranks_where)
from hvdtrain.torch.buffers import convert_sync_batchnorm, sync_buffers
from hvdtrain.torch.scheduler import Warmup, warmup

__all__ = ["MicroBatch", "Warmup", "allreduce_sums", "broadcast_state", "convert_sync_batchnorm",
           "distribute", "init", "micro_batches", "rank_info", "ranks_where", "sync_buffers",
           "warmup"]
