"""Where a training step's time goes through hvdtrain on one GPU, against the plain loop:
ResNet-50 (batch 64, synthetic data, SGD with momentum) in one precision and layout (default
bf16 autocast + channels_last, optionally under ``torch.compile``), through these paths, timed
in interleaved rounds in one process (the order rotating every round):

``plain``
    the plain PyTorch loop.
``hvdtrain``
    ``hvdtrain.torch.distribute`` at np=1: Horovod registers no gradient hooks at one rank, so
    this is what a one-GPU user pays.
``hooks``
    the same with Horovod's per-gradient path on (``HOROVOD_ELASTIC=1`` while the optimizer is
    built: Horovod then hooks every gradient, as it does for elastic jobs): a hook per gradient,
    the enqueue, the fusion buffer, NCCL's all-reduce over one rank and ``synchronize()`` in
    ``step()``; what every step does at np >= 2, less the time on the wire.
``hooks_copy``
    ``hooks`` with gradients that are not contiguous (channels_last) sent through a contiguous
    copy and copied back, as :class:`hvdtrain.torch.optimizer.DenseLayout` did before it sent a
    permuted view of the gradient's own memory.

Reported per path (JSON and a table): images/s of each round (median, min, max over rounds;
each round's ratio to ``plain`` of the same round), and per step, medians: host ms from the
step's start until ``backward()`` returns and host ms inside ``step()`` (Horovod's
``synchronize()`` waits there), and GPU ms from the end of the backward pass to the end of the
step (CUDA events; the optimizer's kernels plus any wait for the all-reduce). Counted in one step
after the warmup (:class:`StepCounter`): device copies of gradient-sized tensors made through
PyTorch ops, and the host synchronisations PyTorch sees (``torch.cuda.set_sync_debug_mode``).

Horovod reads ``HOROVOD_ENABLE_ASYNC_COMPLETION`` at init: unset, a GPU all-reduce's handle
completes once the GPU finished it, so ``synchronize()`` holds the host until then; with ``1``
it completes once the all-reduce is queued and PyTorch's stream waits for it on the GPU. Run
this twice to compare (``env HOROVOD_ENABLE_ASYNC_COMPLETION=1 python ...``); the JSON records it.

Launch (one GPU)::

    python benchmarks/gpu_breakdown.py --json-out runs/breakdown.json
    python benchmarks/gpu_breakdown.py --compile --rounds 4

Smoke test on a CPU (tests/parallel/test_torch_layout.py counts copies with StepCounter)::

    python benchmarks/gpu_breakdown.py --device cpu --model tiny --image-size 32 --batch-size 4 \\
        --rounds 2 --steps 2 --warmup 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

PATHS = ("plain", "hvdtrain", "hooks", "hooks_copy")
PROG = "benchmarks/gpu_breakdown.py"


class StepCounter:
    """Counts, while active (``with StepCounter(sizes) as c: ...``), PyTorch ops that copy a
    tensor of one of ``sizes`` elements (``aten.copy_``, ``clone``, ``_to_copy``,
    ``contiguous``'s clone: ``c.copies``, a list of ``(op, numel)``) and the host
    synchronisations that PyTorch's sync debug mode reports on CUDA (``c.syncs``). Horovod's own
    collectives and fusion-buffer copies do not go through PyTorch ops and are not counted:
    what is counted is what the adapter adds around them.

    Args:
        sizes: element counts of the tensors that matter (e.g. every parameter's ``numel()``).
    """

    COPY_OPS = ("copy_", "clone", "_to_copy")

    def __init__(self, sizes):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.sizes = set(sizes)
        self.copies: list[tuple[str, int]] = []
        self.syncs = 0
        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in StepCounter.COPY_OPS and args and hasattr(args[0], "numel") \
                        and args[0].numel() in counter.sizes:
                    counter.copies.append((name, int(args[0].numel())))
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()

    def __enter__(self):
        import torch
        self._cuda = torch.cuda.is_available()
        if self._cuda:
            self._debug = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch
        self._mode.__exit__(*exc)
        self.syncs = sum("synchroniz" in str(w.message) for w in self._caught)
        self._warnings.__exit__(*exc)
        if self._cuda:
            torch.cuda.set_sync_debug_mode(self._debug)
        return False


def counted_step(model, optimizer, x, y, bf16: bool = False) -> dict:
    """One step (cross-entropy of ``model(x)`` against ``y``, ``backward()``, ``step()``,
    ``zero_grad()``) after an uncounted one, under :class:`StepCounter` over ``model``'s
    parameter sizes: ``{"copies": [(op, numel), ...], "syncs": int}``.

    Args:
        x: a batch, (N, C, H, W), on the model's device and in its memory format.
        y: class indices, (N,).
        bf16: under ``torch.autocast`` to bfloat16.
    """
    import torch
    import torch.nn.functional as F

    def step():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    with StepCounter([p.numel() for p in model.parameters()]) as c:
        step()
    return {"copies": sorted(c.copies), "syncs": c.syncs}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", help="a torchvision model, or 'tiny'")
    p.add_argument("--batch-size", type=int, default=64, help="images per step")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16",
                   help="bf16: torch.autocast to bfloat16 (weights and gradients stay fp32)")
    p.add_argument("--layout", choices=("channels_last", "contiguous"), default="channels_last")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (both loops)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each block")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not args.paths or set(args.paths) - set(PATHS):
        p.error(f"--paths: choose from {', '.join(PATHS)}")
    for flag in ("batch_size", "image_size", "num_classes", "rounds", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


class PathRunner:
    """One path: its own model, optimizer and batch, kept for the whole run."""

    def __init__(self, args, path: str, device):
        import torch
        import torch.nn.functional as F

        import hvdtrain.torch as ht
        from gpu import build_model

        torch.manual_seed(0)
        fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
        model = build_model(args).to(device).to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.sizes = [p.numel() for p in model.parameters()]
        if path != "plain":
            saved = os.environ.get("HOROVOD_ELASTIC")
            if path.startswith("hooks"):
                os.environ["HOROVOD_ELASTIC"] = "1"  # Horovod hooks every gradient at np=1 too
            try:
                model, opt = ht.distribute(model, opt, backward_passes_per_step=1)
            finally:
                if saved is None:
                    os.environ.pop("HOROVOD_ELASTIC", None)
                else:
                    os.environ["HOROVOD_ELASTIC"] = saved
            if path == "hooks_copy":
                opt._compression = CopyLayout(opt._compression.inner)
            if path.startswith("hooks") and not opt._grad_accs:
                raise SystemExit(f"{PROG}: error: Horovod registered no gradient hooks")
        model.train()
        if args.compile:
            model = torch.compile(model)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
        x = x.to(device).contiguous(memory_format=fmt)
        y = torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device)
        cuda = device.type == "cuda"
        bf16 = args.precision == "bf16"
        self.host_bwd, self.host_step, self.gpu_step = [], [], []

        def step(record: bool) -> None:
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            t1 = time.perf_counter()
            if cuda and record:
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            if record:
                self.host_bwd.append((t1 - t0) * 1e3)
                self.host_step.append((t2 - t1) * 1e3)
                if cuda:
                    e2 = torch.cuda.Event(enable_timing=True)
                    e2.record()
                    self._events.append((e1, e2))

        self._events = []
        self.step = step
        self.sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        self.model = model

    def block(self, steps: int, warmup: int) -> float:
        """Seconds for ``steps`` steps after ``warmup`` untimed ones (the GPU drained at both
        ends)."""
        for _ in range(warmup):
            self.step(False)
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(True)
        self.sync()
        seconds = time.perf_counter() - start
        self.gpu_step += [a.elapsed_time(b) for a, b in self._events]
        self._events.clear()
        return seconds

    def count(self) -> dict:
        """Copies and host synchronisations in one step (:class:`StepCounter`)."""
        self.sync()
        with StepCounter(self.sizes) as c:
            self.step(False)
        self.sync()
        return {"gradient_sized_copies": len(c.copies), "copy_ops": sorted(set(c.copies)),
                "host_syncs_seen_by_torch": c.syncs}


def _copy_layout():
    from hvdtrain.torch.optimizer import DenseLayout

    class CopyLayout(DenseLayout):
        """DenseLayout before the permuted view: a contiguous copy of a non-contiguous
        gradient is sent and the result copied into a tensor of its layout."""

        def compress(self, tensor):
            if tensor.is_contiguous():
                compressed, ctx = self.inner.compress(tensor)
                return compressed, (None, ctx, tensor, tensor._version)
            compressed, ctx = self.inner.compress(tensor.contiguous())
            return compressed, (tensor, ctx, tensor, tensor._version)
    return CopyLayout


def CopyLayout(inner):  # noqa: N802 - builds the class when torch is there
    return _copy_layout()(inner)


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu
    gpu_args = argparse.Namespace(**{**vars(args), "variants": ["fp32"]})
    problems = gpu.missing_requirements(gpu_args)
    if problems:
        for problem in problems:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    import torch

    import hvdtrain.torch as ht
    info = ht.init(seed=0, device=args.device)
    if info.size != 1:
        raise SystemExit(f"{PROG}: error: run this on one rank (got {info.size})")
    device = torch.device(info.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    started = time.perf_counter()
    runners = {path: PathRunner(args, path, device) for path in args.paths}
    counts = {}
    for path, runner in runners.items():  # warm (compiles, cuDNN's choices), then count
        runner.block(1, args.warmup)
        counts[path] = runner.count()
    runners_s = round(time.perf_counter() - started, 1)
    img = {path: [] for path in runners}
    for r in range(args.rounds):
        k = r % len(args.paths)
        for path in args.paths[k:] + args.paths[:k]:
            seconds = runners[path].block(args.steps, args.warmup)
            img[path].append(args.batch_size * args.steps / seconds)
    import horovod
    report = {
        "benchmark": "gpu_breakdown", "model": args.model, "batch_size": args.batch_size,
        "precision": args.precision, "layout": args.layout, "compile": args.compile,
        "device": args.device, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "horovod_enable_async_completion": os.environ.get("HOROVOD_ENABLE_ASYNC_COMPLETION"),
        "machine": gpu.machine(device), "horovod": horovod.__version__,
        "startup_and_warmup_s": runners_s, "paths": {}}
    for path, runner in runners.items():
        entry = {"img_sec": summary(img[path]), "img_sec_rounds": img[path],
                 "host_ms_until_backward_returns": summary(runner.host_bwd),
                 "host_ms_in_step": summary(runner.host_step), **counts[path]}
        if runner.gpu_step:
            entry["gpu_ms_backward_end_to_step_end"] = summary(runner.gpu_step)
        if "plain" in img and path != "plain":
            ratios = [a / b for a, b in zip(img[path], img["plain"])]
            entry["ratio_to_plain"] = summary(ratios)
        report["paths"][path] = entry
    print(f"{args.model}, batch {args.batch_size}, {args.precision}, {args.layout}"
          f"{', compiled' if args.compile else ''}, HOROVOD_ENABLE_ASYNC_COMPLETION="
          f"{report['horovod_enable_async_completion']}, {args.rounds} rounds x {args.steps} steps")
    print(f"{'path':<11} {'img/s':>8} {'ratio (min-max)':>22} {'host bwd ms':>11} "
          f"{'host step ms':>12} {'gpu step ms':>11} {'copies':>6} {'syncs':>5}")
    for path, e in report["paths"].items():
        ratio = e.get("ratio_to_plain")
        ratio_s = (f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})"
                   if ratio else "")
        gpu_ms = e.get("gpu_ms_backward_end_to_step_end", {}).get("median")
        print(f"{path:<11} {e['img_sec']['median']:8.1f} {ratio_s:>22} "
              f"{e['host_ms_until_backward_returns']['median']:11.2f} "
              f"{e['host_ms_in_step']['median']:12.2f} "
              f"{'' if gpu_ms is None else f'{gpu_ms:.2f}':>11} "
              f"{e['gradient_sized_copies']:6d} {e['host_syncs_seen_by_torch']:5d}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
