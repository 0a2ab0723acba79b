"""``hvdtrain train --framework torch --elastic``: training that survives workers leaving and
joining, with Horovod Elastic (``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``).

Launch (Gloo controller; horovodrun restarts the training function on the surviving workers and
adds workers its host discovery script reports)::

    hvdtrain launch --elastic --min-np 1 --max-np 3 --host-discovery-script ./discover.sh \\
        -np 3 -- hvdtrain train --elastic
    # = horovodrun -np 3 --min-np 1 --max-np 3 --host-discovery-script ./discover.sh \\
    #       hvdtrain train --elastic

Progress is committed every ``--commit-every`` optimizer steps and at each epoch's end: when a
worker fails, every survivor rolls back to the last commit (model, optimizer, sampler position,
counters) and carries on; the sampler gives the not-yet-processed samples of the epoch to the new
set of workers, so committed work is neither repeated nor lost. The learning rate is rescaled for
the new world size at every reset (``schedule.scale_factor``).

A step whose all-reduced gradients are not finite is skipped on every worker, or stops the run
(``--on-nonfinite``), and the divergence check runs at each epoch's end, as in
:func:`hvdtrain.torch.trainer.fit`; either stop is recorded in ``metrics.json`` and ends the job
(every worker exits 1, so Horovod Elastic does not reset).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hvdtrain import datasets, runtime, schedule
from hvdtrain.config import TrainConfig
from hvdtrain.run.elastic import ElasticReport
from hvdtrain.run.report import run_header, setup_logging
from hvdtrain.torch import adapter
from hvdtrain.torch.models import build_model
from hvdtrain.torch.hooks import Hooks

log = logging.getLogger("hvdtrain")


def fit_elastic(cfg: TrainConfig) -> dict:
    """Train like :func:`hvdtrain.torch.trainer.fit`, elastically (k = 1, linear/sqrt/none LR
    scaling at the current size, no warmup).

    ``metrics.json`` gains per epoch ``samples`` (training samples committed in that epoch, over
    all workers: the split's size, plus at most ``size - 1`` padding samples per reset) and
    ``sizes`` (the world sizes the epoch ran at); its epoch loss and accuracy leave out the
    batches whose loss was not finite, and ``skipped_steps`` counts the optimizer steps skipped.

    Returns:
        The run report, on every rank.

    Raises:
        runtime.NonFiniteLossError: a non-finite loss with ``cfg.on_nonfinite == "stop"`` (every
            rank, ``reported`` True: rank 0 printed it and recorded ``nonfinite_stop``).
        guard.DivergenceError: the run diverged (every rank, ``reported`` True; ``diverged``).
    """
    cfg = dataclasses.replace(cfg, warmup_epochs=0.0)  # recorded as run: no warmup
    info = adapter.init(cfg.seed, device="cpu")  # elastic runs on the CPU
    setup_logging(info.rank)
    split = datasets.load(cfg.dataset, test_fraction=cfg.test_fraction,
                          synthetic_samples=cfg.synthetic_samples, data_dir=cfg.data_dir or None)
    train_set = TensorDataset(torch.from_numpy(split.x_train), torch.from_numpy(split.y_train))
    x_test, y_test = torch.from_numpy(split.x_test), torch.from_numpy(split.y_test)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)

    model = build_model(split.num_classes, split.x_train.shape[-1], cfg.dropout, cfg.batchnorm)
    # foreach=False: the plain per-parameter SGD. (Horovod 0.28.1's state sync keeps None
    # options as they are; an earlier note here said otherwise.)
    base = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, foreach=False)
    # No broadcast here: TorchState.sync() broadcasts on every rank at the start and each reset.
    model, optimizer = adapter.distribute(model, base, lr_scaling=cfg.lr_scaling,
                                          compression=cfg.compression, op=cfg.op,
                                          broadcast=False)
    out = Path(cfg.output_dir)

    # --lr-schedule over the run's committed samples (the steps per epoch change with the size).
    decay = cfg.decay(steps_per_epoch=len(train_set))

    def set_lr() -> None:
        done = state.epoch * len(train_set) + min(state.samples, len(train_set))
        lr = schedule.scaled_lr(cfg.lr, cfg.lr_scaling, hvd.size()) * decay.multiplier(done)
        for group in optimizer.param_groups:
            group["lr"] = lr

    # step: optimizer steps over the run (--fault-nan-at counts these); seen: samples whose
    # loss was finite (the epoch's loss and accuracy are over these); skipped,
    # epoch_skipped: optimizer steps skipped (in the run, in the epoch); started: the epoch's
    # start, time.time() seconds (committed, so an epoch's seconds span its resets).
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0,
                                   batch=0, step=0, samples=0, seen=0, loss_sum=0.0, correct=0,
                                   skipped=0, epoch_skipped=0, sizes=[], history=[],
                                   started=0.0)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fault, slow = cfg.fault(), cfg.slow_fault()

    def on_reset() -> None:
        set_lr()
        log.warning("workers changed: now %d (lr %g)", hvd.size(),
                    optimizer.param_groups[0]["lr"])

    state.register_reset_callbacks([on_reset])
    hooks = Hooks(model, optimizer, x_test, y_test, "fp32", cfg.lr)
    header = run_header("torch", cfg, info, len(train_set), len(x_test), len(loader),
                        hooks.versions())
    report = ElasticReport(out, header, state, cfg, hvd.size, lambda: hvd.rank() == 0,
                           hvd.broadcast_object)

    @hvd.elastic.run
    def train(state) -> None:
        set_lr()
        while state.epoch < cfg.epochs:
            if state.batch == 0:  # a fresh epoch; a reset into a committed mid-epoch state
                state.started = time.time()  # keeps its start (wall clock: any host)
            if hvd.size() not in state.sizes:
                state.sizes = state.sizes + [hvd.size()]
            model.train()
            for x, y in loader:
                if decay.kind != "constant":
                    set_lr()
                runtime.slow_step(slow, state.step)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if fault == (hvd.rank(), state.step):
                    loss = loss * float("nan")
                optimizer.zero_grad()
                loss.backward()
                optimizer.synchronize()  # the averaged gradients: the same on every rank
                finite = bool(torch.isfinite(loss))
                if adapter.all_finite(p.grad for p in params):
                    with optimizer.skip_synchronize():
                        optimizer.step()
                else:  # every rank alike: the averaged gradients are the same everywhere
                    report.skipped_step(
                        adapter.ranks_where(not finite, name="hvdtrain.nonfinite"), state.step)
                totals = adapter.allreduce_sums(
                    {"n": len(x), "seen": len(x) if finite else 0,
                     "loss": loss.item() * len(x) if finite else 0.0,
                     "correct": (logits.argmax(1) == y).sum().item() if finite else 0},
                    name="hvdtrain.elastic")
                state.samples += int(totals["n"])
                state.seen += int(totals["seen"])
                state.loss_sum += totals["loss"]
                state.correct += int(totals["correct"])
                state.batch += 1
                state.step += 1
                sampler.record_batch(state.batch, cfg.batch_size)
                if state.batch % cfg.commit_every == 0:
                    state.commit()
            report.end_epoch(hooks, optimizer.param_groups[0]["lr"], split.num_classes)
            state.epoch += 1
            state.batch, state.samples, state.seen, state.epoch_skipped = 0, 0, 0, 0
            state.loss_sum, state.correct = 0.0, 0
            state.sizes = []
            sampler.set_epoch(state.epoch)
            state.commit()

    try:
        train(state)
    finally:
        report.close()
    return report.write()
