"""ResNet-50 training throughput on NVIDIA GPUs with synthetic data: a plain PyTorch loop against
the same loop through hvdtrain (``init``, ``distribute``, ``micro_batches`` with k=1), in fp32,
bf16 (``torch.autocast``), channels_last (fp32, NHWC model and batches), bf16 + channels_last
(what Hopper users run) and that under ``torch.compile``; and Keras 3 on its
PyTorch backend, plain ``model.fit`` against ``hvdtrain.keras``, on the small benchmark models
(``keras_mnist``, ``keras_gpt``, ... : :mod:`gpu_keras`). Output lines follow
Horovod's ``pytorch_synthetic_benchmark.py`` (``Iter #i: X img/sec per GPU``,
``Img/sec per GPU: mean +-1.96 std``, ``Total img/sec on N GPU(s): ...``).

GPU machines are noisy (clocks, other tenants), so the two loops run interleaved in one process:
each round times every variant's plain block and hvdtrain block back to back, the order of the
two swapped every round; the ratio hvdtrain / plain of a variant is the median of its per-round
ratios, printed with their min and max. The target, hvdtrain / plain >= 0.98, is reported, not
asserted.

Bounded runs (``make gpu-check``): ``--time-budget S`` starts no round that would end more than
S seconds after the start, taking the next round to last as long as the last one (the first
holds every warmup: this errs towards fewer rounds), but runs ``--min-rounds`` (default 2: each
loop first once) and at most ``--rounds``; ``--warmup-later N``: N warmup steps, not
``--warmup``, before a runner's later blocks (its kernels and cuDNN's choices are ready then).
``--json-out`` is written after each variant's pair of blocks and each round (``"complete":
false`` until the end: a run stopped from outside, even in its first round, leaves every variant
it timed in both loops), its ``"timing"`` the seconds of start-up, rounds and total.

Launch::

    python benchmarks/gpu.py --json-out benchmarks/results/gpu.json        # one GPU
    python benchmarks/gpu.py --rounds 10 --iters 3 --warmup-later 2 --time-budget 50  # bounded
    horovodrun -np 4 python benchmarks/gpu.py                              # one rank per GPU

At np=1 Horovod registers no gradient hooks (there is nothing to all-reduce), so the ratio
measures hvdtrain's own per-step cost; at np >= 2 the hvdtrain loop also all-reduces while the
plain loop stays a single-GPU loop, and the ratio becomes a scaling efficiency.

Smoke test without GPU or torchvision (what tests/unit/test_gpu_benchmark.py runs)::

    python benchmarks/gpu.py --device cpu --model tiny --image-size 32 --batch-size 4 \\
        --iters 2 --warmup 1 --batches-per-iter 1 --rounds 1

Exit status 2, before any work, with what to install, when CUDA (``--device cuda``, the
default), torchvision (any ``--model`` but ``tiny``) or Horovod is missing.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_keras beside this script
import gpu_keras  # noqa: E402  (imports nothing heavy)
from gpu_rounds import (LOOPS, TARGET_RATIO, another_round, print_results,  # noqa: E402
                        results_of, write_json)

# A variant names its precision (fp32, or bf16 autocast), layout (channels_last: NHWC model and
# batches) and torch.compile (_compile: the model compiled, default mode, in both loops).
TORCH_VARIANTS = ("fp32", "bf16", "channels_last", "bf16_channels_last",
                  "bf16_channels_last_compile")
VARIANTS = TORCH_VARIANTS + gpu_keras.VARIANTS
# What a run does by default (make gpu-check, whose bench step has 60 s): ResNet-50 in fp32,
# bf16 and bf16 + channels_last (fp32 channels_last and the compiled variant on request: with
# them the first round, which holds every warmup and cuDNN's kernel search, took past 60 s on one
# H100), and Keras on the smallest CNN and the LM, where a step is short enough for the
# adapter's own cost to show.
DEFAULT_VARIANTS = ("fp32", "bf16", "bf16_channels_last", "keras_mnist", "keras_gpt")
LOOP_NAMES = {"plain": "plain PyTorch", "hvdtrain": "hvdtrain"}
KERAS_LOOP_NAMES = {"plain": "plain Keras fit", "hvdtrain": "hvdtrain.keras"}
PROG = "benchmarks/gpu.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50",
                   help="the PyTorch variants' model: a torchvision.models name (resnet50, "
                        "resnet18, ...; weights=None), or 'tiny' (a small CNN built here, no "
                        "torchvision needed); the keras_* variants name their own")
    p.add_argument("--batch-size", type=int, default=64, help="images per step per GPU")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of this script, not a benchmark")
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed steps before each timed block")
    p.add_argument("--batches-per-iter", type=int, default=10, help="steps per timed iteration")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per block")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds (at most, with --time-budget); each times every variant's plain "
                        "and hvdtrain block once")
    p.add_argument("--min-rounds", type=int, default=2,
                   help="rounds run whatever --time-budget says (at most --rounds)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds from the start within which the last round should end; no "
                        "round starts that would not (after --min-rounds); 0: no budget")
    p.add_argument("--warmup-later", type=int,
                   help="warmup steps before a runner's later blocks (default: --warmup)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--json-out", help="rank 0 writes the results (with the machine) here")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants: {', '.join(bad) or 'none given'}; choose from {', '.join(VARIANTS)}")
    for flag in ("batch_size", "image_size", "num_classes", "batches_per_iter", "iters",
                 "rounds", "min_rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup_later is None:
        args.warmup_later = args.warmup
    for flag in ("warmup", "warmup_later", "time_budget"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    return args


def torchvision_pin(torch_version: str) -> str:
    """The torchvision release line built for a torch release: torch 2.N pairs with 0.(N+15)
    (2.13 -> 0.28)."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    return f"0.{minor + 15}.*" if major == 2 else "<the release matching your torch>"


def missing_requirements(args) -> list[str]:
    """What this run needs and lacks, each with what to do; empty when it can start."""
    import torch
    problems = []
    torch_variants = [v for v in args.variants if v in TORCH_VARIANTS]
    if len(torch_variants) < len(args.variants):
        import importlib.util
        if problem := gpu_keras.backend_problem():
            problems.append(problem)
        elif importlib.util.find_spec("keras") is None:
            problems.append(f"Keras is not installed in {sys.prefix} (needed for the keras_* "
                            "variants): pip install keras (3.x), or leave them out with "
                            "--variants " + ",".join(torch_variants or TORCH_VARIANTS))
    if args.device == "cuda" and not torch.cuda.is_available():
        build = (f"built for CUDA {torch.version.cuda}, but no GPU or driver is visible"
                 if torch.version.cuda else "a CPU-only build")
        problems.append(
            f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{build}). Run this on an NVIDIA GPU machine with a CUDA build of torch and Horovod "
            "built with NCCL (scripts/setup.sh with HVDTRAIN_GPU=1), or pass --device cpu for a "
            "smoke test of the script")
    if args.model != "tiny" and torch_variants:
        install = (f"pip install 'torchvision=={torchvision_pin(torch.__version__)}' (the "
                   f"release line built for torch {torch.__version__.split('+')[0]}) from the "
                   "same package index as torch: the CUDA wheel for a CUDA torch, the +cpu wheel "
                   "for a CPU torch; or pass --model tiny")
        try:
            import torchvision  # noqa: F401
        except ImportError:
            problems.append(f"torchvision is not installed in {sys.prefix} (needed for --model "
                            f"{args.model}): {install}")
        except Exception as exc:  # noqa: BLE001 - e.g. RuntimeError from its compiled ops
            import importlib.util
            spec = importlib.util.find_spec("torchvision")
            where = Path(spec.origin).parent if spec and spec.origin else sys.prefix
            problems.append(
                f"torchvision ({where}) does not import "
                f"({type(exc).__name__}: {exc}): it was built for another torch than "
                f"{torch.__version__} (e.g. the CUDA wheel beside a CPU torch); {install}")
    try:
        import horovod.torch  # noqa: F401
    except ImportError as exc:
        problems.append(f"Horovod's PyTorch layer does not import ({exc}): run make setup "
                        "(scripts/setup.sh), which builds Horovod against this torch")
    return problems


def build_model(args):
    """``args.model`` with ``args.num_classes`` outputs and fresh (random) weights."""
    from torch import nn
    if args.model == "tiny":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, args.num_classes))
    import torchvision
    if args.model not in torchvision.models.list_models():
        raise SystemExit(f"{PROG}: error: --model {args.model!r} is not a torchvision model "
                         f"(torchvision {torchvision.__version__}); e.g. resnet50, resnet18, or "
                         "tiny")
    return torchvision.models.get_model(args.model, weights=None, num_classes=args.num_classes)


class Runner:
    """One variant through one loop: its own model, optimizer and synthetic batch, kept for the
    whole run so that rounds only time steps."""

    def __init__(self, args, variant: str, loop: str, device):
        import torch
        import torch.nn.functional as F

        import hvdtrain.torch as ht

        torch.manual_seed(0)  # both loops start from the same weights
        fmt = torch.channels_last if "channels_last" in variant else torch.contiguous_format
        model = build_model(args).to(device).to(memory_format=fmt)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        if loop == "hvdtrain":
            model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=1)
        model.train()
        if variant.endswith("_compile"):  # after distribute, as a user compiles the model
            model = torch.compile(model)
        g = torch.Generator().manual_seed(1)
        data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
        data = data.to(device).contiguous(memory_format=fmt)
        target = torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device)
        bf16 = variant.startswith("bf16")

        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

        def plain(steps: int) -> None:
            for _ in range(steps):
                with autocast():
                    loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

        def hvdtrain(steps: int) -> None:
            for (x, y), micro in ht.micro_batches([(data, target)] * steps, 1):
                with autocast():
                    loss = F.cross_entropy(model(x), y)
                (loss * micro.loss_weight).backward()
                if micro.sync:
                    optimizer.step()
                    optimizer.zero_grad()

        self.steps = plain if loop == "plain" else hvdtrain
        self.sync = ((lambda: torch.cuda.synchronize(device)) if device.type == "cuda"
                     else (lambda: None))

    def block(self, args) -> list[float]:
        """Warm up (``args.warmup`` steps), then time ``args.iters`` iterations of
        ``args.batches_per_iter`` steps; returns their seconds."""
        if args.warmup:
            self.steps(args.warmup)
        seconds = []
        for _ in range(args.iters):
            self.sync()
            start = time.perf_counter()
            self.steps(args.batches_per_iter)
            self.sync()  # CUDA runs asynchronously: time what the GPU did, not what was queued
            seconds.append(time.perf_counter() - start)
        return seconds


def _try(get, default=None):
    """``get()``, or ``default`` where it raises (a fact this machine cannot tell)."""
    try:
        return get()
    except Exception:  # noqa: BLE001 - the fact stays unknown
        return default


def machine(device) -> dict:
    """The GPU, driver, CUDA and library versions the numbers were measured with."""
    import torch

    import horovod
    import horovod.torch as hvd
    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "torchvision": _try(lambda: __import__("torchvision").__version__),
             "horovod": horovod.__version__, "horovod_nccl_built": bool(hvd.nccl_built()),
             "host": platform.node(), "cpu_count": os.cpu_count()}
    if device.type != "cuda":
        return {**facts, "gpu": None}
    api = _try(lambda: torch._C._cuda_getDriverVersion())  # 13000: the CUDA API of the driver
    facts.update({
        "gpu": torch.cuda.get_device_name(device), "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1),
        "compute_capability": "%d.%d" % torch.cuda.get_device_capability(device),
        "driver": nvidia_driver(), "cuda_driver_api": api and f"{api // 1000}.{api % 1000 // 10}",
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "nccl": _try(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
        "tf32_convolutions": torch.backends.cudnn.allow_tf32,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark})
    return facts


def nvidia_driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi, else NVML), or None."""
    if shutil.which("nvidia-smi"):
        out = _try(lambda: subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                           "--format=csv,noheader"], capture_output=True,
                                          text=True, timeout=30))
        if out and out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]

    def nvml():
        import pynvml
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    return _try(nvml)


def main(argv=None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    problems = missing_requirements(args)
    if problems:
        for problem in problems:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)

    keras_variants = [v for v in args.variants if v in gpu_keras.VARIANTS]
    if keras_variants:
        gpu_keras.use_torch_backend(args.device)  # before Keras is imported
    import torch

    import horovod.torch as hvd
    import hvdtrain.torch as ht
    info = ht.init(seed=0, device=args.device)
    if keras_variants:
        import hvdtrain.keras as hk
        hk.init(seed=0, device=args.device)  # what a Keras user calls (Horovod is up already)
    device = torch.device(info.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as Horovod's benchmark: fastest conv kernels
    rank0 = info.rank == 0
    log = print if rank0 else (lambda *a, **k: None)
    unit = "GPU" if device.type == "cuda" else "CPU"
    log(f"Model: {args.model}")
    if keras_variants:
        log(f"Keras 3 on PyTorch: {', '.join(keras_variants)}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {unit}s: {info.size}")
    budget = f" within {args.time_budget:g} s" if args.time_budget else ""
    log(f"Variants: {', '.join(args.variants)}; loops: plain (PyTorch, Keras fit), hvdtrain (k=1); "
        f"{min(args.min_rounds, args.rounds)} to {args.rounds} round(s){budget} of {args.iters} x "
        f"{args.batches_per_iter} steps per block, {args.warmup} warmup steps before a runner's "
        f"first block, {args.warmup_later} before its others")

    def loop_name(variant: str, loop: str) -> str:
        return (KERAS_LOOP_NAMES if variant in keras_variants else LOOP_NAMES)[loop]

    runners = {(v, loop): (gpu_keras.KerasRunner if v in keras_variants else Runner)(
        args, v, loop, device) for v in args.variants for loop in LOOPS}
    later = argparse.Namespace(**{**vars(args), "warmup": args.warmup_later})
    kinds = {v: {"model": v[len(gpu_keras.PREFIX):], "framework": "keras (torch backend)"}
             if v in keras_variants else {"model": args.model, "framework": "torch"}
             for v in args.variants}
    samples = args.batch_size * args.batches_per_iter
    iters = {key: [] for key in runners}   # img/sec of every timed iteration
    rounds = {key: [] for key in runners}  # img/sec of each round's block
    timing = {"startup_s": round(time.perf_counter() - started, 2), "rounds_s": []}
    log(f"Started in {timing['startup_s']:.1f} s (imports, Horovod, {len(runners)} models)")
    settings = ("warmup", "warmup_later", "batches_per_iter", "iters", "rounds", "min_rounds",
                "time_budget", "lr")
    report = {"benchmark": "gpu", "model": args.model, "batch_size": args.batch_size,
              "image_size": args.image_size, "num_classes": args.num_classes,
              "device": args.device, "unit": unit, "size": info.size,
              "settings": {**{k: getattr(args, k) for k in settings},
                           "backward_passes_per_step": 1},
              "target_ratio": TARGET_RATIO, "machine": machine(device), "timing": timing,
              "complete": False, "variants": {}}
    r = 0
    while True:
        go = another_round(r, args, time.perf_counter() - started, (timing["rounds_s"] or [0])[-1])
        if info.size > 1:  # every rank runs the same rounds (the hvdtrain loop all-reduces)
            go = hvd.broadcast_object(go, root_rank=0, name="gpu_bench.round")
        if not go:
            break
        round_start = time.perf_counter()
        order = LOOPS if r % 2 == 0 else LOOPS[::-1]  # alternate who goes first
        for variant in args.variants:
            for loop in order:
                key = (variant, loop)
                log(f"Round {r + 1}/{args.rounds}, {variant}, {loop_name(variant, loop)}: "
                    "Running benchmark...")
                block_start = time.perf_counter()
                seconds = runners[key].block(args if not rounds[key] else later)
                log(f"Block took {time.perf_counter() - block_start:.1f} s (warmup included)")
                for s in seconds:
                    log(f"Iter #{len(iters[key])}: {samples / s:.1f} img/sec per {unit}")
                    iters[key].append(samples / s)
                rounds[key].append(samples * len(seconds) / sum(seconds))
            # After each variant's pair: a run stopped mid-round (make gpu-check's step budget)
            # still leaves the variants it timed in both loops.
            report["variants"] = results_of(kinds, iters, rounds, info.size)
            if rank0 and args.json_out:
                write_json(args.json_out, report)
        r += 1
        timing["rounds_s"].append(round(time.perf_counter() - round_start, 2))
        log(f"Round {r} took {timing['rounds_s'][-1]:.1f} s "
            f"({time.perf_counter() - started:.1f} s since the start)")
        if rank0 and args.json_out:  # the round's time (its variants were written after each pair)
            write_json(args.json_out, report)
    timing.update(rounds=r, stopped_by="--rounds" if r >= args.rounds else "--time-budget")
    print_results(log, report["variants"], unit, info.size, loop_name)
    timing["total_s"] = round(time.perf_counter() - started, 2)
    log(f"{r} round(s) (stopped by {timing['stopped_by']}) in {timing['total_s']:.1f} s: "
        f"start-up {timing['startup_s']:.1f} s, rounds "
        f"{', '.join(f'{t:.1f}' for t in timing['rounds_s'])} s")
    report["complete"] = True
    if rank0 and args.json_out:
        write_json(args.json_out, report)
        log(f"wrote {args.json_out}")
    return report


if __name__ == "__main__":
    main()
