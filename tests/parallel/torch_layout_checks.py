"""Checks of hvdtrain.torch on real ranks for what GPU users rely on, run on the CPU:
``torch.channels_last`` models through distribute() (same weights as the contiguous model, the
gradients keep their format), BatchNorm running statistics made equal by sync_buffers (average
and broadcast), and the refusal of sync_batchnorm=True for a CPU model. Rank 0 writes what the
ranks saw as JSON; tests/parallel/test_torch_layout.py asserts on it.

Launch::

    horovodrun -np 2 python tests/parallel/torch_layout_checks.py --out result.json
"""
import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd
import hvdtrain.torch as ht


def conv_net(batchnorm=False):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), *([nn.BatchNorm2d(8)] if batchnorm else []), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(32, 4))


def batches(rank, n=6, batch=4):
    """Each rank its own data (as under a DistributedSampler)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(batch, 3, 6, 6, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n)]


def train(memory_format, compression, k, rank):
    """Returns (flat weights in float64, the 4D weight gradients' formats after a step)."""
    model = conv_net().to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=k,
                                     compression=compression, lr_scaling="none")
    grad_formats = []
    for (x, y), micro in ht.micro_batches(batches(rank), k):
        x = x.to(memory_format=memory_format)
        (F.cross_entropy(model(x), y) * micro.loss_weight).backward()
        if micro.sync:
            optimizer.synchronize()
            grad_formats = [p.grad.is_contiguous(memory_format=torch.channels_last)
                            for p in model.parameters() if p.dim() == 4]
            with optimizer.skip_synchronize():
                optimizer.step()
            optimizer.zero_grad()
    weights_cl = [p.is_contiguous(memory_format=torch.channels_last)
                  for p in model.parameters() if p.dim() == 4]
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    return flat, grad_formats, weights_cl


def layouts(rank):
    out = {}
    for compression, k in (("none", 2), ("fp16", 1)):
        plain, _, _ = train(torch.contiguous_format, compression, k, rank)
        last, grad_cl, weights_cl = train(torch.channels_last, compression, k, rank)
        gathered = hvd.allgather_object(last.tolist(), name=f"layout.{compression}")
        out[f"{compression}_k{k}"] = {
            "max_diff_to_contiguous": float((plain - last).abs().max()),
            "moved": float((last - torch.cat([p.detach().double().flatten()
                                               for p in conv_net().parameters()])).abs().max()),
            "grads_channels_last": grad_cl, "weights_channels_last": weights_cl,
            "ranks_equal": all(g == gathered[0] for g in gathered)}
    return out


def step_copies(rank):
    """Gradient-sized copies in one channels_last step (benchmarks/gpu_breakdown.py's
    counted_step): the plain loop, through distribute() (every gradient all-reduced: 2 ranks),
    and the same with the contiguous-copy layout DenseLayout had before (a control: the counter
    sees those copies)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_breakdown import CopyLayout, counted_step
    x, y = batches(rank, n=1)[0]
    x = x.to(memory_format=torch.channels_last)
    out = {}
    for name in ("plain", "distributed", "copy_layout"):
        model = conv_net().to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name != "plain":
            model, optimizer = ht.distribute(model, optimizer, lr_scaling="none")
            if name == "copy_layout":
                optimizer._compression = CopyLayout(optimizer._compression.inner)
        out[name] = counted_step(model, optimizer, x, y)["copies"]
    return out


class TwoBranches(nn.Module):
    """Two 3x3 convs; ``use_b`` False leaves ``b`` without a gradient (control flow)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)

    def forward(self, x, use_b):
        out = self.a(x)
        return out + self.b(x) if use_b else out


def unused_on_one_rank(rank):
    """channels_last weights; rank 1 gives ``b`` no gradient. Every gradient goes through the
    all-reduce in its memory order, so the zeros Horovod sends for rank 1 must be laid out as
    rank 0's gradient is. Returns the largest difference of ``b``'s weight after one SGD step
    from ``w - lr * g0 / 2`` (g0: rank 0's gradient, the average with rank 1's zeros), and
    whether the ranks agree."""
    model = TwoBranches().to(memory_format=torch.channels_last)
    w0 = model.b.weight.detach().clone()
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(7 + rank))
    x = x.to(memory_format=torch.channels_last)
    # Rank 0's own gradient of b, from a copy Horovod does not touch. The distributed model's
    # p.grad is all-reduced in place, in the background, once every rank has submitted it (rank 1
    # submits its zeros in step()): read between backward() and step() it was sometimes already
    # the average (g0 / 2; seen in 1 run in 3 under load, and in a clean-clone run).
    plain = copy.deepcopy(model)
    plain(x, use_b=rank == 0).square().mean().backward()
    g0 = plain.b.weight.grad.detach() if rank == 0 else torch.zeros_like(w0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ht.distribute(model, optimizer, lr_scaling="none")
    model(x, use_b=rank == 0).square().mean().backward()
    optimizer.step()
    g0 = hvd.broadcast(g0.contiguous(), root_rank=0, name="layout.g0")
    expected = w0 - 0.1 * g0 / 2
    w = model.b.weight.detach()
    gathered = hvd.allgather_object(w.tolist(), name="layout.unused")
    return {"max_diff": float((w - expected).abs().max()),
            "ranks_equal": all(g == gathered[0] for g in gathered)}


def running_stats(model):
    return torch.cat([b.double().flatten() for n, b in model.named_buffers()
                      if "running" in n])


def batchnorm(rank):
    out = {}
    for op in ("average", "broadcast"):
        model = conv_net(batchnorm=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = ht.distribute(model, optimizer, lr_scaling="none")
        for x, y in batches(rank):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        before = hvd.allgather_object(running_stats(model).tolist(), name=f"bn.before.{op}")
        count = ht.sync_buffers(model, op=op)
        after = hvd.allgather_object(running_stats(model).tolist(), name=f"bn.after.{op}")
        tracked = hvd.allgather_object(int(model[1].num_batches_tracked), name=f"bn.nbt.{op}")
        expected = (torch.tensor(before).mean(0) if op == "average" else torch.tensor(before[0]))
        out[op] = {"buffers": count,
                   "spread_before": float((torch.tensor(before[0]) - torch.tensor(before[1]))
                                          .abs().max()),
                   "spread_after": float((torch.tensor(after[0]) - torch.tensor(after[1]))
                                         .abs().max()),
                   "diff_to_expected": float((torch.tensor(after[0]) - expected).abs().max()),
                   "num_batches_tracked": tracked}
    try:
        ht.sync_buffers(model, op="median")
    except ValueError as exc:
        out["bad_op_error"] = str(exc)
    model = conv_net(batchnorm=True)
    try:
        ht.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm=True)
        out["sync_batchnorm_cpu_error"] = None
    except ValueError as exc:
        out["sync_batchnorm_cpu_error"] = str(exc)
    model = conv_net(batchnorm=True)
    params = [id(p) for p in model.parameters()]
    ht.convert_sync_batchnorm(model)
    out["converted"] = {"type": type(model[1]).__name__,
                        "same_parameters": [id(p) for p in model.parameters()] == params}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = ht.init(seed=1)
    result = {"size": info.size, "device": info.device, "layouts": layouts(info.rank),
              "step_copies": step_copies(info.rank),
              "unused_on_one_rank": unused_on_one_rank(info.rank),
              "batchnorm": batchnorm(info.rank)}
    if info.is_root:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
