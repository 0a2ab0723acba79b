"""Compute profiles for :mod:`hvdtrain.scaling.model`: measured on this machine (PyTorch), or
derived from a given step time / published per-device throughput.

A measured profile times, per micro-batch, the forward pass (model + loss), the backward pass
and the optimizer step (SGD with momentum 0.9, as the benchmarks), and the time at which each
gradient becomes final during the backward pass (``Tensor.register_post_accumulate_grad_hook``,
PyTorch >= 2.1), over ``repeats`` steps after ``warmup``: the phases' means
(:func:`mean_time`), each gradient's median ready time. On a GPU the times are taken
after ``torch.cuda.synchronize()``; hook times are when autograd finished the gradient on the
host side.

Ranks on one CPU host share its cores and memory bandwidth: :func:`measure_side_by_side` runs
``copies - 1`` more copies of the same step in other processes while it measures, each copy on
``threads`` intra-op threads, as N ranks of ``hvdtrain`` would (``cores // N`` threads each).

A user model is ``module:function``; ``function(batch_size)`` (or ``function()``) returns
``(model, loss_fn, batch)`` with ``batch = (inputs, targets)`` and ``loss_fn(model(inputs),
targets)`` a scalar tensor.
"""
from __future__ import annotations

import importlib
import inspect
import contextlib
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

from hvdtrain.scaling.model import ComputeProfile, Gradient

BUILTIN = ("mnist", "cnn", "dense", "gpt")


def builtin_torch(name: str, batch_size: int):
    """``(model, loss_fn, batch)`` of a benchmark model (:func:`hvdtrain.torch.models.bench_model`)
    on a random batch of ``batch_size`` samples, as ``benchmarks/synthetic.py`` makes it.

    Raises:
        ValueError: unknown name.
    """
    import torch

    from hvdtrain.torch.models import GPT_CONTEXT, GPT_VOCAB, bench_model
    if name not in BUILTIN:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(BUILTIN)} or "
                         "module:function")
    torch.manual_seed(0)
    model = bench_model(name)
    if name == "gpt":
        x = torch.randint(0, GPT_VOCAB, (batch_size, GPT_CONTEXT))
        y = torch.randint(0, GPT_VOCAB, (batch_size, GPT_CONTEXT))

        def loss_fn(out, target):
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                     target.reshape(-1))
        return model, loss_fn, (x, y)
    shape = (batch_size, 1, 28, 28) if name == "mnist" else (batch_size, 3, 32, 32)
    return (model, torch.nn.functional.cross_entropy,
            (torch.randn(shape), torch.randint(0, 10, (batch_size,))))


def load_builder(spec: str) -> Callable[[int], tuple]:
    """A ``builder(batch_size) -> (model, loss_fn, batch)`` for a built-in name or
    ``module:function``.

    Raises:
        ValueError: neither a built-in name nor ``module:function``, or the function is missing.
    """
    if spec in BUILTIN:
        return lambda batch_size: builtin_torch(spec, batch_size)
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: use one of {', '.join(BUILTIN)} or "
                         "module:function (a function returning (model, loss_fn, batch))")
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None:
        raise ValueError(f"--model {spec!r}: module {module!r} has no {name!r}")
    takes_batch = bool(inspect.signature(fn).parameters)
    return lambda batch_size: fn(batch_size) if takes_batch else fn()


def _to_device(batch, device):
    return tuple(t.to(device) for t in batch)


def measure_torch(spec: str, batch_size: int, threads: int | None = None, warmup: int = 3,
                  repeats: int = 10, device: str = "cpu") -> ComputeProfile:
    """Time one rank's micro-batch of ``spec`` on this machine.

    Args:
        spec: built-in model name or ``module:function``.
        batch_size: samples per micro-batch (the batch's own size for a user model).
        threads: ``torch.set_num_threads`` (None: leave as is).
        warmup, repeats: steps before timing, timed steps (the phases' means are kept, see
            :func:`mean_time`; each gradient's ready time is a median).
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        a :class:`ComputeProfile` (seconds, bytes).
    """
    import torch
    if threads:
        torch.set_num_threads(threads)
    model, loss_fn, batch = load_builder(spec)(batch_size)
    model = model.to(device)
    x, y = _to_device(batch, device)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in params], lr=0.01, momentum=0.9)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    marks: dict[str, float] = {}
    for name, p in params:
        p.register_post_accumulate_grad_hook(
            lambda _p, name=name: marks.__setitem__(name, time.perf_counter()))
    fwd, bwd, opt, ready = [], [], [], {n: [] for n, _ in params}
    for i in range(warmup + repeats):
        optimizer.zero_grad(set_to_none=True)
        marks.clear()
        sync()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        optimizer.step()
        sync()
        t3 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            opt.append(t3 - t2)
            for n in ready:
                ready[n].append(marks.get(n, t2) - t1)
    return timed_profile(batch_size, fwd, bwd, opt,
                         {n: (p.numel() * p.element_size(), ready[n]) for n, p in params},
                         [a + b + c for a, b, c in zip(fwd, bwd, opt)],
                         f"measured here: {spec}, batch {batch_size}, "
                         f"{torch.get_num_threads()} threads, {device}")


def timed_profile(batch_size: int, fwd: list[float], bwd: list[float], opt: list[float],
                  ready: dict[str, tuple[int, list[float]]], steps: list[float],
                  source: str) -> ComputeProfile:
    """A :class:`ComputeProfile` from per-step timings (seconds) of the timed steps: the phases'
    means (:func:`mean_time`), each gradient's median ready time (``ready``: name -> (bytes,
    ready times)), gradients in the order they become ready, and the steps' jitter
    (:func:`robust_std` of ``steps``). PyTorch's and Keras-on-torch's measurements both end
    here."""
    grads = sorted((Gradient(name, nbytes, statistics.median(times))
                    for name, (nbytes, times) in ready.items()), key=lambda g: g.ready_s)
    return ComputeProfile(batch_size, mean_time(fwd), mean_time(bwd), mean_time(opt),
                          tuple(grads), source, robust_std(steps))


def _load(spec: str, batch_size: int, threads: int, started, stop) -> None:
    """A background copy of the step (another rank's share of the machine), until ``stop``."""
    import torch
    torch.set_num_threads(threads)
    model, loss_fn, (x, y) = load_builder(spec)(batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    steps = 0
    while not stop.is_set():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        steps += 1
        if steps == 2:
            started.release()


def measure_side_by_side(spec: str, batch_size: int, threads: int, copies: int,
                         warmup: int = 3, repeats: int = 10) -> ComputeProfile:
    """:func:`measure_torch` while ``copies - 1`` other processes run the same step, each on
    ``threads`` threads: one rank's compute when ``copies`` ranks share this host."""
    if copies <= 1:
        return measure_torch(spec, batch_size, threads, warmup, repeats)
    with background_copies(_load, (spec, batch_size, threads), copies - 1):
        profile = measure_torch(spec, batch_size, threads, warmup, repeats)
    return ComputeProfile(profile.batch_size, profile.forward_s, profile.backward_s,
                          profile.optimizer_s, profile.gradients,
                          profile.source + f", {copies} copies side by side", profile.jitter_s)


def mean_time(values: list[float]) -> float:
    """The time a phase costs per step over a run: the mean of the timed steps, not their
    median. Samples/s over many steps is ``batch / mean step time``, and step times are skewed
    to the right (a step that waited for the other rank's process, a page fault, the garbage
    collector): on this 2-core machine the mean of 37 side-by-side steps was 5 % above the
    median for the bench dense model and 13 % for the MNIST CNN, which a median-based profile
    predicted as that much too fast.

    Raises:
        statistics.StatisticsError: no values.
    """
    return statistics.fmean(values)


def robust_std(values: list[float]) -> float:
    """A standard deviation that one stalled step does not blow up: 1.4826 x the median absolute
    deviation (equal to the standard deviation for normal data); 0 for fewer than 3 values."""
    if len(values) < 3:
        return 0.0
    mid = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - mid) for v in values)


def gradient_sizes(spec: str) -> list[tuple[str, int]]:
    """``[(name, bytes)]`` of the model's trainable parameters, output end first (the order a
    backward pass finishes them), without timing anything."""
    model, _, _ = load_builder(spec)(1)
    return [(n, p.numel() * p.element_size())
            for n, p in reversed(list(model.named_parameters())) if p.requires_grad]


def profile_from_step_time(step_s: float, batch_size: int,
                           segments: list[tuple[list[tuple[str, int]], float]],
                           forward_fraction: float = 1 / 3, source: str = "") -> ComputeProfile:
    """A profile from a given compute time per micro-batch (measured elsewhere, or ``batch /
    published samples/s``).

    The step splits into forward and backward as 1 : 2 by default (the backward pass computes
    the gradients of both the activations and the weights, about twice the forward's
    multiply-adds; Kaplan et al. 2020, "6N" FLOPs per token = 2N forward + 4N backward), the
    optimizer step is counted inside ``step_s``. Gradients become ready in order over the
    backward pass: ``segments`` are consecutive stretches of it, ``(tensors, share)``, each
    taking ``share`` of the backward time with its tensors ready evenly over it (e.g. VGG-16's
    fully connected layers, 89 % of its bytes, in the first ~1 % of its backward pass).

    Args:
        step_s: forward + backward (+ optimizer) of one micro-batch, seconds.
        batch_size: samples per micro-batch.
        segments: ``[([(name, bytes), ...], share of backward time), ...]`` from the output end;
            shares sum to 1.
        forward_fraction: forward share of ``step_s``.

    Raises:
        ValueError: shares not summing to 1 (+-1e-6) or a non-positive step time.
    """
    if step_s <= 0 or batch_size < 1:
        raise ValueError(f"need a step time > 0 and batch size >= 1, got {step_s}, {batch_size}")
    if abs(sum(share for _, share in segments) - 1) > 1e-6:
        raise ValueError("segment shares of the backward pass must sum to 1")
    forward = step_s * forward_fraction
    backward = step_s - forward
    grads, start = [], 0.0
    for tensors, share in segments:
        for i, (name, nbytes) in enumerate(tensors):
            at = start + share * (i + 1) / len(tensors)
            grads.append(Gradient(name, nbytes, backward * at))
        start += share
    return ComputeProfile(batch_size, forward, backward, 0.0, tuple(grads), source)


def even_tensors(total_bytes: int, count: int, prefix: str = "g") -> list[tuple[str, int]]:
    """``count`` tensors of equal size summing to ``total_bytes`` (a model known only by its
    parameter count)."""
    base = total_bytes // count
    return [(f"{prefix}{i}", base + (total_bytes - base * count if i == count - 1 else 0))
            for i in range(count)]


def all_ready_at_end(profile: ComputeProfile) -> ComputeProfile:
    """``profile`` with every gradient ready at the end of the backward pass (Keras: the
    optimizer gets all gradients at once)."""
    return ComputeProfile(profile.batch_size, profile.forward_s, profile.backward_s,
                          profile.optimizer_s,
                          tuple(Gradient(g.name, g.nbytes, profile.backward_s)
                                for g in profile.gradients), profile.source, profile.jitter_s)


@contextlib.contextmanager
def background_copies(target, args: tuple, count: int):
    """Run ``count`` spawned processes of ``target(*args, started, stop)`` for the block: it
    starts once each has released ``started``; ``stop`` is set at its end (joined, else
    terminated after 60 s).

    Raises:
        RuntimeError: a copy did not start in 300 s.
    """
    ctx = mp.get_context("spawn")
    started, stop = ctx.Semaphore(0), ctx.Event()
    procs = [ctx.Process(target=target, args=(*args, started, stop), daemon=True)
             for _ in range(count)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not started.acquire(timeout=300):
                raise RuntimeError("a background copy of the model did not start in 300 s")
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
