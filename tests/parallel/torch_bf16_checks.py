"""bfloat16 models and tensors through Horovod and hvdtrain.torch on real ranks: the precision
GPU users train in, checked on the CPU. Horovod 0.28.1 has no bfloat16 type
(horovod/horovod#4047) and refused such tensors in every collective ("Tensor type
torch.BFloat16Tensor is not supported."); hvdtrain's build (scripts/horovod_patches/17-*)
reduces them on float32 copies, rounded once into bfloat16, and moves their bits as int16.

Each rank compares with its own one-process reference: every rank's shard gradient computed
here, averaged in float32 and rounded once to bfloat16, applied by the same optimizer.
Collectives are compared bit for bit. Rank 0 writes what the ranks saw as JSON;
tests/parallel/test_torch_layout.py asserts on it.

Launch::

    horovodrun -np 2 python tests/parallel/torch_bf16_checks.py --out result.json
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd
import hvdtrain.torch as ht

BF16 = torch.bfloat16
LOCAL = 4  # samples per rank and step
STEPS = 3
NAN_PAYLOAD = 0x7FC1  # a bfloat16 NaN with a payload: kept only by a bit-exact move


def bf16_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(BF16)


def batches(size):
    """The global batches, the same on every rank: STEPS x (LOCAL x size, 6) bfloat16 inputs."""
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(LOCAL * size, 6, generator=gen).to(BF16),
             torch.randint(0, 3, (LOCAL * size,), generator=gen)) for _ in range(STEPS)]


def shard(t, rank):
    return t[rank * LOCAL:(rank + 1) * LOCAL]


def loss_of(model, x, y):
    return F.cross_entropy(model(x).float(), y)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def bits(t):
    return t.detach().contiguous().view(torch.int16).flatten().tolist()


def reference(size):
    """One process: each step, every rank's shard gradient, averaged in float32 and rounded
    once to bfloat16 (what the all-reduce does), then the same SGD step."""
    model = bf16_model()
    optimizer = sgd(model)
    for x, y in batches(size):
        shards = []
        for r in range(size):
            model.zero_grad()
            loss_of(model, shard(x, r), shard(y, r)).backward()
            shards.append([p.grad.float() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = (sum(g[i] for g in shards) / size).to(BF16)
        optimizer.step()
    return model


def train(size, rank, kind):
    """``hvdtrain``: distribute(); ``horovod``: Horovod's own DistributedOptimizer with
    broadcast_parameters and broadcast_optimizer_state from a rank 1 that starts elsewhere."""
    model = bf16_model(seed=rank if kind == "horovod" else 0)
    if kind == "hvdtrain":
        model, optimizer = ht.distribute(model, sgd(model), lr_scaling="none")
    else:
        optimizer = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in batches(size):
        optimizer.zero_grad()
        loss_of(model, shard(x, rank), shard(y, rank)).backward()
        optimizer.step()
    return model


def trained(size, rank):
    ref = reference(size)
    out = {}
    for kind in ("hvdtrain", "horovod"):
        model = train(size, rank, kind)
        mine = [bits(p) for p in model.parameters()]
        out[kind] = {
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "equal_to_reference": mine == [bits(p) for p in ref.parameters()],
            "ranks_equal": all(m == mine for m in hvd.allgather_object(mine, name=f"bf16.{kind}")),
            "moved": max((p.float() - q.float()).abs().max().item()
                         for p, q in zip(model.parameters(), bf16_model().parameters())),
        }
    return out


def expected(values, reduce):
    """What a reduction over the ranks' ``values`` gives: computed in float32, rounded once."""
    return reduce(torch.stack([v.float() for v in values])).to(BF16)


def collectives(size, rank):
    """Every collective on bfloat16 tensors, each result compared bit for bit with what it
    should be (reductions: float32, rounded once; moves: the same bits)."""
    base = torch.tensor([1 / 3, 2.0, -7.5, 1e-3, 3.0e38], dtype=BF16)
    mine = [base * (r + 1) for r in range(size)]  # rank r's values; 3e38 * 2 overflows to inf
    x = mine[rank]
    checks = {
        "allreduce_sum": bits(hvd.allreduce(x, op=hvd.Sum)) == bits(
            expected(mine, lambda t: t.sum(0))),
        "allreduce_average": bits(hvd.allreduce(x, op=hvd.Average)) == bits(
            expected(mine, lambda t: t.sum(0) / size)),
        "allreduce_min": bits(hvd.allreduce(x, op=hvd.Min)) == bits(
            expected(mine, lambda t: t.min(0).values)),
        "allreduce_max": bits(hvd.allreduce(x, op=hvd.Max)) == bits(
            expected(mine, lambda t: t.max(0).values)),
    }
    inplace = x.clone()
    returned = hvd.allreduce_(inplace, op=hvd.Sum)
    checks["allreduce_in_place"] = returned is inplace and bits(inplace) == bits(
        expected(mine, lambda t: t.sum(0)))
    pair = hvd.grouped_allreduce([x, torch.full((2,), float(rank))], op=hvd.Sum)
    checks["grouped_allreduce_with_float32"] = (
        bits(pair[0]) == bits(expected(mine, lambda t: t.sum(0))) and pair[0].dtype == BF16
        and pair[1].tolist() == [size * (size - 1) / 2] * 2)
    rows = torch.arange(2 * size, dtype=torch.float32).to(BF16) * (rank + 1)
    scattered = hvd.reducescatter(rows, op=hvd.Sum)
    full = expected([torch.arange(2 * size, dtype=torch.float32).to(BF16) * (r + 1)
                     for r in range(size)], lambda t: t.sum(0))
    checks["reducescatter"] = scattered.dtype == BF16 and bits(scattered) == bits(
        full[2 * rank:2 * rank + 2])
    # Moves: special values (inf, -0.0, a subnormal, a NaN with a payload) keep their bits.
    special = torch.tensor([NAN_PAYLOAD, 0x7F80, -0x8000, 0x0001, rank],
                           dtype=torch.int16).view(BF16)
    checks["allgather"] = bits(hvd.allgather(special)) == [
        b for r in range(size) for b in [NAN_PAYLOAD, 0x7F80, -0x8000, 0x0001, r]]
    root = size - 1
    sent = bits(hvd.broadcast(special, root_rank=root))
    checks["broadcast"] = sent == [NAN_PAYLOAD, 0x7F80, -0x8000, 0x0001, root]
    inplace = special.clone()
    checks["broadcast_in_place"] = (hvd.broadcast_(inplace, root_rank=root) is inplace
                                    and bits(inplace) == sent)
    outgoing = torch.tensor([100 * rank + j for j in range(size)], dtype=torch.int16).view(BF16)
    received = hvd.alltoall(outgoing)
    checks["alltoall"] = received.dtype == BF16 and bits(received) == [
        100 * r + rank for r in range(size)]
    return checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = ht.init(seed=0)
    checks = collectives(info.size, info.rank)
    result = {"size": info.size, "trained": trained(info.size, info.rank),
              "collectives": hvd.allgather_object(checks, name="bf16.collectives")}
    if info.is_root:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
