"""Ranks that start with different parameters, buffers and optimizer state hold rank 0's after
``hvdtrain.torch.distribute``.

Launch::

    horovodrun -np 2 python tests/parallel/torch_broadcast.py --out result.json
"""
import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd
import hvdtrain.torch as ht


def model_with_buffers() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 10))


def snapshot(model, optimizer) -> dict:
    """Model state (parameters and buffers) and optimizer state tensors, flattened."""
    out = {f"model.{k}": v.detach().double().reshape(-1).numpy().copy()
           for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        for k, v in state.items():
            out[f"opt.{i}.{k}"] = torch.as_tensor(v).double().reshape(-1).numpy().copy()
    out["opt.lr"] = np.array([optimizer.param_groups[0]["lr"]])
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = ht.init(seed=100)  # each rank gets a different seed
    model = model_with_buffers()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * (1 + info.rank))
    # A local, rank-specific step: Adam moments, step counts and BatchNorm running stats differ.
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    before = snapshot(model, optimizer)
    model, optimizer = ht.distribute(model, optimizer, lr_scaling="none")
    after = snapshot(model, optimizer)
    all_before = hvd.allgather_object(before)
    all_after = hvd.allgather_object(after)
    if info.rank == 0:
        result = {
            "size": info.size,
            "keys": sorted(after),
            "spread_before": max(max_diff(b, all_before[0]) for b in all_before),
            "spread_after": max(max_diff(a, all_after[0]) for a in all_after),
            "root_changed": max_diff(all_before[0], all_after[0]),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
