"""The canonical DCGAN loop (pytorch/examples ``dcgan/main.py``: its order of zero_grad, backward
and step calls, Adam for both nets, BCE loss, the discriminator never frozen) through
:func:`hvdtrain.torch.distribute` on real ranks, against one process training on the global batch.

The discriminator D gets gradients three times an iteration: ``errD_real.backward()`` and
``errD_fake.backward()`` before ``optimizerD.step()``, then ``errG.backward()`` in the generator
step, which the next iteration's ``netD.zero_grad()`` throws away. The nets have no BatchNorm (it
normalises each rank's shard, so no run on several ranks equals one process with it).

Cases: ``module`` (``netD.zero_grad()``, as the example), ``optimizer``
(``optimizerD.zero_grad()``), ``k2`` (``module`` with ``backward_passes_per_step=2``),
``summed`` (``optimizer`` with D's two losses summed into one backward pass). Mistakes
that must still raise: ``zero_in_place`` (``netD.zero_grad(set_to_none=False)`` while D's
gradients from the generator step are in flight), ``clip_early`` (``clip_grad_norm_`` on D
before ``optimizerD.synchronize()``). Rank 0 writes JSON; tests/parallel/test_dcgan.py asserts.

Launch::

    horovodrun -np 2 python tests/parallel/torch_dcgan.py --out result.json
"""
import argparse
import json
from collections import Counter

import horovod.torch as hvd
import horovod.torch.mpi_ops as hvd_mpi_ops
import horovod.torch.optimizer as hvd_optimizer
import torch
from torch import nn

import hvdtrain.torch as ht

LOCAL = 4  # samples per rank and step
STEPS = 5
NZ = 6  # noise size
LR = 0.01

names = []  # the gradient all-reduces this rank started, in order
prefixes = {}  # net ("G", "D") -> the prefix of its all-reduce names in the last distributed()
_real_allreduce_async_ = hvd_optimizer.allreduce_async_


def counting_allreduce_async_(tensor, *args, name=None, **kwargs):
    names.append(name)
    return _real_allreduce_async_(tensor, *args, name=name, **kwargs)



def nets():
    """(G, D): a small conv generator (noise -> 1x8x8 image) and conv discriminator."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(NZ, 4 * 4 * 4), nn.ReLU(), nn.Unflatten(1, (4, 4, 4)),
                              nn.ConvTranspose2d(4, 1, 4, 2, 1), nn.Tanh())
    discriminator = nn.Sequential(nn.Conv2d(1, 4, 4, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(),
                                  nn.Linear(4 * 4 * 4, 1), nn.Sigmoid())
    return generator, discriminator


def data(size):
    """STEPS global batches, the same on every rank: (real images, noise)."""
    gen = torch.Generator().manual_seed(3)
    return [(torch.rand(LOCAL * size, 1, 8, 8, generator=gen) * 2 - 1,
             torch.randn(LOCAL * size, NZ, generator=gen)) for _ in range(STEPS)]


def flat(*modules):
    return torch.cat([p.detach().flatten() for m in modules for p in m.parameters()])


def train(netG, netD, optimizerG, optimizerD, batches, zero="module", clip_early=False,
          summed=False):
    """pytorch/examples dcgan/main.py's loop body, per batch (real, noise); ``summed``: D's two
    losses summed into one backward pass (as many GAN codes have it)."""
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    for real, noise in batches:
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        if zero == "module":
            netD.zero_grad()
        elif zero == "optimizer":
            optimizerD.zero_grad()
        else:  # "in_place"
            netD.zero_grad(set_to_none=False)
        label = torch.full((real.size(0),), real_label)
        output = netD(real).view(-1)
        errD_real = criterion(output, label)
        if not summed:
            errD_real.backward()
        fake = netG(noise)
        if summed:  # errD_real's backward still needs the real labels
            label = torch.full((real.size(0),), fake_label)
        else:
            label.fill_(fake_label)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        if summed:
            (errD_real + errD_fake).backward()
        else:
            errD_fake.backward()
        if clip_early:
            torch.nn.utils.clip_grad_norm_(netD.parameters(), 0.1)
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()


def adam(net):
    return torch.optim.Adam(net.parameters(), lr=LR, betas=(0.5, 0.999))


def reference(size, summed=False):
    """One process, plain Adam, the global batch: the weights of G and D after STEPS steps."""
    netG, netD = nets()
    train(netG, netD, adam(netG), adam(netD), data(size), summed=summed)
    return flat(netG), flat(netD)


def distributed(size, rank, zero="module", k=1, clip_early=False, summed=False):
    """The same on this rank's shard through distribute() (D first, then G, on every rank)."""
    netG, netD = nets()
    netD, optimizerD = ht.distribute(netD, adam(netD), backward_passes_per_step=k,
                                     lr_scaling="none")
    netG, optimizerG = ht.distribute(netG, adam(netG), backward_passes_per_step=k,
                                     lr_scaling="none")
    # Each distribute() in a process names its model's all-reduces "model<N>.": N counts the
    # calls made so far, in this script and before it (a rank pool runs many scripts).
    prefixes.update(G=optimizerG.late_name_prefix, D=optimizerD.late_name_prefix)
    shards = [(real[rank * LOCAL:(rank + 1) * LOCAL], noise[rank * LOCAL:(rank + 1) * LOCAL])
              for real, noise in data(size)]
    del names[:]
    train(netG, netD, optimizerG, optimizerD, shards, zero=zero, clip_early=clip_early,
          summed=summed)
    in_flight_after_loop = len(optimizerD._handles)
    optimizerD.zero_grad()  # D's all-reduces of the last generator step: waited for, dropped
    return netG, netD, optimizerD, in_flight_after_loop


def counts(prefix_g, prefix_d):
    """How many all-reduces each net's parameters started (per parameter, as a set of counts)."""
    per_name = Counter(names)
    return {net: sorted({n for name, n in per_name.items() if name.startswith(p)})
            for net, p in (("G", prefix_g), ("D", prefix_d))}


def mistake(size, rank, **kwargs):
    """The error each rank got (type: message) from a loop with a mistake in it."""
    try:
        distributed(size, rank, **kwargs)
    except Exception as exc:  # noqa: BLE001 - what the user would see, whatever its type
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    hvd_optimizer.allreduce_async_ = counting_allreduce_async_
    try:  # put back: a rank pool runs other scripts in this process after this one
        run(args)
    finally:
        hvd_optimizer.allreduce_async_ = _real_allreduce_async_


def run(args) -> None:
    info = ht.init(seed=0)
    size, rank = info.size, info.rank
    result = {"size": size}
    for case, zero, k, summed in (("module", "module", 1, False),
                                  ("optimizer", "optimizer", 1, False),
                                  ("k2", "module", 2, False), ("summed", "optimizer", 1, True)):
        ref_g, ref_d = reference(size, summed)
        netG, netD, optimizerD, in_flight = distributed(size, rank, zero=zero, k=k,
                                                        summed=summed)
        weights = torch.cat([flat(netG), flat(netD)])
        spread = max((w - weights).abs().max().item() for w in hvd.allgather_object(weights))
        started = counts(prefixes["G"], prefixes["D"])
        result[case] = {
            "G_vs_reference": (flat(netG) - ref_g).abs().max().item(),
            "D_vs_reference": (flat(netD) - ref_d).abs().max().item(),
            "moved": (flat(netD) - flat(nets()[1])).abs().max().item(),
            "rank_spread": spread,
            "allreduces_per_parameter": started,
            "ranks_started_the_same": len({tuple(n) for n in hvd.allgather_object(names)}) == 1,
            "in_flight_after_loop": in_flight,
            "handles_left": len(hvd_mpi_ops._handle_map),
        }
    result["zero_in_place"] = hvd.allgather_object(mistake(size, rank, zero="in_place"))
    result["clip_early"] = hvd.allgather_object(mistake(size, rank, clip_early=True))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
