"""Counts the all-reduce operations of one epoch, for backward_passes_per_step k=1 and k=4, two
ways: Horovod's own timeline (``hvd.start_timeline`` around the epoch; every executed ALLREDUCE
of a gradient tensor), and calls into ``horovod.torch.optimizer.allreduce_async_`` (wrapped with a
counter; the real call still runs).

Launch::

    horovodrun -np 2 python tests/parallel/torch_allreduce_count.py --out counts.json
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import horovod.torch as hvd
import horovod.torch.optimizer as hvd_optimizer
import hvdtrain.torch as ht
from hvdtrain.timeline import count_ops, load_events
from hvdtrain.torch.models import DigitsCNN

calls = {"n": 0}
_real = hvd_optimizer.allreduce_async_


def counting_allreduce_async_(*args, **kwargs):
    calls["n"] += 1
    return _real(*args, **kwargs)




def one_epoch(k: int, info, samples: int, batch_size: int, timeline: str) -> dict:
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=k)
    data = TensorDataset(torch.randn(samples, 1, 8, 8), torch.randint(0, 10, (samples,)))
    sampler = DistributedSampler(data, num_replicas=info.size, rank=info.rank, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    calls["n"] = 0
    steps = micro = 0
    batches = ht.micro_batches(loader, k)  # compares the ranks' batch counts (one all-reduce)
    hvd.start_timeline(timeline, mark_cycles=False)
    for (x, y), mb in batches:
        (F.cross_entropy(model(x), y) * mb.loss_weight).backward()
        micro += 1
        if mb.sync:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    hvd.stop_timeline()
    timeline_count = count_ops(load_events(timeline)) if info.rank == 0 else None
    return {"allreduces": calls["n"], "timeline_allreduces": timeline_count,
            "optimizer_steps": steps, "micro_batches": micro,
            "parameters": len(list(model.parameters()))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    hvd_optimizer.allreduce_async_ = counting_allreduce_async_
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"  # allow start_timeline/stop_timeline
    info = ht.init(seed=0)
    try:
        result = {f"k{k}": one_epoch(k, info, args.samples, args.batch_size,
                                     f"{args.out}.k{k}.timeline") for k in (1, 4)}
    finally:  # put back: a rank pool runs other scripts in this process after this one
        hvd_optimizer.allreduce_async_ = _real
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
