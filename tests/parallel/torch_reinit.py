"""hvd.init() again after hvd.shutdown(), three times, as an elastic reset does, each time an
all-reduce: what each rank saw goes to ``<out>/rank<r>.json``. Run by
tests/parallel/test_horovod_elastic.py as Horovod's users would run it:

    HOROVOD_CYCLE_TIME=10 HOROVOD_FUSION_THRESHOLD=4194304 \\
        horovodrun --gloo -np 2 -H localhost:2 python tests/parallel/torch_reinit.py OUT
"""
import json
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


if __name__ == "__main__":
    main()
