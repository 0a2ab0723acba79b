"""PyTorch Lightning 2.x with ``Trainer(strategy="horovod")`` (hvdtrain.torch.lightning) on real
ranks, each case against one process training on the global batch with a plain torch loop:

- ``automatic``: SGD with momentum, a per-epoch SequentialLR (warmup, then StepLR),
  ``accumulate_grad_batches=4`` over epochs of 6 micro-batches (a partial group at each epoch's
  end), ``gradient_clip_val`` (the clipping must see the averaged gradients),
  ``self.log(sync_dist=True)``, ``self.all_gather`` (with gradients), a ModelCheckpoint written
  by rank 0 only, a second fit of the same module refused;
- ``resumed``: one epoch, then a new module and Trainer resumed from its checkpoint;
- ``manual``: ``automatic_optimization = False`` with two optimizers (Lightning 2's way to train
  several), ``manual_backward``;
- ``refusals``: a GradientAccumulationScheduler callback, what ``reduce`` refuses, torchmetrics
  with and without ``metric_sync()``.

Rank 0 writes what it saw as JSON; tests/parallel/test_existing_code.py asserts on it::

    horovodrun -np 2 python tests/parallel/lightning_checks.py --out result.json
"""
import argparse
import json
import os
from pathlib import Path

import horovod.torch as hvd
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdtrain.torch
import hvdtrain.torch.lightning  # noqa: F401  (registers strategy="horovod")

LOCAL, K, EPOCHS, LR, CLIP = 8, 4, 2, 0.2, 0.5


def data(size):
    """6 global batches per epoch: (6 x LOCAL x size, 6) inputs, labels of 3 classes."""
    gen = torch.Generator().manual_seed(3)
    n = 6 * LOCAL * size
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def optimizer_and_schedule(params):
    """SGD with momentum and a per-epoch SequentialLR: a linear warmup from LR / 2 for the first
    epoch, then StepLR halving (a schedule of schedules, as warmups are usually written)."""
    sched = torch.optim.lr_scheduler
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    return opt, sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.5, total_iters=1),
                                         sched.StepLR(opt, step_size=1, gamma=0.5)],
                                   milestones=[1])


class CountingIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, counting the files this rank writes."""

    def __init__(self):
        super().__init__()
        self.saved = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved += 1
        return super().save_checkpoint(checkpoint, path, storage_options)


class Automatic(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()
        self.gathered = None

    def training_step(self, batch, index):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        if index == 0:
            self.gathered = self.all_gather(torch.tensor([float(self.global_rank), 7.0]))
        return loss

    def configure_optimizers(self):
        opt, schedule = optimizer_and_schedule(self.parameters())
        return [opt], [schedule]


class Manual(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = net()

    def training_step(self, batch, index):
        x, y = batch
        first, second = self.optimizers()
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=LR),
                torch.optim.Adam(self.net[2].parameters(), lr=0.01)]


def epoch_order(n, epoch):
    """The samples of an epoch in the order the ranks' batches take them together: the Trainer
    puts a shuffling DistributedSampler in (seed ``PL_GLOBAL_SEED`` or 0, plus the epoch), whose
    rank r takes every size-th sample of one permutation from the r-th on, so the ranks' i-th
    batches together are the permutation's i-th run of LOCAL x size samples."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) + epoch
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def reference_automatic(size):
    """One process, global batches of LOCAL x size, the same accumulation, clipping and
    schedule: the weights and the final learning rate."""
    model = net()
    opt, schedule = optimizer_and_schedule(model.parameters())
    data_x, data_y = data(size)
    batch = LOCAL * size
    for epoch in range(EPOCHS):
        order = epoch_order(len(data_x), epoch)
        x, y = data_x[order], data_y[order]
        starts = range(0, len(x), batch)
        for j, start in enumerate(starts):
            loss = F.cross_entropy(model(x[start:start + batch]), y[start:start + batch])
            (loss / K).backward()  # Lightning divides each micro-batch's loss by k
            if (j + 1) % K == 0 or j + 1 == len(starts):
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
        schedule.step()
    return flat(model), opt.param_groups[0]["lr"]


def reference_manual(size):
    model = net()
    first = torch.optim.SGD(model[0].parameters(), lr=LR)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    x, y = data(size)
    order = epoch_order(len(x), 0)
    x, y = x[order], y[order]
    batch = LOCAL * size
    for start in range(0, len(x), batch):
        F.cross_entropy(model(x[start:start + batch]), y[start:start + batch]).backward()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    return flat(model)


def loader(size):
    x, y = data(size)  # the Trainer shuffles it with a DistributedSampler (epoch_order)
    return DataLoader(TensorDataset(x, y), batch_size=LOCAL, shuffle=False)


def trainer(folder, **kwargs):
    return L.Trainer(strategy="horovod", accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(folder), **kwargs)


def spread(vector):
    every = hvd.allgather(vector.unsqueeze(0))
    return float((every - every[0]).abs().max())


def every_rank(value):
    return hvd.allgather_object(value)


def automatic(folder, size):
    model, io = Automatic(), CountingIO()
    checkpoints = Path(folder) / "checkpoints"
    fit = trainer(folder, max_epochs=EPOCHS, accumulate_grad_batches=K, gradient_clip_val=CLIP,
                  plugins=[io],
                  callbacks=[ModelCheckpoint(dirpath=str(checkpoints), filename="last")])
    fit.fit(model, loader(size))
    weights = flat(model.net)
    hvd.barrier()
    saved = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
    state = torch.load(checkpoints / "last.ckpt", weights_only=False) if saved else {}
    logged = fit.callback_metrics["train_loss"].reshape(1)
    reference, reference_lr = reference_automatic(size)
    x = torch.tensor([hvd.rank() + 1.0], requires_grad=True)
    (fit.strategy.all_gather(x, sync_grads=True).sum() * (hvd.rank() + 1)).backward()
    try:  # the same module again: Horovod's hooks are on its parameters
        trainer(folder, max_epochs=1).fit(model, loader(size))
    except ValueError as exc:
        again = str(exc)
    return {"vs_reference": float((weights - reference).abs().max()),
            "rank_spread": spread(weights),
            "optimizer_steps": fit.global_step,
            "world_size": fit.world_size,
            "global_rank": every_rank(fit.global_rank),
            "is_global_zero": every_rank(fit.is_global_zero),
            "rank_zero_only": every_rank(rank_zero_only.rank),
            "sampler": type(fit.train_dataloader.sampler).__name__,
            "logged_spread": spread(logged),
            "gathered": model.gathered.tolist(),
            # d/dx_r of the sum over ranks j of (j + 1) * sum(all_gather(x)), as under DDP
            "gathered_grad": every_rank(x.grad.item()),
            "lr": fit.optimizers[0].param_groups[0]["lr"], "reference_lr": reference_lr,
            "checkpoints": saved, "checkpoints_written": every_rank(io.saved),
            "checkpoint_matches": bool(saved) and torch.equal(
                torch.cat([v.flatten() for k, v in state["state_dict"].items()]), weights),
            "fit_again": again}


def resumed(folder, size):
    """One epoch, a checkpoint, then a new module and Trainer resumed from it (ckpt_path) for
    the second: the weights and learning rate of the uninterrupted reference."""
    checkpoints = Path(folder) / "resume"
    first = trainer(folder, max_epochs=1, accumulate_grad_batches=K, gradient_clip_val=CLIP,
                    callbacks=[ModelCheckpoint(dirpath=str(checkpoints), filename="epoch1")])
    first.fit(Automatic(), loader(size))
    model = Automatic()
    second = trainer(folder, max_epochs=EPOCHS, accumulate_grad_batches=K,
                     gradient_clip_val=CLIP, enable_checkpointing=False)
    second.fit(model, loader(size), ckpt_path=str(checkpoints / "epoch1.ckpt"))
    weights = flat(model.net)
    reference, reference_lr = reference_automatic(size)
    return {"vs_reference": float((weights - reference).abs().max()),
            "rank_spread": spread(weights), "lr": second.optimizers[0].param_groups[0]["lr"],
            "reference_lr": reference_lr}


def manual(folder, size):
    model = Manual()
    trainer(folder, max_epochs=1).fit(model, loader(size))
    weights = flat(model.net)
    return {"vs_reference": float((weights - reference_manual(size)).abs().max()),
            "rank_spread": spread(weights)}


def refusals(folder, size):
    seen = {}
    fit = trainer(folder, max_epochs=1,
                  callbacks=[GradientAccumulationScheduler(scheduling={0: 2})])
    try:
        fit.fit(Automatic(), loader(size))
    except ValueError as exc:
        seen["accumulation_scheduler"] = str(exc)
    try:
        fit.strategy.reduce(torch.ones(1), reduce_op="product")
    except ValueError as exc:
        seen["reduce_op"] = str(exc)
    seen["reduce_sum"] = fit.strategy.reduce(torch.ones(2), reduce_op="sum").tolist()
    seen["reduce_int_mean"] = fit.strategy.reduce(torch.tensor(hvd.rank())).item()
    seen["reduce_other"] = fit.strategy.reduce("not a tensor")
    seen["broadcast"] = fit.strategy.broadcast({"from": hvd.rank()}, src=1)
    from torchmetrics import CatMetric, SumMetric
    sync = hvdtrain.torch.lightning.metric_sync()
    cat, alone = CatMetric(**sync), CatMetric()
    for metric in (cat, alone):  # rank r: 0, ..., r + 1
        metric.update(torch.arange(hvd.rank() + 2.0))
    total = SumMetric(**sync)
    total.update(torch.tensor(hvd.rank() + 1.0))
    seen["metrics"] = {"cat": cat.compute().tolist(), "alone": alone.compute().tolist(),
                       "sum": total.compute().item()}
    try:
        hvdtrain.torch.lightning.HorovodStrategy(compression="int8")
    except ValueError as exc:
        seen["compression"] = str(exc)
    return seen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    size = hvd.size()
    folder = Path(args.out).parent / f"rank{hvd.rank()}"
    shared = Path(args.out).parent / "shared"  # where rank 0 alone writes the checkpoint
    before = torch.get_rng_state()
    info = hvdtrain.torch.init(seed=None)  # what the strategy calls: the generators untouched
    result = {"size": size,
              "init_seed_none": {"seed": info.seed,
                                 "rng_unchanged": torch.equal(before, torch.get_rng_state())},
              "automatic": automatic(shared, size),
              "resumed": resumed(shared, size),
              "manual": manual(folder, size),
              "refusals": refusals(folder, size)}
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    else:
        os.makedirs(folder, exist_ok=True)


if __name__ == "__main__":
    main()
