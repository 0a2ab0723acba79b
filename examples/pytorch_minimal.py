"""The smallest complete hvdtrain.torch program: a CNN on scikit-learn's digits.

Launch::

    horovodrun -np 2 python examples/pytorch_minimal.py [result.json]
    mpirun -np 2 -bind-to none -map-by slot -x PATH python examples/pytorch_minimal.py
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvdtrain.torch as ht
from hvdtrain import datasets, schedule
from hvdtrain.torch.models import DigitsCNN

K = 2  # backward_passes_per_step: one all-reduce per 2 micro-batches

info = ht.init(seed=0)                       # hvd.init(), threads per rank, per-rank seed
split = datasets.load_digits()
train = TensorDataset(torch.from_numpy(split.x_train), torch.from_numpy(split.y_train))
sampler = DistributedSampler(train, num_replicas=info.size, rank=info.rank, shuffle=True)
loader = DataLoader(train, batch_size=16, sampler=sampler)

model = DigitsCNN()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=K,
                                 lr_scaling="linear")          # lr x size x K, rank 0's weights
scheduler = ht.warmup(optimizer, warmup_epochs=1,
                      steps_per_epoch=schedule.steps_per_epoch(len(loader), K))

for epoch in range(10):
    sampler.set_epoch(epoch)
    for (x, y), micro in ht.micro_batches(loader, K):
        loss = F.cross_entropy(model(x), y)
        (loss * micro.loss_weight).backward()                  # mean over the global batch
        if micro.sync:                                         # last micro-batch of the group
            optimizer.step()                                   # all-reduce happens here
            optimizer.zero_grad()
            scheduler.step()

model.eval()
with torch.no_grad():
    pred = model(torch.from_numpy(split.x_test)).argmax(1)
accuracy = (pred == torch.from_numpy(split.y_test)).float().mean().item()
if info.rank == 0:
    print(f"held-out accuracy {accuracy:.4f} on {info.size} ranks")
    import json, sys                                           # optional: results as a file
    if len(sys.argv) > 1:                                      # (tests read them from there)
        with open(sys.argv[1], "w") as f:
            json.dump({"accuracy": accuracy, "size": info.size}, f)
