"""PyTorch and Horovod habits on hvdtrain.torch's optimizer, on real ranks: zero_grad(set_to_none=...),
several models (each through distribute(), or one through Horovod's own DistributedOptimizer
beside them) with gradients in one backward pass, parameters added with add_param_group() or
unfrozen after distribute(), distribute() twice; Horovod's hvd.join() for uneven data, then the
collectives users call without a name. Every trained case is compared with one process training
on the global batch.
Rank 0 writes what it saw as JSON; tests/parallel/test_existing_code.py asserts on it.

Launch::

    horovodrun -np 2 python tests/parallel/torch_habits.py --out result.json [--join]
"""
import argparse
import json

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import hvdtrain.torch as ht

LOCAL = 8  # samples per rank and step
STEPS = 3


def batches(size):
    """The global batches, the same on every rank: STEPS x (LOCAL x size, 6) inputs, labels."""
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(LOCAL * size, 6, generator=gen),
             torch.randint(0, 3, (LOCAL * size,), generator=gen)) for _ in range(STEPS)]


def shard(x, rank):
    return x[rank * LOCAL:(rank + 1) * LOCAL]


def two_models():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh()), nn.Linear(5, 3)


def flat(*modules):
    return torch.cat([p.detach().flatten() for m in modules for p in m.parameters()])


def extra_layers():
    torch.manual_seed(1)
    return nn.Linear(5, 5), nn.Linear(3, 3)


def reference(size, kind, set_to_none=True):
    """One process, the global batch, plain torch.optim: the weights after STEPS steps (for
    ``kind="unfreeze"`` the second model is frozen in the first step; ``"two_late_groups"``
    has a layer more after each model)."""
    enc, dec = two_models()
    modules = [enc, dec]
    if kind == "two_late_groups":
        extra_enc, extra_dec = extra_layers()
        enc, dec = nn.Sequential(enc, extra_enc), nn.Sequential(dec, extra_dec)
        modules = [enc, dec]
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1 * size,
                          momentum=0.9)
    for step, (x, y) in enumerate(batches(size)):
        dec.requires_grad_(not (kind == "unfreeze" and step == 0))
        F.cross_entropy(dec(enc(x)), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return flat(*modules)


def train(size, rank, kind, set_to_none=True):
    """STEPS steps on this rank's shard, the two models distributed as ``kind`` says:
    both_hvdtrain (distribute() each), beside_horovod (the second through Horovod's own
    DistributedOptimizer), late_group (the second added with add_param_group() after
    distribute()), unfreeze (one optimizer; the second model frozen at distribute() and in the
    first step, then trainable). Returns (weights, what the gradients were after zero_grad)."""
    enc, dec = two_models()
    if kind == "unfreeze":
        dec.requires_grad_(False)
        opt_enc = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1, momentum=0.9)
    else:
        opt_enc = torch.optim.SGD(enc.parameters(), lr=0.1, momentum=0.9)
    opt_dec = torch.optim.SGD(dec.parameters(), lr=0.1, momentum=0.9)
    if kind == "unfreeze":
        _, opt_enc = ht.distribute(nn.Sequential(enc, dec), opt_enc, lr_scaling="linear")
    else:
        enc, opt_enc = ht.distribute(enc, opt_enc, lr_scaling="linear")
    optimizers = [opt_enc]
    if kind in ("both_hvdtrain", "two_late_groups"):
        dec, opt_dec = ht.distribute(dec, opt_dec, lr_scaling="linear")
        optimizers.append(opt_dec)
    if kind == "two_late_groups":
        # A layer more for each model, added to its optimizer without an lr: each group gets
        # the scaled rate, and the two groups' all-reduces names of their own.
        extra_enc, extra_dec = extra_layers()
        opt_enc.add_param_group({"params": list(extra_enc.parameters())})
        opt_dec.add_param_group({"params": list(extra_dec.parameters())})
        enc, dec = nn.Sequential(enc, extra_enc), nn.Sequential(dec, extra_dec)
    elif kind == "beside_horovod":  # as a Horovod script has it
        for group in opt_dec.param_groups:
            group["lr"] *= size
        hvd.broadcast_parameters(dec.state_dict(), root_rank=0)
        optimizers.append(hvd.DistributedOptimizer(opt_dec,
                                                   named_parameters=dec.named_parameters()))
    elif kind == "late_group":
        hvd.broadcast_parameters(dec.state_dict(), root_rank=0)
        opt_enc.add_param_group({"params": list(dec.parameters()), "lr": 0.1 * size})
    grads_after_zero = None
    for step, (x, y) in enumerate(batches(size)):
        if kind == "unfreeze" and step == 1:
            dec.requires_grad_(True)
        # One backward pass gives both models gradients: both all-reduce at once.
        F.cross_entropy(dec(enc(shard(x, rank))), shard(y, rank)).backward()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        grads_after_zero = sorted({"none" if p.grad is None else
                                   ("zeros" if not p.grad.any() else "values")
                                   for m in (enc, dec) for p in m.parameters()})
    return flat(enc, dec), grads_after_zero


def distribute_twice():
    model = nn.Linear(3, 2)
    model, optimizer = ht.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        ht.distribute(model, optimizer)
    except ValueError as exc:
        return str(exc)
    return "no error"


def rank_spread(weights):
    """The largest difference between this rank's ``weights`` and any rank's."""
    return max((w - weights).abs().max().item() for w in hvd.allgather_object(weights))


def join_then_unnamed_collectives(size, rank):
    """Horovod's habit for uneven data: rank r takes STEPS - 1 + r steps with Horovod's own
    DistributedOptimizer, ends its loop with ``hvd.join()`` and takes the weights of the last rank
    to join; then the collectives users call without a name (a validation metric's all-reduce).
    Before scripts/horovod_patches/16-*, the ranks named those after their own count of
    operations, which the steps taken alone had made unequal, and the first one waited forever."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for x, y in batches(size)[:STEPS - 1 + rank]:
        optimizer.zero_grad()
        F.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
        optimizer.step()
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    r = float(rank)
    seen = {
        "last_joined": last,
        "allreduce": hvd.allreduce(torch.tensor([r + 1]), op=hvd.Sum).tolist(),
        "allgather": hvd.allgather(torch.tensor([r])).tolist(),
        "broadcast": hvd.broadcast(torch.tensor([r]), root_rank=size - 1).tolist(),
        "alltoall": hvd.alltoall(torch.arange(size, dtype=torch.float32) + 10 * r).tolist(),
        "reducescatter": hvd.reducescatter(torch.full((size,), r + 1), op=hvd.Sum).tolist(),
        "grouped_allreduce": [t.tolist() for t in hvd.grouped_allreduce(
            [torch.tensor([r]), torch.ones(2)], op=hvd.Sum)],
    }
    return {"ranks": hvd.allgather_object(seen), "rank_spread": rank_spread(flat(model))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--join", action="store_true",
                   help="only join_then_unnamed_collectives (a request of its own: a hang there "
                        "ends the pool, not the other cases)")
    args = p.parse_args()
    info = ht.init(seed=0)
    size, rank = info.size, info.rank
    result = {"size": size}
    if args.join:
        result["join"] = join_then_unnamed_collectives(size, rank)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        return
    for name, kind, set_to_none in (("hvdtrain_set_to_none", "both_hvdtrain", True),
                                    ("hvdtrain_zeros", "both_hvdtrain", False),
                                    ("beside_horovod", "beside_horovod", True),
                                    ("late_group", "late_group", True),
                                    ("two_late_groups", "two_late_groups", True),
                                    ("unfreeze", "unfreeze", True)):
        weights, grads = train(size, rank, kind, set_to_none)
        result[name] = {"vs_reference": (weights - reference(size, kind, set_to_none)).abs().max().item(),
                        "rank_spread": rank_spread(weights), "grads_after_zero_grad": grads}
    result["distribute_twice"] = distribute_twice()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
