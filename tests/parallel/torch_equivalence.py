"""Data-parallel training with hvdtrain.torch equals single-process training on the global batch.

Launch (parallel; each rank starts from a different random model, rank 0's is broadcast)::

    horovodrun -np 2 python tests/parallel/torch_equivalence.py --out par.npz --samples 176

Reference (one process, batch = local batch x k x size, lr x size x k, same samples per step)::

    python tests/parallel/torch_equivalence.py --reference --world-size 2 --out ref.npz --samples 176
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hvdtrain.torch.models import DigitsCNN

SEED, BASE_LR, MOMENTUM = 7, 0.05, 0.9


def dataset(n: int) -> TensorDataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, n)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()]).numpy()


def parallel(args) -> None:
    import horovod.torch as hvd

    import hvdtrain.torch as ht

    info = ht.init(seed=SEED)
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=MOMENTUM)
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=args.k,
                                     lr_scaling="linear")
    data = dataset(args.samples)
    sampler = DistributedSampler(data, num_replicas=info.size, rank=info.rank, shuffle=True,
                                 seed=SEED)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x, y), micro in ht.micro_batches(loader, args.k):
            loss = F.cross_entropy(model(x), y)
            # --fixed-scale: the naive 1/k scaling, wrong for a partial last group (control).
            scale = 1.0 / args.k if args.fixed_scale else micro.loss_weight
            (loss * scale).backward()
            if micro.sync:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    weights = hvd.allgather_object(flat(model))
    if info.rank == 0:
        spread = max(float(np.abs(w - weights[0]).max()) for w in weights)
        np.savez(args.out, weights=weights[0], steps=steps, rank_spread=spread, size=info.size)


def reference(args) -> None:
    torch.manual_seed(SEED)
    model = DigitsCNN()
    n = args.world_size * args.k
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * n, momentum=MOMENTUM)
    data = dataset(args.samples)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=args.batch_size * n, sampler=sampler)
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    np.savez(args.out, weights=flat(model), steps=steps, rank_spread=0.0, size=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=176)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--reference", action="store_true")
    p.add_argument("--fixed-scale", action="store_true")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    (reference if args.reference else parallel)(args)


if __name__ == "__main__":
    main()
