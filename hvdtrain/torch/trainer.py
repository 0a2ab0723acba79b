"""``hvdtrain train --framework torch``: the fit loop on top of :mod:`hvdtrain.torch.adapter`.

Launch::

    horovodrun -np 2 hvdtrain train --framework torch --dataset digits
    mpirun -np 2 -bind-to none -map-by slot hvdtrain train --framework torch --dataset digits
"""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from hvdtrain import datasets, preempt, runtime, schedule
from hvdtrain.config import TrainConfig
from hvdtrain.report import EpochMetrics, RunReport, run_header, setup_logging, stop_together
from hvdtrain.tensorboard import StepMeter
from hvdtrain.torch import adapter, checkpoint
from hvdtrain.torch.models import build_model

log = logging.getLogger("hvdtrain")


def _resume(cfg: TrainConfig, info, model, optimizer) -> dict | None:
    """On rank 0, load the checkpoint into ``model``/``optimizer`` (before :func:`distribute`
    broadcasts them, and scales the restored optimizer's saved base rate for this run's world
    size, which may differ from the checkpoint's); share its metadata with every rank, and give
    every rank its own RNG state back (dropout and augmentation continue as if never stopped;
    for a mid-epoch checkpoint the trainer does that once the epoch's data iterator exists).

    Returns:
        The checkpoint's metadata, or None with ``--resume auto`` and no checkpoint file (a
        first run).

    Raises:
        SystemExit: no usable checkpoint (on every rank, so none waits for the others); with
            ``--resume auto`` only when checkpoint files exist but none loads.
    """
    meta = None
    if info.is_root:
        out = Path(cfg.output_dir)
        files = (out / checkpoint.CHECKPOINT_FILE, out / checkpoint.PREVIOUS_FILE)
        try:
            if cfg.resume == "auto" and not any(f.exists() for f in files):
                meta = {"fresh": True}
            else:
                payload = checkpoint.load(cfg.output_dir)
                model.load_state_dict(payload["model"])
                optimizer.load_state_dict(payload["optimizer"])
                for group in optimizer.param_groups:  # this run's --lr is the base to scale
                    group["hvdtrain_base_lr"] = cfg.lr
                meta = {k: payload[k] for k in ("epoch", "step", "size", "global_batch",
                                                "metrics", "config")}
                for key in ("scaler", "batch", "partial_per_rank", "counters"):
                    meta[key] = payload.get(key)
                meta["rng"] = payload.get("rng_per_rank") or [payload["rng"]]
        except checkpoint.CheckpointError as exc:
            meta = {"error": str(exc)}
    meta = hvd.broadcast_object(meta, root_rank=0, name="hvdtrain.resume")
    if "error" in meta:
        raise SystemExit(f"hvdtrain: error: --resume: {meta['error']}")
    if "fresh" in meta:
        log.info("--resume auto: no checkpoint in %s yet, starting fresh", cfg.output_dir)
        return None
    if not meta.get("batch"):
        _restore_rng(meta, info.rank)
    return meta


def _restore_rng(meta: dict, rank: int) -> None:
    """This rank's saved RNG state (ranks the checkpoint did not have keep their seeds)."""
    if rank < len(meta["rng"]):
        checkpoint.set_rng_state(meta["rng"][rank])


class _SkipSampler(torch.utils.data.Sampler):
    """``sampler``'s indices after the first ``skip`` ones: a run resumed mid-epoch reads the
    rest of the epoch's shard without loading the batches it already trained on."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """``torch.autocast`` for ``precision`` (``"fp32"``: a context that changes nothing)."""
    return torch.autocast(device.type, dtype=AMP_DTYPES.get(precision, torch.float32),
                          enabled=precision in AMP_DTYPES)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, size: int,
             batch_size: int = 256, precision: str = "fp32") -> tuple[float, float]:
    """Mean loss and accuracy over ``(x, y)`` (shapes ``(N, ...)`` and ``(N,)``, on the model's
    device) on all ranks together: each rank scores an unpadded shard, and sums are all-reduced,
    so every sample counts exactly once. Returns ``(loss, accuracy)`` on every rank."""
    idx = torch.from_numpy(datasets.shard_indices(len(x), rank, size)).to(x.device)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    with torch.no_grad(), autocast(x.device, precision):
        for chunk in idx.split(batch_size):
            logits = model(x[chunk])
            loss_sum += F.cross_entropy(logits.float(), y[chunk], reduction="sum").double()
            correct += (logits.argmax(1) == y[chunk]).sum()
    totals = adapter.allreduce_sums({"loss": loss_sum.item(), "correct": correct.item(),
                                     "n": len(idx)}, name="hvdtrain.eval")
    return totals["loss"] / totals["n"], totals["correct"] / totals["n"]


def fit(cfg: TrainConfig) -> dict:
    """Train ``build_model`` on ``cfg.dataset`` with ``cfg``'s options on every rank.

    Each rank computes on ``cfg.device`` (its own GPU, ``cuda:<local_rank>``, or the CPU), in
    ``cfg.precision``: ``bf16``/``fp16`` run the forward pass under ``torch.autocast``; ``fp16``
    also scales the loss with ``torch.amp.GradScaler`` in Horovod's documented order (gradients
    all-reduced by ``optimizer.synchronize()``, then ``scaler.unscale_``, then ``scaler.step``
    inside ``optimizer.skip_synchronize()``), so a step whose fp16 gradients overflow is skipped
    by the scaler on every rank alike and counted in ``overflow_steps``, not as a failure. Before
    every evaluation and checkpoint the model's buffers (BatchNorm statistics) are averaged over
    ranks (:func:`hvdtrain.torch.sync_buffers`), so all ranks evaluate and save the same model.

    Rank 0 logs each epoch, shows a progress bar, and writes ``checkpoint.pt`` (keeping the
    previous one as ``checkpoint.prev.pt``) and ``metrics.json`` to ``cfg.output_dir`` after
    every epoch, atomically. With ``cfg.resume`` it continues from that checkpoint (written on
    GPUs or not). A NaN/Inf loss on any rank skips that optimizer step on every rank, or stops
    the job (``cfg.on_nonfinite``).

    Raises:
        runtime.NonFiniteLossError: a non-finite loss with ``on_nonfinite="stop"`` (on every rank).
        guard.DivergenceError: the run diverged after warmup (:func:`hvdtrain.guard.divergence`;
            every rank, before that epoch's checkpoint), unless ``cfg.divergence_check`` is off.
        SystemExit: ``--resume`` without a usable checkpoint, or a ``--device`` this host cannot
            give every rank.

    Returns:
        The run report (the content of ``metrics.json``), on every rank.
    """
    try:
        info = adapter.init(cfg.seed, device=cfg.device)
    except ValueError as exc:
        raise SystemExit(f"hvdtrain: error: --device {cfg.device}: {exc}") from None
    setup_logging(info.rank)
    signals = preempt.Preemption().__enter__()  # a signal from here on stops after a step
    warning = runtime.slurm_hosts_warning(info.hosts)
    if warning and info.is_root:
        log.warning(warning)
    device = torch.device(info.device)
    # The split does not depend on --seed: every run holds out the same samples.
    split = datasets.load(cfg.dataset, test_fraction=cfg.test_fraction,
                      synthetic_samples=cfg.synthetic_samples, data_dir=cfg.data_dir or None)
    train_set = TensorDataset(torch.from_numpy(split.x_train), torch.from_numpy(split.y_train))
    sampler = DistributedSampler(train_set, num_replicas=info.size, rank=info.rank, shuffle=True,
                                 seed=cfg.seed)
    resumable = _SkipSampler(sampler)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=resumable,
                        pin_memory=device.type == "cuda")
    x_test = torch.from_numpy(split.x_test).to(device)
    y_test = torch.from_numpy(split.y_test).to(device)

    model = build_model(split.num_classes, split.x_train.shape[-1], cfg.dropout,
                        cfg.batchnorm).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    k = cfg.backward_passes_per_step
    resumed = _resume(cfg, info, model, optimizer) if cfg.resume else None
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_loss_scale,
                                  enabled=cfg.precision == "fp16")
    if resumed and resumed.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(resumed["scaler"])
    model, optimizer = adapter.distribute(model, optimizer, backward_passes_per_step=k,
                                          lr_scaling=cfg.lr_scaling, compression=cfg.compression,
                                          op=cfg.op)
    batches_per_epoch = len(loader)
    steps_per_epoch = schedule.steps_per_epoch(batches_per_epoch, k)
    scheduler = adapter.warmup(optimizer, warmup_epochs=cfg.warmup_epochs,
                               steps_per_epoch=steps_per_epoch)
    start_epoch = resumed["epoch"] if resumed else 0
    # A mid-epoch checkpoint (preemption) continues at its micro-batch, at the same world size;
    # at another size the shards differ, so the interrupted epoch restarts from its beginning.
    start_batch = resumed.get("batch") or 0 if resumed else 0
    why = start_batch and preempt.mid_epoch_mismatch(resumed["config"], resumed["size"], cfg,
                                                     info.size)
    if why:
        log.warning("the checkpoint was made %d micro-batches into epoch %d, but %s: that epoch "
                    "restarts", start_batch, start_epoch + 1, why)
        _restore_rng(resumed, info.rank)
        start_batch = 0
    # This rank's share of the interrupted epoch's sums (same world size, so same ranks).
    partial = resumed["partial_per_rank"][info.rank] if start_batch else None
    # The schedule position at this run's world size.
    step = start_epoch * steps_per_epoch + (partial["steps_taken"] if partial else 0)
    if step:
        scheduler.load_state_dict({"last_step": step})
    out = Path(cfg.output_dir)
    header = run_header("torch", cfg, info, len(train_set), len(x_test), steps_per_epoch,
                        {"torch": torch.__version__, "horovod": horovod.__version__})
    header["resumed_from"] = ({k2: resumed[k2] for k2 in ("epoch", "size", "global_batch")}
                              if resumed else None)
    if resumed:
        header["resumed_from"]["batch"] = start_batch
    report = RunReport(out, header, is_root=info.is_root, tensorboard=cfg.tensorboard,
                       broadcast_object=hvd.broadcast_object)
    meter = StepMeter(report.board, cfg.log_every, cfg.global_batch(info.size),
                      cfg.batch_size * info.size)
    if resumed:
        report.epochs = [EpochMetrics(**e) for e in resumed["metrics"]]
        log.info("resumed after epoch %d%s (made with %d ranks, global batch %d)",
                 resumed["epoch"], f" and {start_batch} micro-batches" if start_batch else "",
                 resumed["size"], resumed["global_batch"])
    fault, slow = cfg.fault(), cfg.slow_fault()
    counters = (resumed or {}).get("counters") or {}
    skipped, overflows = counters.get("skipped", 0), counters.get("overflows", 0)
    report.header.update(skipped_steps=skipped, overflow_steps=overflows)
    adasum = cfg.op == "adasum"
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def save(epoch_done: int, batch: int, partial_state: dict | None, epochs: list) -> None:
        """Rank 0 writes the checkpoint; every rank calls (its RNG state and, mid-epoch, its
        share of the epoch's sums are gathered)."""
        per_rank = hvd.allgather_object({"rng": checkpoint.rng_state(), "partial": partial_state},
                                        name="hvdtrain.rng")
        if info.is_root:
            checkpoint.save(out, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch_done, "batch": batch, "step": step,
                "partial_per_rank": [r["partial"] for r in per_rank] if batch else None,
                "size": info.size, "global_batch": cfg.global_batch(info.size),
                "config": cfg.to_dict(), "rng": per_rank[0]["rng"],
                "rng_per_rank": [r["rng"] for r in per_rank],
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "counters": {"skipped": skipped, "overflows": overflows},
                "metrics": [vars(e) for e in epochs]})

    with signals, report.board, report.stops_on_nonfinite():
        for epoch in range(start_epoch, cfg.epochs):
            skip = start_batch if epoch == start_epoch else 0
            sampler.set_epoch(epoch)
            resumable.skip = skip * cfg.batch_size
            model.train()
            epoch_lr = partial["lr"] if skip else optimizer.param_groups[0]["lr"]
            # Metrics stay on the device and are read once per epoch (no per-batch sync).
            part = partial if skip else {}
            loss_sum = torch.tensor(part.get("loss_sum", 0.0), dtype=torch.float64,
                                    device=device)
            correct = torch.tensor(part.get("correct", 0), dtype=torch.int64, device=device)
            seen = torch.tensor(part.get("seen", 0), dtype=torch.int64, device=device)
            group_nonfinite = torch.zeros((), dtype=torch.bool, device=device)
            steps, steps_taken = part.get("steps", 0), part.get("steps_taken", 0)
            # Samples trained on, finite loss or not (throughput); ``seen`` counts the finite.
            processed = part.get("processed", part.get("seen", 0))
            done = skip  # micro-batches of this epoch trained
            agreed = None
            start = time.perf_counter() - part.get("seconds", 0.0)
            meter.start(time.perf_counter(), part.get("loss_sum", 0.0), part.get("correct", 0),
                        part.get("seen", 0), skip, steps_taken)
            bar = tqdm(total=batches_per_epoch, initial=skip, unit="batch",
                       desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                       disable=not (info.is_root and cfg.progress))
            batches = iter(loader)
            if skip:  # the RNG as it was mid-epoch, after the epoch's iterator took its seed
                _restore_rng(resumed, info.rank)
            for (x, y), micro in adapter.micro_batches(batches, k):
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with autocast(device, cfg.precision):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float(), y)
                if fault == (info.rank, step):
                    loss = loss * float("nan")
                scaler.scale(loss * micro.loss_weight).backward()
                with torch.no_grad():
                    finite = torch.isfinite(loss)
                    group_nonfinite |= ~finite
                    loss_sum += torch.where(finite, loss.double() * micro.samples, 0.0)
                    correct += torch.where(finite, (logits.argmax(1) == y).sum(), 0)
                    seen += finite.long() * micro.samples
                if micro.sync:
                    runtime.slow_step(slow, step)
                    # The ranks' signal flags ride along with the step's gradients: submitted
                    # now, read after the step (no extra wait; hvdtrain.preempt).
                    stop = hvd.allreduce_async(torch.tensor(signals.flags(), device=device),
                                               op=hvd.Sum, name="hvdtrain.preempt")
                    if adasum:
                        optimizer.step()  # Adasum combines the ranks' updates inside step()
                        ok = adapter.all_finite(params)  # the combined weights: equal on every rank
                    else:
                        optimizer.synchronize()  # gradients averaged: bitwise equal on every
                        scaler.unscale_(optimizer)  # rank (fp16: the loss scale taken out),
                        # so every rank decides alike
                        ok = adapter.all_finite(p.grad for p in params)
                        if ok:
                            with optimizer.skip_synchronize():
                                scaler.step(optimizer)  # optimizer.step() when no scaler
                    bad_ranks = [] if ok else adapter.ranks_where(  # rare: name the bad ranks
                        bool(group_nonfinite), name="hvdtrain.nonfinite")
                    if ok:
                        steps += 1
                    elif scaler.is_enabled() and not bad_ranks:
                        # Every loss was finite, the fp16 gradients overflowed: the scaler skips
                        # this step (on every rank: the gradients are the same) and lowers its
                        # scale.
                        with optimizer.skip_synchronize():
                            scaler.step(optimizer)
                        overflows += 1
                        report.header["overflow_steps"] = overflows
                        log.debug("step %d: fp16 gradients overflowed at loss scale %g; skipped",
                                  step, scaler.get_scale())
                    else:
                        message = runtime.nonfinite_message(bad_ranks, step, epoch + 1)
                        if cfg.on_nonfinite == "stop" or adasum:
                            raise runtime.nonfinite_stop(
                                message + ("; with --op adasum the update is applied inside "
                                           "step(), so it cannot be skipped" if adasum else ""))
                        log.warning("%s: step skipped on all ranks", message)
                        skipped += 1
                        report.header["skipped_steps"] = skipped
                    scaler.update()
                    step_lr = optimizer.param_groups[0]["lr"]
                    scheduler.step()  # the schedule follows step, taken or skipped
                    optimizer.zero_grad()
                    group_nonfinite.zero_()
                    step += 1
                    steps_taken += 1
                    if meter.due(step):  # rank 0, every --log-every steps: one read of the sums
                        meter.point(step, time.perf_counter(), step_lr, loss_sum.item(),
                                    correct.item(), seen.item(), done + 1, steps_taken)
                    agreed = preempt.agreed_signal(hvd.synchronize(stop).tolist())
                done += 1
                processed += micro.samples
                bar.update()
                if agreed:
                    break
            bar.close()
            if agreed:  # every rank: the same step, the same branch
                adapter.sync_buffers(model)
                preempted_stop(save, signals, agreed, report, info, cfg, {
                    "epoch": epoch, "batch": done, "step": step,
                    "partial": {"loss_sum": loss_sum.item(), "correct": correct.item(),
                                "seen": seen.item(), "processed": processed,
                                "steps": steps, "steps_taken": steps_taken,
                                "seconds": time.perf_counter() - start, "lr": epoch_lr}})
            seconds = time.perf_counter() - start
            totals = adapter.allreduce_sums({"loss": loss_sum.item(), "correct": correct.item(),
                                             "n": seen.item(), "processed": processed,
                                             "seconds": seconds},
                                            name="hvdtrain.train")
            adapter.sync_buffers(model)  # equal BatchNorm statistics before evaluating and saving
            test_loss, test_acc = evaluate(model, x_test, y_test, info.rank, info.size,
                                           precision=cfg.precision)
            epoch_seconds = totals["seconds"] / info.size  # mean wall time over ranks
            metrics = EpochMetrics(epoch + 1, totals["loss"] / max(totals["n"], 1),
                                   totals["correct"] / max(totals["n"], 1), test_loss, test_acc,
                                   epoch_lr, steps, epoch_seconds,
                                   totals["processed"] / epoch_seconds)
            # Before its checkpoint; rank 0 reports, then all stop together.
            report.check_divergence(metrics, cfg, split.num_classes)
            save(epoch + 1, 0, None, report.epochs + [metrics])
            report.add(metrics)
    # Every rank must hold the same weights and buffers; a divergence would be a bug worth
    # knowing about.
    checksums = hvd.allgather_object(float(sum(
        t.double().sum() for t in model.state_dict().values() if t.is_floating_point())))
    report.header["ranks_agree"] = len(set(checksums)) == 1
    if info.is_root:
        report.write()
    return report.to_dict()


def preempted_stop(save, signals: preempt.Preemption, agreed: str, report: RunReport, info, cfg,
               where: dict) -> None:
    """After the step in which some rank saw SIGTERM/SIGUSR1: write the mid-epoch checkpoint
    (rank 0), record the stop in ``metrics.json`` and requeue under Slurm (rank 0), then raise
    :class:`~hvdtrain.preempt.Preempted` on every rank. The other ranks wait for rank 0 to have
    done all that: launchers end the whole job when the first rank exits."""
    save(where["epoch"], where["batch"], where["partial"], report.epochs)
    waited = hvd.allgather_object(signals.seconds_since_signal(), name="hvdtrain.preempt.saved")
    seconds = max((w for w in waited if w is not None), default=None)
    preempt.record_stop(report, agreed, where["epoch"] + 1, where["batch"], where["step"], seconds,
                        cfg.requeue, info.is_root)
    stop_together(hvd.broadcast_object, "preempt.done")
    raise preempt.Preempted(agreed, seconds)
