"""Two models in one program: a small GAN on scikit-learn's digits, generator and discriminator
each through hvdtrain.torch.distribute (a teacher and a student go the same way).

Launch::

    horovodrun -np 2 python examples/pytorch_gan.py [result.json]

Each distribute() call all-reduces its model's gradients under names of its own, so both models
can have gradients in flight at once. The discriminator is frozen during the generator's step,
so that step's backward pass leaves no gradients (and no all-reduce) in it: not required (GAN
code written for DDP, which does not freeze it, runs unchanged), but one all-reduce cheaper.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvdtrain.torch as ht
from hvdtrain import datasets

NOISE = 16  # generator input size

info = ht.init(seed=0)
split = datasets.load_digits()
real = torch.from_numpy(split.x_train).flatten(1)               # (N, 64), pixels in [0, 1]
sampler = DistributedSampler(TensorDataset(real), num_replicas=info.size, rank=info.rank,
                             shuffle=True, drop_last=True)
loader = DataLoader(TensorDataset(real), batch_size=32, sampler=sampler, drop_last=True)

G = nn.Sequential(nn.Linear(NOISE, 128), nn.ReLU(), nn.Linear(128, 64), nn.Sigmoid())
D = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
G, opt_g = ht.distribute(G, opt_g, lr_scaling="none")    # one call per model and optimizer,
D, opt_d = ht.distribute(D, opt_d, lr_scaling="none")    # in the same order on every rank

ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
for epoch in range(30):
    sampler.set_epoch(epoch)
    for (x,) in loader:
        fake = G(torch.randn(32, NOISE))
        # Discriminator: real -> 1, fake -> 0 (fake detached: no gradient into G).
        d_loss = (F.binary_cross_entropy_with_logits(D(x), ones)
                  + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros))
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()
        # Generator: make D say 1; D frozen, so only G's gradients are all-reduced.
        D.requires_grad_(False)
        g_loss = F.binary_cross_entropy_with_logits(D(fake), ones)
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        D.requires_grad_(True)

# How close the generated digits' mean image is to the real one (mean squared pixel error).
with torch.no_grad():
    samples = G(torch.randn(1000, NOISE))
    mean_error = (samples.mean(0) - real.mean(0)).pow(2).mean().item()
    grey = (torch.full((64,), 0.5) - real.mean(0)).pow(2).mean().item()
if info.rank == 0:
    print(f"generated mean image error {mean_error:.4f} (all-grey image: {grey:.4f}) "
          f"on {info.size} ranks")
import json, sys                                                 # optional: results as a file
import horovod.torch as hvd                                      # (tests read them from there)
weights = hvd.allgather_object(torch.cat([p.detach().flatten() for m in (G, D)
                                          for p in m.parameters()]))
if info.rank == 0 and len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"size": info.size, "mean_error": mean_error, "grey_error": grey,
                   "rank_spread": max((w - weights[0]).abs().max().item() for w in weights),
                   "d_loss": d_loss.item(), "g_loss": g_loss.item()}, f)
