"""hvd.init() again after hvd.shutdown(), three times, as an elastic reset does, each time an
all-reduce; then a fourth time with a process set per rank (Horovod's static process sets), rank 0
all-reducing twice on its own set and rank 1 once before an all-reduce of both without a name
(before scripts/horovod_patches/16-*, it waited forever: the ranks named it after their own
count of operations). What each rank saw goes to ``<out>/rank<r>.json`` and, for the fourth
start, ``<out>/rank<r>.sets.json``. Run by
tests/parallel/test_horovod_elastic.py as Horovod's users would run it:

    HOROVOD_CYCLE_TIME=10 HOROVOD_FUSION_THRESHOLD=4194304 \\
        horovodrun --gloo -np 2 -H localhost:2 python tests/parallel/torch_reinit.py OUT
"""
import json
import os
import sys

import horovod.torch as hvd
import torch


def main() -> None:
    out = sys.argv[1]
    inits = []
    for i in range(3):
        hvd.init()
        # Rank r contributes r + i: the average over the ranks is (size - 1) / 2 + i.
        total = hvd.allreduce(torch.full((4,), float(hvd.rank() + i)), name=f"reinit.{i}",
                              op=hvd.Average)
        inits.append({"rank": hvd.rank(), "size": hvd.size(), "average": total.tolist()})
        rank = hvd.rank()
        hvd.shutdown()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(inits, f)
    own = [hvd.ProcessSet([r]) for r in range(int(os.environ["HOROVOD_SIZE"]))]
    hvd.init(process_sets=own)
    for _ in range(2 if rank == 0 else 1):
        hvd.allreduce(torch.ones(1), process_set=own[rank], op=hvd.Sum)
    unnamed = hvd.allreduce(torch.full((1,), float(rank)), op=hvd.Sum).tolist()
    hvd.shutdown()
    with open(f"{out}/rank{rank}.sets.json", "w") as f:
        json.dump(unnamed, f)


if __name__ == "__main__":
    main()
