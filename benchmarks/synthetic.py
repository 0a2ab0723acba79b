"""Synthetic-data training throughput, in the output format of Horovod's
``pytorch_synthetic_benchmark.py`` / ``tensorflow2_keras_synthetic_benchmark.py``.

Launch::

    horovodrun -np 2 python benchmarks/synthetic.py --framework torch --model cnn
    horovodrun -np 2 python benchmarks/synthetic.py --framework keras --model cnn
    python benchmarks/synthetic.py --framework torch --mode single      # no Horovod at all

Modes: ``hvdtrain`` (hvdtrain.torch / hvdtrain.keras: thread budget, distribute), ``plain`` (a
hand-written Horovod loop as in Horovod's examples: hvd.init, DistributedOptimizer, broadcast; no
thread setting), ``single`` (one process, no Horovod) and ``ddp`` (PyTorch
DistributedDataParallel over Gloo; ``torchrun --standalone --nproc_per_node 2 ...``). Prints ``Iter #i: X img/sec per
worker``, ``Img/sec per worker: mean +- 1.96*std``, ``Total img/sec on N worker(s): ...`` and a
last line ``JSON {...}`` with the numbers (img/sec are samples per second).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import timeit

import numpy as np

MODELS = ("mnist", "cnn", "dense", "gpt")  # hvdtrain.{torch,keras}.models.BENCH_MODELS


def synthetic_batch(model: str, batch_size: int, image_size: int, channels_last: bool):
    """One random batch ``(x, y)`` as NumPy arrays for ``model``: images ``(B, C, S, S)`` (or
    channels-last) float32 and labels ``(B,)``; for ``gpt`` token ids ``(B, 64)`` and next-token
    targets ``(B, 64)`` (int64)."""
    rng = np.random.default_rng(0)
    if model == "gpt":
        from hvdtrain.torch.models import GPT_CONTEXT, GPT_VOCAB
        return (rng.integers(0, GPT_VOCAB, (batch_size, GPT_CONTEXT)),
                rng.integers(0, GPT_VOCAB, (batch_size, GPT_CONTEXT)))
    channels, side = (1, 28) if model == "mnist" else (3, image_size)
    shape = (batch_size, side, side, channels) if channels_last else (batch_size, channels, side,
                                                                      side)
    return rng.standard_normal(shape, dtype=np.float32), rng.integers(0, 10, batch_size)


def same_batch_forever(x, y):
    """A ``keras.utils.PyDataset`` that yields the batch ``(x, y)`` forever (as Horovod's
    synthetic benchmarks), for ``model.fit(..., steps_per_epoch=n)``."""
    import keras

    class Same(keras.utils.PyDataset):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, i):
            return x, y

    return Same()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "keras"), default="torch")
    p.add_argument("--model", choices=MODELS, default="cnn",
                   help="mnist: hvdtrain train's MNIST CNN (28x28x1); cnn, dense: 3xSxS images; "
                        "gpt: a 3.3 M-parameter transformer LM, a sample is 64 tokens")
    p.add_argument("--mode", choices=("hvdtrain", "plain", "single", "ddp"), default="hvdtrain",
                   help="ddp: PyTorch DistributedDataParallel (Gloo), launch with torchrun")
    p.add_argument("--batch-size", type=int, default=32, help="local batch")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("-k", "--backward-passes-per-step", type=int, default=1)
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--json-out", help="rank 0 writes the result JSON here")
    p.add_argument("--jit-compile", default="false", choices=("auto", "true", "false"),
                   help="Keras: model.compile's jit_compile (XLA on the TensorFlow backend)")
    p.add_argument("--threads", type=int, help="--mode single: intra-op threads (and "
                   "TensorFlow's inter-op threads; default: all)")
    p.add_argument("--start-barrier", metavar="DIR,N",
                   help="--mode single: after the warm-up, wait until N processes given the "
                        "same empty DIR have warmed up, then time (independent processes timed "
                        "side by side)")
    p.add_argument("--timeline-allreduces", action="store_true",
                   help="count gradient all-reduces in Horovod's timeline over the timed batches")
    args = p.parse_args(argv)
    if args.mode == "ddp" and args.framework != "torch":
        p.error("--mode ddp is PyTorch's DistributedDataParallel: use it with --framework torch")
    if args.start_barrier is not None:
        where, _, count = args.start_barrier.rpartition(",")
        if args.mode != "single" or not where or not count.isdigit() or int(count) < 1:
            p.error("--start-barrier DIR,N (N >= 1) is for --mode single")
    return args


def start_barrier(spec: str | None, timeout_s: float = 600.0) -> None:
    """Wait until N processes given the same ``DIR,N`` have called this (each writes a file in
    DIR, then polls every 10 ms until DIR holds N). Nothing without ``spec``.

    Raises:
        TimeoutError: fewer than N arrived within ``timeout_s`` seconds.
    """
    if spec is None:
        return
    where, _, count = spec.rpartition(",")
    os.makedirs(where, exist_ok=True)
    open(os.path.join(where, f"ready-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(where)) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"--start-barrier {spec}: only {len(os.listdir(where))} arrived")
        time.sleep(0.01)


def torch_setup(args):
    """Returns (step, rank, size, hvd module or None) for PyTorch."""
    import torch
    import torch.nn.functional as F

    from hvdtrain.torch.models import bench_model

    k = args.backward_passes_per_step
    if args.mode == "single":
        rank, size, hvd = 0, 1, None
        if args.threads:
            torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        model = bench_model(args.model, image_size=args.image_size)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif args.mode == "plain":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        model = bench_model(args.model, image_size=args.image_size)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             backward_passes_per_step=k)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif args.mode == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo")
        rank, size, hvd = dist.get_rank(), dist.get_world_size(), None
        torch.manual_seed(0)
        model = DistributedDataParallel(bench_model(args.model, image_size=args.image_size))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
        if k > 1:
            raise SystemExit("--mode ddp measures k=1 only (use no_sync() for accumulation)")
    else:
        import horovod.torch as hvd

        import hvdtrain.torch as ht
        info = ht.init(seed=0)
        rank, size = info.rank, info.size
        model = bench_model(args.model, image_size=args.image_size)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, optimizer = ht.distribute(model, optimizer, backward_passes_per_step=k)
    x, y = synthetic_batch(args.model, args.batch_size, args.image_size, channels_last=False)
    data, target = torch.from_numpy(x), torch.from_numpy(y).reshape(-1)

    def step():
        # One optimizer step = k micro-batches (each of the local batch).
        for _ in range(k):
            out = model(data)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target) / k
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, rank, size, hvd


def keras_setup(args):
    """Returns (fit_steps, rank, size, hvd module or None) for Keras 3 (KERAS_BACKEND's backend).

    ``fit_steps(n, marks)`` runs n optimizer steps (n x k micro-batches) in ONE ``model.fit``
    call over an endless in-memory dataset, the way Keras users train (``fit``'s set-up once, not
    per timed iteration), and returns the ``time.perf_counter()`` at the end of each optimizer
    step (a callback; ``marks[i]()`` runs after step i, before its time is taken). ``plain`` is
    Horovod's own Keras layer as in Horovod's ``tensorflow2_keras_synthetic_benchmark.py``
    (``horovod.tensorflow.keras``: TensorFlow backend only; on Keras 3 it all-reduces only with
    hvdtrain's Horovod build, patch 15).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from hvdtrain.keras.models import bench_model

    k = args.backward_passes_per_step
    callbacks = []
    if args.mode == "plain":
        if keras.backend.backend() != "tensorflow":
            raise SystemExit("--mode plain --framework keras needs KERAS_BACKEND=tensorflow: "
                             "Horovod's Keras layer (horovod.tensorflow.keras) is TensorFlow's")
        import horovod.tensorflow.keras as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        model = bench_model(args.model, image_size=args.image_size)
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * size, momentum=0.9),
                                             backward_passes_per_step=k)
        callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    elif args.mode == "single":
        rank, size, hvd = 0, 1, None
        if args.threads:
            if keras.backend.backend() == "tensorflow":
                import tensorflow as tf
                tf.config.threading.set_intra_op_parallelism_threads(args.threads)
                tf.config.threading.set_inter_op_parallelism_threads(args.threads)
            else:
                import torch
                torch.set_num_threads(args.threads)
        keras.utils.set_random_seed(0)
        model = bench_model(args.model, image_size=args.image_size)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9,
                                         gradient_accumulation_steps=k if k > 1 else None)
    else:
        import hvdtrain.keras as hk
        from hvdtrain.keras.collectives import hvd
        info = hk.init(seed=0)
        rank, size = info.rank, info.size
        model = bench_model(args.model, image_size=args.image_size)
        model, optimizer = hk.distribute(model, keras.optimizers.SGD(0.01, momentum=0.9),
                                         backward_passes_per_step=k)
    jit = {"auto": "auto", "true": True, "false": False}[args.jit_compile]
    model.compile(optimizer=optimizer, jit_compile=jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = same_batch_forever(*synthetic_batch(args.model, args.batch_size, args.image_size,
                                               channels_last=True))

    class Clock(keras.callbacks.Callback):
        """The time at the end of every optimizer step (every k-th micro-batch)."""

        def __init__(self, marks):
            super().__init__()
            self.times, self.marks = [], marks

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % k == 0:  # a mark runs before the step's time is taken
                self.marks.get(len(self.times), lambda: None)()
                self.times.append(time.perf_counter())

    def fit_steps(n: int, marks: dict) -> list[float]:
        clock = Clock(marks)
        model.fit(data, epochs=1, steps_per_epoch=n * k, verbose=0, callbacks=[*callbacks, clock])
        return clock.times

    return fit_steps, rank, size, hvd


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.timeline_allreduces:
        os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
    # The framework imported with the garbage collector paused and its objects frozen, as
    # `hvdtrain train` does (hvdtrain.runtime.import_frozen); every mode alike.
    from hvdtrain import runtime
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    runtime.import_frozen(*(("torch", "torch._dynamo") if args.framework == "torch" else
                            ("keras",)))
    if args.framework == "torch":
        step, rank, size, hvd = torch_setup(args)
    else:
        fit_steps, rank, size, hvd = keras_setup(args)
    log = print if rank == 0 else (lambda *a, **k: None)
    k = args.backward_passes_per_step
    samples_per_step = args.batch_size * k
    log(f"Model: {args.model}, framework: {args.framework}, mode: {args.mode}")
    log(f"Batch size: {args.batch_size} (x k={k}), number of workers: {size}")
    timeline = f"/tmp/hvdtrain-bench-timeline-{os.getpid()}.json"
    count = args.timeline_allreduces and hvd is not None
    start_timeline = (lambda: hvd.start_timeline(timeline, mark_cycles=False)) if count else (
        lambda: None)
    per_iter, warm = args.num_batches_per_iter, max(1, args.num_warmup_batches)
    if args.framework == "torch":
        timeit.timeit(step, number=args.num_warmup_batches)
        start_barrier(args.start_barrier)
        start_timeline()
        began = time.perf_counter()
        seconds = [timeit.timeit(step, number=per_iter) for _ in range(args.num_iters)]
        window = [began, time.perf_counter()]
    else:  # one fit for everything; iteration i spans the steps after warm + i * per_iter - 1
        times = fit_steps(warm + args.num_iters * per_iter,
                          {warm - 1: lambda: (start_barrier(args.start_barrier),
                                              start_timeline())})
        seconds = [times[warm - 1 + (i + 1) * per_iter] - times[warm - 1 + i * per_iter]
                   for i in range(args.num_iters)]
        window = [times[warm - 1], times[warm - 1 + args.num_iters * per_iter]]
    img_secs = []
    for i, sec in enumerate(seconds):
        img_sec = samples_per_step * per_iter / sec
        log(f"Iter #{i}: {img_sec:.1f} img/sec per worker")
        img_secs.append(img_sec)
    allreduces = None
    if count:
        hvd.stop_timeline()
        if rank == 0:
            from hvdtrain.timeline import count_ops, load_events
            allreduces = count_ops(load_events(timeline))
            os.unlink(timeline)
    # The run's throughput is every timed sample over the whole timed span (not the mean of the
    # iterations' rates, which weighs a slow iteration less than the time it took).
    samples_timed = samples_per_step * args.num_batches_per_iter * args.num_iters * size
    total = samples_timed / sum(seconds)
    mean, conf = total / size, float(1.96 * np.std(img_secs))
    log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} worker(s): {total:.1f} +-{size * conf:.1f}")
    result = {"framework": args.framework, "model": args.model, "mode": args.mode, "size": size,
              "batch_size": args.batch_size, "backward_passes_per_step": k,
              "img_sec_per_worker": mean, "img_sec_per_worker_conf": conf,
              "total_img_sec": total, "iters": img_secs, "timed_seconds": sum(seconds),
              # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process of a Linux
              # host) at the start and end of the timed steps, and the samples in between.
              "timed_window": window, "samples_timed": samples_timed,
              "allreduces": allreduces,
              "allreduces_per_sample": (allreduces / samples_timed) if allreduces else None,
              "threads": _threads(args.framework),
              # Horovod's controller: Gloo for horovodrun --gloo, Spark, Ray and elastic ranks,
              # MPI for horovodrun and mpirun (whose CPU operations may still be Gloo's)
              "controller": None if hvd is None else ("mpi" if hvd.mpi_enabled() else "gloo")}
    log("JSON " + json.dumps(result))
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)
    if args.mode == "ddp":
        import torch.distributed as dist
        # Tear DDP down in order: the DDP model first (its reducer holds Gloo work objects), then,
        # once every rank is here, the process group. Left to interpreter exit, a rank aborted in
        # C++ about 1 run in 22 ("terminate called without an active exception", SIGABRT, after
        # destroy_process_group had returned; 2 of 45 runs here, 0 of 80 with this order).
        del step
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return result


def _threads(framework: str) -> int:
    if framework == "torch":
        import torch
        return torch.get_num_threads()
    import keras
    if keras.backend.backend() == "torch":
        import torch
        return torch.get_num_threads()
    import tensorflow as tf
    return tf.config.threading.get_intra_op_parallelism_threads()


if __name__ == "__main__":
    main()
