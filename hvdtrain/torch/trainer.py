"""``hvdtrain train --framework torch``: the fit loop on top of :mod:`hvdtrain.torch.adapter`.

Launch::

    horovodrun -np 2 hvdtrain train --framework torch --dataset digits
    mpirun -np 2 -bind-to none -map-by slot hvdtrain train --framework torch --dataset digits
"""
from __future__ import annotations

import itertools
import logging
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hvdtrain import datasets, progress, runtime, schedule
from hvdtrain.config import TrainConfig
from hvdtrain.run import preempt
from hvdtrain.run.training import Run, start
from hvdtrain.torch import adapter
from hvdtrain.torch.hooks import Hooks, autocast
from hvdtrain.torch.models import build_model

__all__ = ["fit"]
log = logging.getLogger("hvdtrain")


class _SkipSampler(torch.utils.data.Sampler):
    """``sampler``'s indices after the first ``skip`` ones: a run resumed mid-epoch reads the
    rest of the epoch's shard without loading the batches it already trained on."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


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
    info, signals = start(cfg, adapter.init)
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
    model = build_model(split.num_classes, split.x_train.shape[-1], cfg.dropout,
                        cfg.batchnorm).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    hooks = Hooks(model, optimizer, torch.from_numpy(split.x_test).to(device),
                  torch.from_numpy(split.y_test).to(device), cfg.precision, cfg.lr)
    run = Run(cfg, info, signals, hooks, split.num_classes)
    resumed = run.resume()  # into the model before distribute() broadcasts it
    scaler = hooks.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_loss_scale,
                                                 enabled=cfg.precision == "fp16")
    if resumed and resumed.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(resumed["scaler"])
    k = cfg.backward_passes_per_step
    model, optimizer = adapter.distribute(model, optimizer, backward_passes_per_step=k,
                                          lr_scaling=cfg.lr_scaling, compression=cfg.compression,
                                          op=cfg.op)
    hooks.model, hooks.optimizer = model, optimizer
    batches_per_epoch = len(loader)
    steps_per_epoch = schedule.steps_per_epoch(batches_per_epoch, k)
    scheduler = adapter.warmup(optimizer, warmup_epochs=cfg.warmup_epochs,
                               steps_per_epoch=steps_per_epoch,
                               decay=cfg.decay(steps_per_epoch))
    at = run.position(resumed)
    # The schedule position at this run's world size.
    step = at.epoch * steps_per_epoch + (at.partial["steps_taken"] if at.partial else 0)
    if step:
        scheduler.load_state_dict({"last_step": step})
    run.open(len(train_set), len(split.x_test), steps_per_epoch, resumed, at)
    stepper = _Stepper(cfg, info, optimizer, scaler, scheduler, hooks, run)
    stepper.step = step
    with run.training():
        for epoch in range(at.epoch, cfg.epochs):
            skip = at.batch if epoch == at.epoch else 0
            sampler.set_epoch(epoch)
            resumable.skip = skip * cfg.batch_size
            model.train()
            part = at.partial if skip else {}
            sums = _EpochSums(device, part)
            epoch_lr = part["lr"] if skip else optimizer.param_groups[0]["lr"]
            start_time = time.perf_counter() - part.get("seconds", 0.0)
            run.meter.start(time.perf_counter(), part.get("loss_sum", 0.0), part.get("correct", 0),
                            part.get("seen", 0), skip, sums.steps_taken)
            # A bar on a terminal, else a line every HVDTRAIN_PROGRESS_SECONDS (a log file).
            bar = progress.bar(batches_per_epoch, skip, f"epoch {epoch + 1}/{cfg.epochs}",
                               enabled=info.is_root and cfg.progress)
            batches = iter(loader)
            if skip:  # the RNG as it was mid-epoch, after the epoch's iterator took its seed
                run.restore_rng(resumed)
            done, agreed = skip, None  # micro-batches of this epoch trained
            for (x, y), micro in adapter.micro_batches(batches, k):
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with autocast(device, cfg.precision):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float(), y)
                if stepper.fault == (info.rank, stepper.step):
                    loss = loss * float("nan")
                scaler.scale(loss * micro.loss_weight).backward()
                sums.add(loss, logits, y, micro.samples)
                if micro.sync:
                    agreed = stepper.optimizer_step(sums, epoch)
                    if run.meter.due(stepper.step):  # rank 0, every --log-every steps
                        run.meter.point(stepper.step, time.perf_counter(), stepper.step_lr,
                                        sums.loss_sum.item(), sums.correct.item(),
                                        sums.seen.item(), done + 1, sums.steps_taken)
                done += 1
                sums.processed += micro.samples
                bar.update()
                if agreed:
                    break
            bar.close()
            seconds = time.perf_counter() - start_time
            if agreed:  # every rank: the same step, the same branch
                run.preempted_stop(agreed, epoch, done, stepper.step,
                                   {**sums.partial(), "seconds": seconds, "lr": epoch_lr})
            run.end_epoch(epoch, {**sums.totals(), "seconds": seconds}, epoch_lr, sums.steps,
                          stepper.step)
    return run.finish()


class _EpochSums:
    """This rank's running sums of an epoch, on the device (read once per epoch: no per-batch
    host sync): loss x samples, correct predictions and samples over the micro-batches whose
    loss was finite, samples trained on, optimizer steps taken and all-reduce rounds (taken or
    skipped). ``part``: a resumed epoch's sums so far (a mid-epoch checkpoint), or ``{}``."""

    def __init__(self, device: torch.device, part: dict):
        self.loss_sum = torch.tensor(part.get("loss_sum", 0.0), dtype=torch.float64,
                                     device=device)
        self.correct = torch.tensor(part.get("correct", 0), dtype=torch.int64, device=device)
        self.seen = torch.tensor(part.get("seen", 0), dtype=torch.int64, device=device)
        self.group_nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self.steps, self.steps_taken = part.get("steps", 0), part.get("steps_taken", 0)
        self.processed = part.get("processed", part.get("seen", 0))

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, samples: int):
        """Count a micro-batch (``logits`` ``(B, C)``, ``y`` ``(B,)``) when its loss is finite."""
        with torch.no_grad():
            finite = torch.isfinite(loss)
            self.group_nonfinite |= ~finite
            self.loss_sum += torch.where(finite, loss.double() * samples, 0.0)
            self.correct += torch.where(finite, (logits.argmax(1) == y).sum(), 0)
            self.seen += finite.long() * samples

    def partial(self) -> dict:
        """The sums so far, for a mid-epoch checkpoint."""
        return {"loss_sum": self.loss_sum.item(), "correct": self.correct.item(),
                "seen": self.seen.item(), "processed": self.processed, "steps": self.steps,
                "steps_taken": self.steps_taken}

    def totals(self) -> dict:
        """The epoch's :data:`hvdtrain.run.training.EPOCH_SUMS` (without ``seconds``)."""
        return {"loss": self.loss_sum.item(), "correct": self.correct.item(),
                "n": self.seen.item(), "processed": self.processed}


class _Stepper:
    """The optimizer step at the end of each group of k micro-batches, on every rank alike:
    the gradients' all-reduce (with the ranks' signal flags riding along), the non-finite check,
    the fp16 scaler, the schedule. ``step`` counts all-reduce rounds over the run."""

    def __init__(self, cfg: TrainConfig, info, optimizer, scaler, scheduler, hooks: Hooks,
                 run: Run):
        self.cfg, self.info, self.optimizer, self.scaler = cfg, info, optimizer, scaler
        self.scheduler, self.hooks, self.run = scheduler, hooks, run
        self.fault, self.slow = cfg.fault(), cfg.slow_fault()
        self.adasum = cfg.op == "adasum"
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.step, self.step_lr = 0, 0.0

    def optimizer_step(self, sums: _EpochSums, epoch: int) -> str | None:
        """Take (or skip) the step; returns the signal every rank agreed to stop on, or None.

        Raises:
            runtime.NonFiniteLossError: a non-finite loss with ``--on-nonfinite stop`` (or any
                with ``--op adasum``), on every rank.
        """
        optimizer, scaler, hooks = self.optimizer, self.scaler, self.hooks
        runtime.slow_step(self.slow, self.step)
        # The ranks' signal flags ride along with the step's gradients: submitted now, read
        # after the step (no extra wait; hvdtrain.run.preempt). A CPU tensor on every device:
        # on a GPU, making it there (torch.tensor(..., device=cuda)) and reading it back
        # would be two host synchronisations a step; Horovod all-reduces CPU tensors with
        # MPI or Gloo beside the GPU's NCCL.
        stop = hvd.allreduce_async(torch.tensor(self.run.signals.flags(), dtype=torch.float32),
                                   op=hvd.Sum, name="hvdtrain.preempt")
        if self.adasum:
            optimizer.step()  # Adasum combines the ranks' updates inside step()
            ok = adapter.all_finite(self.params)  # the combined weights: equal on every rank
        else:
            optimizer.synchronize()  # gradients averaged: bitwise equal on every rank (fp16:
            scaler.unscale_(optimizer)  # the loss scale taken out), so every rank decides alike
            ok = adapter.all_finite(p.grad for p in self.params)
            if ok:
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)  # optimizer.step() when no scaler
        bad_ranks = [] if ok else adapter.ranks_where(  # rare: name the bad ranks
            bool(sums.group_nonfinite), name="hvdtrain.nonfinite")
        if ok:
            sums.steps += 1
        elif scaler.is_enabled() and not bad_ranks:
            # Every loss was finite, the fp16 gradients overflowed: the scaler skips this step
            # (on every rank: the gradients are the same) and lowers its scale.
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            hooks.overflows += 1
            self.run.record_counters()
            log.debug("step %d: fp16 gradients overflowed at loss scale %g; skipped", self.step,
                      scaler.get_scale())
        else:
            message = runtime.nonfinite_message(bad_ranks, self.step, epoch + 1)
            if self.cfg.on_nonfinite == "stop" or self.adasum:
                raise runtime.nonfinite_stop(
                    message + ("; with --op adasum the update is applied inside step(), so it "
                               "cannot be skipped" if self.adasum else ""))
            log.warning("%s: step skipped on all ranks", message)
            hooks.skipped += 1
            self.run.record_counters()
        scaler.update()
        self.step_lr = optimizer.param_groups[0]["lr"]
        self.scheduler.step()  # the schedule follows step, taken or skipped
        optimizer.zero_grad()
        sums.group_nonfinite.zero_()
        self.step += 1
        sums.steps_taken += 1
        return preempt.agreed_signal(hvd.synchronize(stop).tolist())
