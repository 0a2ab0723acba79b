"""``hvdtrain train --framework torch``: the fit loop on top of :mod:`hvdtrain.torch.adapter`.

Launch::

    horovodrun -np 2 hvdtrain train --framework torch --dataset digits
    mpirun -np 2 -bind-to none -map-by slot hvdtrain train --framework torch --dataset digits
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from hvdtrain import data, schedule
from hvdtrain.accumulation import micro_batches
from hvdtrain.config import TrainConfig
from hvdtrain.files import atomic_open
from hvdtrain.report import EpochMetrics, RunReport, run_header, setup_logging
from hvdtrain.torch import adapter
from hvdtrain.torch.models import build_model

CHECKPOINT_FILE = "checkpoint.pt"
log = logging.getLogger("hvdtrain")


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write ``payload`` with ``torch.save`` atomically (temp file, fsync, rename): a crash
    mid-write leaves the previous checkpoint intact. Call on rank 0 only. The payload holds only
    tensors, numbers, strings, lists and dicts, so it loads with ``torch.load(weights_only=True)``.
    """
    with atomic_open(path, "wb") as handle:
        torch.save(payload, handle)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, size: int,
             batch_size: int = 256) -> tuple[float, float]:
    """Mean loss and accuracy over ``(x, y)`` (shapes ``(N, ...)`` and ``(N,)``) on all ranks
    together: each rank scores an unpadded shard, and sums are all-reduced, so every sample counts
    exactly once. Returns ``(loss, accuracy)`` on every rank."""
    idx = torch.from_numpy(data.shard_indices(len(x), rank, size))
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for chunk in idx.split(batch_size):
            logits = model(x[chunk])
            loss_sum += F.cross_entropy(logits, y[chunk], reduction="sum").item()
            correct += (logits.argmax(1) == y[chunk]).sum().item()
    totals = adapter.allreduce_sums({"loss": loss_sum, "correct": correct, "n": len(idx)},
                                    name="hvdtrain.eval")
    return totals["loss"] / totals["n"], totals["correct"] / totals["n"]


def fit(cfg: TrainConfig) -> dict:
    """Train ``build_model`` on ``cfg.dataset`` with ``cfg``'s options on every rank.

    Rank 0 logs each epoch, shows a progress bar, and writes ``checkpoint.pt`` and
    ``metrics.json`` to ``cfg.output_dir`` after every epoch (atomically).

    Returns:
        The run report (the content of ``metrics.json``), on every rank.
    """
    info = adapter.init(cfg.seed)
    setup_logging(info.rank)
    # The split does not depend on --seed: every run holds out the same samples.
    split = data.load(cfg.dataset, test_fraction=cfg.test_fraction,
                      synthetic_samples=cfg.synthetic_samples)
    train_set = TensorDataset(torch.from_numpy(split.x_train), torch.from_numpy(split.y_train))
    sampler = DistributedSampler(train_set, num_replicas=info.size, rank=info.rank, shuffle=True,
                                 seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)
    x_test, y_test = torch.from_numpy(split.x_test), torch.from_numpy(split.y_test)

    model = build_model(split.num_classes, split.x_train.shape[-1])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    k = cfg.backward_passes_per_step
    model, optimizer = adapter.distribute(model, optimizer, backward_passes_per_step=k,
                                          lr_scaling=cfg.lr_scaling, compression=cfg.compression,
                                          op=cfg.op)
    steps_per_epoch = schedule.steps_per_epoch(len(loader), k)
    scheduler = adapter.warmup(optimizer, warmup_epochs=cfg.warmup_epochs,
                               steps_per_epoch=steps_per_epoch)
    out = Path(cfg.output_dir)
    header = run_header("torch", cfg, info, len(train_set), len(x_test), steps_per_epoch,
                        {"torch": torch.__version__, "horovod": horovod.__version__})
    report = RunReport(out, header, is_root=info.is_root)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        lr = optimizer.param_groups[0]["lr"]
        loss_sum, correct, seen, steps = 0.0, 0, 0, 0
        start = time.perf_counter()
        bar = tqdm(total=len(loader), desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch",
                   disable=not (info.is_root and cfg.progress), leave=False)
        for (x, y), micro in micro_batches(loader, k):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            (loss * micro.loss_scale).backward()
            loss_sum += loss.item() * micro.samples
            correct += (logits.argmax(1) == y).sum().item()
            seen += micro.samples
            if micro.sync:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                steps += 1
            bar.update()
        bar.close()
        seconds = time.perf_counter() - start
        totals = adapter.allreduce_sums({"loss": loss_sum, "correct": correct, "n": seen,
                                         "seconds": seconds}, name="hvdtrain.train")
        test_loss, test_acc = evaluate(model, x_test, y_test, info.rank, info.size)
        epoch_seconds = totals["seconds"] / info.size  # mean wall time over ranks
        metrics = EpochMetrics(epoch + 1, totals["loss"] / totals["n"],
                               totals["correct"] / totals["n"], test_loss, test_acc, lr, steps,
                               epoch_seconds, totals["n"] / epoch_seconds)
        if info.is_root:
            save_checkpoint(out / CHECKPOINT_FILE, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch + 1,
                "size": info.size, "global_batch": cfg.global_batch(info.size),
                "config": cfg.to_dict()})
        report.add(metrics)
    return report.to_dict()
