"""Checks of hvdtrain.torch's learning-rate handling and input checks on real ranks: a restored
optimizer is scaled once, schedulers built before/after distribute(), warmup composed with a
user's scheduler against schedule.lr_at, Adasum's default scaling, unequal batch counts, and
what a rank waiting for a collective costs. Rank 0 writes what it saw as JSON;
tests/parallel/test_torch_adapter.py asserts on it.

Launch::

    horovodrun -np 2 python tests/parallel/torch_adapter_checks.py --out result.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd
import hvdtrain.torch as ht
from hvdtrain import schedule

BASE_LR = 0.01


def fresh(lr=BASE_LR):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train_step(model, optimizer):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def restored_optimizer_is_scaled_once(size):
    """distribute() -> steps -> state_dict -> a new optimizer loads it -> distribute() again."""
    model, optimizer = fresh()
    model, optimizer = ht.distribute(model, optimizer, lr_scaling="linear")
    warm = ht.warmup(optimizer, warmup_epochs=1, steps_per_epoch=4)
    for _ in range(2):  # inside the warmup: the saved lr is neither base nor scaled
        train_step(model, optimizer)
        warm.step()
    saved = optimizer.state_dict()
    model2, optimizer2 = fresh(lr=0.5)  # whatever lr it is built with, the checkpoint's base rules
    optimizer2.load_state_dict(saved)
    model2, optimizer2 = ht.distribute(model2, optimizer2, lr_scaling="linear")
    group = optimizer2.param_groups[0]
    momentum_kept = bool(torch.equal(optimizer2.state[group["params"][0]]["momentum_buffer"],
                                     optimizer.state[optimizer.param_groups[0]["params"][0]]
                                     ["momentum_buffer"]))
    return {"saved_lr": saved["param_groups"][0]["lr"], "lr": group["lr"],
            "expected": BASE_LR * size, "base_lr": group["hvdtrain_base_lr"],
            "momentum_kept": momentum_kept}


def scheduler_before_distribute():
    """Scaling with a scheduler already built: a clear error. Without scaling: the scheduler keeps
    driving the groups the wrapped optimizer uses, on every rank."""
    out = {}
    model, optimizer = fresh()
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    try:
        ht.distribute(model, optimizer, lr_scaling="linear")
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    model, optimizer = fresh()
    before = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, wrapped = ht.distribute(model, optimizer, lr_scaling="none")
    out["same_groups"] = all(a is b for a, b in zip(optimizer.param_groups, wrapped.param_groups))
    lrs = []
    for _ in range(3):
        train_step(model, wrapped)
        before.step()
        lrs.append(wrapped.param_groups[0]["lr"])
    out["lrs"] = lrs
    return out


def warmup_with_user_scheduler(size):
    """warmup(scheduler=CosineAnnealingLR) on a real optimizer: the rate used at each step, and
    warmup alone against schedule.lr_at (the rate each optimizer.step() ran with)."""
    steps_per_epoch, warmup_epochs, total = 5, 1.0, 12
    model, optimizer = fresh()
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    warm = ht.warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch,
                     scheduler=cosine)
    composed = []
    for _ in range(total):
        composed.append(optimizer.param_groups[0]["lr"])
        train_step(model, optimizer)
        warm.step()
    scaled = BASE_LR * size
    expected = [scaled * (1 + math.cos(math.pi * t / total)) / 2
                * schedule.warmup_multiplier(t, size, warmup_epochs, steps_per_epoch)
                for t in range(total)]
    model, optimizer = fresh()
    model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=1)
    warm = ht.warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch)
    alone = []
    for _ in range(total):
        alone.append(optimizer.param_groups[0]["lr"])
        train_step(model, optimizer)
        warm.step()
    lr_at = [schedule.lr_at(t, base_lr=BASE_LR, rule="linear", size=size,
                            warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch)
             for t in range(total)]
    # Continuing from a state inside the warmup gives the same rates.
    model, optimizer = fresh()
    model, optimizer = ht.distribute(model, optimizer)
    again = ht.warmup(optimizer, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch)
    again.load_state_dict({"last_step": 3})
    return {"composed": composed, "composed_expected": expected, "alone": alone, "lr_at": lr_at,
            "resumed_at_3": optimizer.param_groups[0]["lr"]}


def adasum_defaults():
    model, optimizer = fresh()
    model, optimizer = ht.distribute(model, optimizer, op="adasum")
    lr = optimizer.param_groups[0]["lr"]
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, optimizer)  # Adasum: step() alone, no synchronize()
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    try:
        ht.distribute(*fresh(), op="adasum", lr_scaling="linear")
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"lr": lr, "moved": moved, "linear_error": error}


def unequal_batch_counts(rank):
    """Rank 0 has 3 batches, the others 4: a clear error on every rank, no hang."""
    batches = [torch.zeros(2, 4)] * (3 if rank == 0 else 4)
    try:
        for _ in ht.micro_batches(batches, 2):
            pass
        return None
    except ValueError as exc:
        return str(exc)


def iterable_without_length():
    """A DataLoader over an IterableDataset has no length: the loop runs, unchecked."""
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(4), 0)] * 8)

    loader = torch.utils.data.DataLoader(Stream(), batch_size=2)
    return sum(1 for _ in ht.micro_batches(loader, 2))


def a_wait_sleeps(rank, ready):
    """Rank 0 waits in ``hvd.allreduce`` (``synchronize()`` on its handle) for rank 1, which starts
    a fixed amount of work (matrix products) once rank 0 has written ``ready``, then joins. Returns
    {"wall": s, "cpu": s} of rank 0's waiting thread over that call (``time.thread_time``: this
    thread only, not Horovod's background thread) and, from rank 1, {"work": s} of its work.
    Horovod patch 11 makes the waiting thread sleep until the collective is done; Horovod 0.28.1
    polled the handle with ``sched_yield()`` and used its share of a core for the whole wait.

    Raises:
        RuntimeError: on rank 1, ``ready`` did not appear within 120 s.
    """
    x = torch.ones(4)
    hvd.allreduce(x, name="wait.first")  # the name negotiated once: the next call is a cache hit
    if rank == 0:
        wall, cpu = time.monotonic(), time.thread_time()  # before rank 1 can start its work
        with open(ready, "w"):
            pass
        hvd.allreduce(x, name="wait.sleeps")
        return {"wall": time.monotonic() - wall, "cpu": time.thread_time() - cpu}
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):  # rank 0 is about to wait
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 did not write {ready} within 120 s")
        time.sleep(0.01)
    start, a = time.monotonic(), torch.rand(256, 256)
    for _ in range(400):  # rank 0 waits through this work (about 0.2 s on one core here)
        a = torch.tanh(a @ a)
    work = time.monotonic() - start
    hvd.allreduce(x, name="wait.sleeps")
    return {"work": work}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = ht.init(seed=0)
    result = {"size": info.size,
              "restored": restored_optimizer_is_scaled_once(info.size),
              "before": scheduler_before_distribute(),
              "warmup": warmup_with_user_scheduler(info.size),
              "adasum": adasum_defaults(),
              "unequal": hvd.allgather_object(unequal_batch_counts(info.rank)),
              "iterable_micro_batches": iterable_without_length(),
              "wait": hvd.allgather_object(a_wait_sleeps(info.rank, args.out + ".ready"))}
    everyone = hvd.allgather_object(json.dumps(result, sort_keys=True))
    result["ranks_agree"] = len(set(everyone)) == 1
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
