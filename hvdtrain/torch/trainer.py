"""``hvdtrain train --framework torch``: the fit loop on top of :mod:`hvdtrain.torch.adapter`.

Launch::

    horovodrun -np 2 hvdtrain train --framework torch --dataset digits
    mpirun -np 2 -bind-to none -map-by slot hvdtrain train --framework torch --dataset digits
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from hvdtrain import data, runtime, schedule
from hvdtrain.accumulation import micro_batches
from hvdtrain.config import TrainConfig
from hvdtrain.report import EpochMetrics, RunReport, run_header, setup_logging
from hvdtrain.torch import adapter, checkpoint
from hvdtrain.torch.models import build_model

log = logging.getLogger("hvdtrain")


def _resume(cfg: TrainConfig, info, model, optimizer) -> dict | None:
    """On rank 0, load the checkpoint into ``model``/``optimizer`` (before :func:`distribute`
    broadcasts them) and share its metadata with every rank.

    The optimizer's learning rate is reset to the base ``--lr``, so ``distribute`` scales it for
    this run's world size (which may differ from the checkpoint's).

    Raises:
        SystemExit: no usable checkpoint (on every rank, so none waits for the others).
    """
    meta = None
    if info.is_root:
        try:
            payload = checkpoint.load(cfg.output_dir)
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr
                group.pop("initial_lr", None)
                group.pop("hvdtrain_lr_scale", None)
            checkpoint.set_rng_state(payload["rng"])
            meta = {k: payload[k] for k in ("epoch", "step", "size", "global_batch", "metrics")}
        except checkpoint.CheckpointError as exc:
            meta = {"error": str(exc)}
    meta = hvd.broadcast_object(meta, root_rank=0, name="hvdtrain.resume")
    if "error" in meta:
        raise SystemExit(f"hvdtrain: error: --resume: {meta['error']}")
    return meta


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

    Rank 0 logs each epoch, shows a progress bar, and writes ``checkpoint.pt`` (keeping the
    previous one as ``checkpoint.prev.pt``) and ``metrics.json`` to ``cfg.output_dir`` after
    every epoch, atomically. With ``cfg.resume`` it continues from that checkpoint. A NaN/Inf
    loss on any rank skips that optimizer step on every rank, or stops the job
    (``cfg.on_nonfinite``).

    Raises:
        runtime.NonFiniteLossError: a non-finite loss with ``on_nonfinite="stop"`` (on every rank).
        SystemExit: ``--resume`` without a usable checkpoint.

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
    resumed = _resume(cfg, info, model, optimizer) if cfg.resume else None
    model, optimizer = adapter.distribute(model, optimizer, backward_passes_per_step=k,
                                          lr_scaling=cfg.lr_scaling, compression=cfg.compression,
                                          op=cfg.op)
    steps_per_epoch = schedule.steps_per_epoch(len(loader), k)
    scheduler = adapter.warmup(optimizer, warmup_epochs=cfg.warmup_epochs,
                               steps_per_epoch=steps_per_epoch)
    start_epoch = resumed["epoch"] if resumed else 0
    step = start_epoch * steps_per_epoch  # the schedule position at this run's world size
    if step:
        scheduler.last_epoch = step - 1
        scheduler.step()
    out = Path(cfg.output_dir)
    header = run_header("torch", cfg, info, len(train_set), len(x_test), steps_per_epoch,
                        {"torch": torch.__version__, "horovod": horovod.__version__})
    header["resumed_from"] = ({k2: resumed[k2] for k2 in ("epoch", "size", "global_batch")}
                              if resumed else None)
    report = RunReport(out, header, is_root=info.is_root)
    if resumed:
        report.epochs = [EpochMetrics(**e) for e in resumed["metrics"]]
        log.info("resumed after epoch %d (made with %d ranks, global batch %d)",
                 resumed["epoch"], resumed["size"], resumed["global_batch"])
    fault = cfg.fault()
    skipped = 0

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        lr = optimizer.param_groups[0]["lr"]
        loss_sum, correct, seen, steps = 0.0, 0, 0, 0
        start = time.perf_counter()
        bar = tqdm(total=len(loader), desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch",
                   disable=not (info.is_root and cfg.progress), leave=False)
        nonfinite = False
        for (x, y), micro in micro_batches(loader, k):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if fault == (info.rank, step):
                loss = loss * float("nan")
            (loss * micro.loss_scale).backward()
            value = loss.item()
            if math.isfinite(value):
                loss_sum += value * micro.samples
                correct += (logits.argmax(1) == y).sum().item()
                seen += micro.samples
            else:
                nonfinite = True
            if micro.sync:
                optimizer.synchronize()  # gradients all-reduced; now decide on every rank alike
                bad_ranks = adapter.ranks_where(nonfinite, name="hvdtrain.nonfinite")
                if bad_ranks:
                    message = runtime.nonfinite_message(bad_ranks, step, epoch + 1)
                    if cfg.on_nonfinite == "stop":
                        raise runtime.nonfinite_stop(message)
                    log.warning("%s: step skipped on all ranks", message)
                    skipped += 1
                else:
                    with optimizer.skip_synchronize():
                        optimizer.step()
                    steps += 1
                scheduler.step()  # the schedule follows step, taken or skipped
                optimizer.zero_grad()
                nonfinite = False
                step += 1
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
        report.header["skipped_steps"] = skipped
        if info.is_root:
            checkpoint.save(out, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1, "step": step, "size": info.size,
                "global_batch": cfg.global_batch(info.size), "config": cfg.to_dict(),
                "rng": checkpoint.rng_state(),
                "metrics": [vars(e) for e in report.epochs + [metrics]]})
        report.add(metrics)
    # Every rank must hold the same weights; a divergence would be a bug worth knowing about.
    checksums = hvd.allgather_object(float(sum(p.double().sum() for p in model.parameters())))
    report.header["ranks_agree"] = len(set(checksums)) == 1
    if info.is_root:
        report.write()
    return report.to_dict()
