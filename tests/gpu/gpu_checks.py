"""hvdtrain.torch on one CUDA GPU, checked at the adapter level: a ``torch.channels_last`` conv
model through distribute() against the same model in the default (contiguous) layout, and
``distribute(..., sync_batchnorm=True)`` on a BatchNorm model. The session's shared GPU job
(tests/gpu/rank_cases.py, cases ``layouts`` and ``sync_batchnorm``) calls :func:`layouts` and
:func:`batchnorm` and writes what they return as JSON; tests/gpu/test_gpu_adapter.py asserts on
it. On one rank Horovod would skip the gradient
all-reduce altogether; the layout check registers its hooks anyway, so the gradients do go through
NCCL.

Alone (one rank per GPU: NCCL refuses two ranks on one device)::

    horovodrun -np 1 python tests/gpu/gpu_checks.py --out result.json

TF32 is switched off here (``torch.backends.cudnn.allow_tf32``, on by default for convolutions on
Ampere and newer GPUs): with it, a convolution rounds its inputs to a 10-bit mantissa and the two
layouts' kernels would differ by ~1e-3, which says nothing about the adapter. In true float32
they differ only by the summation order of other cuDNN kernels (~1e-7 per step).
"""
import argparse
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
        nn.Conv2d(3, 16, 3, padding=1), *([nn.BatchNorm2d(16)] if batchnorm else []), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), *([nn.BatchNorm2d(16)] if batchnorm else []), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 4))


def batches(n=6, batch=8, size=12):
    """The same data for every run, made on the CPU (the CUDA generator differs)."""
    g = torch.Generator().manual_seed(100)
    return [(torch.randn(batch, 3, size, size, generator=g),
             torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def flat(model):
    return torch.cat([p.detach().double().cpu().flatten() for p in model.parameters()])


def train(device, memory_format, compression, k):
    """SGD with momentum through distribute(); returns the model, whether the 4D gradients were
    channels_last after the last all-reduce, and the all-reduces in flight at each step."""
    model = conv_net().to(device).to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=k,
                                     compression=compression, lr_scaling="none")
    if hvd.size() == 1:
        # Horovod registers its gradient hooks only at size > 1; register them here, so that on
        # one GPU too every gradient goes through the NCCL all-reduce (and, for channels_last,
        # as permuted views of their own memory: hvdtrain.torch.optimizer.DenseLayout), as on many
        # GPUs.
        optimizer._register_hooks()
    grad_formats, allreduced = [], []
    for (x, y), micro in ht.micro_batches(batches(), k):
        x = x.to(device).to(memory_format=memory_format)
        (F.cross_entropy(model(x), y.to(device)) * micro.loss_weight).backward()
        if micro.sync:
            # All-reduces in flight (started by the hooks during this backward pass).
            allreduced.append(sum(h is not None for h, _ in optimizer._handles.values()))
            optimizer.synchronize()
            grad_formats = [p.grad.is_contiguous(memory_format=torch.channels_last)
                            for p in model.parameters() if p.dim() == 4]
            with optimizer.skip_synchronize():
                optimizer.step()
            optimizer.zero_grad()
    return model, grad_formats, allreduced


def layouts(device):
    out = {}
    start = flat(conv_net())
    for compression, k in (("none", 2), ("fp16", 1)):
        contiguous, _, _ = train(device, torch.contiguous_format, compression, k)
        last, grad_cl, allreduced = train(device, torch.channels_last, compression, k)
        cpu, _, _ = train("cpu", torch.contiguous_format, compression, k)
        out[f"{compression}_k{k}"] = {
            "max_diff_to_contiguous": float((flat(contiguous) - flat(last)).abs().max()),
            "max_diff_cuda_to_cpu": float((flat(contiguous) - flat(cpu)).abs().max()),
            "moved": float((flat(last) - start).abs().max()),
            "grads_channels_last": grad_cl,
            "allreduces_per_step": allreduced,
            "parameters": len(list(last.parameters())),
            "weights_channels_last": [p.is_contiguous(memory_format=torch.channels_last)
                                      for p in last.parameters() if p.dim() == 4],
            "devices": sorted({str(p.device) for p in last.parameters()})}
    out["step_counts"] = step_counts(device)
    return out


def step_counts(device):
    """Device copies of gradient-sized tensors made through PyTorch ops, and host
    synchronisations PyTorch sees, in one bf16 autocast + channels_last step: the plain loop,
    and through distribute() with Horovod's hooks on (every gradient all-reduced, as at np >= 2);
    counted by benchmarks/gpu_breakdown.py's StepCounter."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_breakdown import counted_step
    x, y = batches(n=1)[0]
    x, y = x.to(device).to(memory_format=torch.channels_last), y.to(device)
    out = {}
    for name in ("plain", "distributed"):
        model = conv_net().to(device).to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name == "distributed":
            model, optimizer = ht.distribute(model, optimizer, lr_scaling="none")
            if hvd.size() == 1:
                optimizer._register_hooks()
        out[name] = counted_step(model, optimizer, x, y, bf16=True)
    return out


def bn_step(device, sync_batchnorm, steps=3):
    model = conv_net(batchnorm=True).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = ht.distribute(model, optimizer, lr_scaling="none",
                                     sync_batchnorm=sync_batchnorm)
    losses = []
    for x, y in batches()[:steps]:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def batchnorm(device):
    synced, losses = bn_step(device, sync_batchnorm=True)
    plain, plain_losses = bn_step(device, sync_batchnorm=False)
    norms = [m for m in synced.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    stats = lambda m: torch.cat([b.double().cpu().flatten() for n, b in m.named_buffers()  # noqa
                                 if "running" in n])
    result = {
        "types": [type(m).__name__ for m in norms],
        "losses": losses, "plain_losses": plain_losses,
        "num_batches_tracked": [int(m.num_batches_tracked) for m in norms],
        # At size 1 Horovod's layer normalises with the batch's own statistics: the same step as
        # torch's BatchNorm2d.
        "max_param_diff_to_plain_bn": float((flat(synced) - flat(plain)).abs().max()),
        "max_running_stats_diff_to_plain_bn": float((stats(synced) - stats(plain)).abs().max()),
        "moved": float((flat(synced) - flat(conv_net(batchnorm=True))).abs().max()),
    }
    # At size 1 hvd.SyncBatchNorm takes a shortcut (plain F.batch_norm); run its cross-rank path
    # (all-gather of per-rank mean/invstd/count, all-reduce of the backward sums) directly, on
    # one rank, against F.batch_norm: forward output and input/weight/bias gradients.
    from horovod.torch.sync_batch_norm import _SyncBatchNorm
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(8, 16, 6, 6, generator=g) * 3 + 1).to(device)
    weight = (torch.rand(16, generator=g) + 0.5).to(device)
    bias = torch.randn(16, generator=g).to(device)
    grad_out = torch.randn(8, 16, 6, 6, generator=g).to(device)

    def run(fn):
        xi, w, b = (t.clone().requires_grad_() for t in (x, weight, bias))
        rm, rv = torch.zeros(16, device=device), torch.ones(16, device=device)
        y = fn(xi, w, b, rm, rv)
        y.backward(grad_out)
        return [y.detach(), xi.grad, w.grad, b.grad, rm, rv]

    sync = run(lambda xi, w, b, rm, rv: _SyncBatchNorm.apply(xi, w, b, rm, rv, 1e-5, 0.1))
    ref = run(lambda xi, w, b, rm, rv: F.batch_norm(xi, rm, rv, w, b, True, 0.1, 1e-5))
    names = ["output", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var"]
    result["sync_path_max_diff"] = {n: float((a - b).abs().max()) for n, a, b in
                                    zip(names, sync, ref)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    info = ht.init(seed=1, device="cuda")
    device = torch.device(info.device)
    result = {"size": info.size, "device": info.device, "gpu": torch.cuda.get_device_name(device),
              "nccl_built": bool(hvd.nccl_built()), "layouts": layouts(device),
              "batchnorm": batchnorm(device)}
    if info.is_root:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
