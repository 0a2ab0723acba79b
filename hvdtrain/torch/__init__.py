"""hvdtrain's PyTorch adapter (mirrors :mod:`hvdtrain.keras`: same concepts, same names)."""
from hvdtrain.accumulation import MicroBatch, micro_batches
from hvdtrain.torch.adapter import (allreduce_sums, broadcast_state, distribute, init, rank_info, ranks_where,
                                    warmup)

__all__ = ["MicroBatch", "allreduce_sums", "broadcast_state", "distribute", "init", "micro_batches",
           "rank_info", "ranks_where", "warmup"]
