"""hvdtrain's PyTorch adapter (mirrors :mod:`hvdtrain.keras`: same concepts, same names)."""
from hvdtrain.accumulation import MicroBatch
from hvdtrain.torch.adapter import (Warmup, allreduce_sums, broadcast_state, distribute, init,
                                    micro_batches, rank_info, ranks_where, warmup)

__all__ = ["MicroBatch", "Warmup", "allreduce_sums", "broadcast_state", "distribute", "init",
           "micro_batches", "rank_info", "ranks_where", "warmup"]
