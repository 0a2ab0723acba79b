"""All-reduce time and bus bandwidth at np=2 for message sizes 4 KiB .. 64 MiB: Horovod (MPI and
Gloo controllers), raw MPI_Allreduce (mpi4py), torch.distributed (Gloo) and the reference ring
(benchmarks/ring.py), with the alpha-beta fit of the ring cost model.

    busbw = 2(N-1)/N x S / t            (nccl-tests convention; bytes/s)
    T(S)  = 2(N-1) alpha + 2(N-1)/N x S / B   (Patarasuk & Yuan 2009)

Run::

    .venv/bin/python benchmarks/allreduce.py [--min-bytes 4096] [--max-bytes 67108864] [--readme]

Each implementation runs as ``--repeats`` jobs; each job sweeps every size ``--rounds`` times
(``--iters`` timed calls per size and round, after ``--warmup``), and rank 0 writes every timing
as JSON. A size's time is the median of all its calls (all rounds, all jobs): on a shared host
the all-reduce's speed moves with the machine's state over seconds, so one short median is not
reproducible (4 KiB through Horovod here: 0.17 or 0.34 ms from one job to the next with a
0.1 ms cycle). The spread between the jobs' own medians is kept (``spread``) and tabulated.
This driver tabulates, fits and plots.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

IMPLS = ("horovod-mpi", "horovod-mpi-cycle0.1", "horovod-mpi-wake", "horovod-gloo", "mpi4py",
         "torch-gloo", "ring")
# Not run unless named in --impls (or --impls all): Horovod's TensorFlow binding (hvd.allreduce
# out of place, as hvdtrain.keras's grouped all-reduce on the TensorFlow backend), which
# `hvdtrain plan` uses for Keras on TensorFlow when the file has it; the torch binding reduces
# in place. Both Horovod bindings average (op=hvd.Average: a sum, then a pass that scales the
# result by 1/size), as hvdtrain's optimizers do.
EXTRA_IMPLS = ("horovod-tf-cycle0.1",)
# Each Horovod series runs with the settings hvdtrain.scaling.clusters.SERIES_SETTINGS gives it
# (series_env): Horovod's 1 ms cycle, a 0.1 ms cycle (hvdtrain launch --cycle-time-ms 0.1;
# `hvdtrain plan` uses those times for this host, clusters.BINDING_SERIES says why), or the
# thread woken when a tensor is enqueued, as hvdtrain's CPU ranks do (hvdtrain's Horovod patch
# 08: the wake series is skipped, with a note, on a Horovod without it). Each job also gets
# Open MPI's yield-when-idle (common.base_env).


def series_env(impl: str) -> dict[str, str]:
    """The ``HOROVOD_*`` variables of series ``impl`` (none for a series not Horovod's)."""
    from hvdtrain.scaling.clusters import SERIES_SETTINGS
    settings = SERIES_SETTINGS.get(impl)
    if settings is None:
        return {}
    env = {"HOROVOD_CYCLE_TIME": f"{settings.cycle_time_s * 1e3:g}"}
    if settings.cycle_wake:
        env["HOROVOD_CYCLE_WAKE"] = "1"
    return env


def label(nbytes: int) -> str:
    """``"4 KiB"``, ``"64 MiB"``."""
    return f"{nbytes // 1024} KiB" if nbytes < (1 << 20) else f"{nbytes >> 20} MiB"


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def iters_for(nbytes: int, iters: int) -> int:
    return max(3, min(iters, int(iters * (1 << 20) / max(nbytes, 1)) or 3))


def worker(impl: str, byte_sizes: list[int], iters: int, warmup: int, json_out: str,
           rounds: int = 1) -> None:
    """Time one implementation: ``rounds`` sweeps over every size, each ``iters_for`` timed calls
    (seconds, from a barrier); rank 0 writes ``{"calls": {size: [seconds, ...]}}`` to json_out.
    """
    if impl.startswith("horovod-tf"):
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def make(n):
            return tf.ones([n // 4], dtype=tf.float32)

        def op(t, i):
            return hvd.allreduce(t, op=hvd.Average, name=f"bench.{t.shape[0]}")

        def barrier():
            hvd.allreduce(tf.zeros([1]), name="bench.barrier")
    elif impl.startswith("horovod"):
        import horovod.torch as hvd
        import torch
        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def make(n):
            return torch.ones(n // 4, dtype=torch.float32)

        def op(t, i):
            hvd.allreduce_(t, op=hvd.Average, name=f"bench.{t.numel()}")

        def barrier():
            hvd.allreduce(torch.zeros(1), name="bench.barrier")
    elif impl == "torch-gloo":
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def make(n):
            return torch.ones(n // 4, dtype=torch.float32)

        def op(t, i):
            dist.all_reduce(t)

        def barrier():
            dist.barrier()
    else:
        from mpi4py import MPI

        from ring import ring_allreduce
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def make(n):
            return np.ones(n // 4, dtype=np.float32)

        if impl == "mpi4py":
            out = {}

            def op(t, i):
                buf = out.setdefault(t.size, np.empty_like(t))
                comm.Allreduce(t, buf, op=MPI.SUM)
        else:
            def op(t, i):
                ring_allreduce(comm, t)

        def barrier():
            comm.Barrier()
    calls: dict[int, list[float]] = {n: [] for n in byte_sizes}
    tensors = {n: make(n) for n in byte_sizes}
    for _ in range(rounds):
        for nbytes in byte_sizes:
            t = tensors[nbytes]
            for i in range(warmup):
                op(t, i)
            for i in range(iters_for(nbytes, iters)):
                barrier()
                start = time.perf_counter()
                op(t, i)
                calls[nbytes].append(time.perf_counter() - start)
    if rank == 0:
        with open(json_out, "w") as f:
            json.dump({"impl": impl, "size": size, "calls": calls}, f)
    if impl == "torch-gloo":
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()  # else Gloo's threads may abort the interpreter at exit


def launch_argv(impl: str, np_: int, args) -> list[str]:
    import common
    me = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--min-bytes",
          str(args.min_bytes), "--max-bytes", str(args.max_bytes), "--iters", str(args.iters),
          "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    if impl.startswith(("horovod-mpi", "horovod-tf")):
        return common.horovodrun(np_, me)
    if impl == "horovod-gloo":
        return common.horovodrun(np_, me, extra=("--gloo",))
    if impl == "torch-gloo":
        return [str(common.BIN / "torchrun"), "--standalone", f"--nproc_per_node={np_}", *me[1:]]
    return ["mpirun", "--allow-run-as-root", "-np", str(np_), "-bind-to", "none", *me]


def fit_alpha_beta(byte_sizes, seconds, n: int) -> tuple[float, float] | None:
    """The ring model's T = 2(N-1) alpha + 2(N-1)/N x S / B fitted as ``hvdtrain plan`` fits it
    (:func:`hvdtrain.scaling.clusters.fit_alpha_beta`, least squares on the relative error);
    returns (alpha s per ring step, B bytes/s of bus bandwidth), or None where there is one size
    only or the times do not grow with the size (a range of small messages only)."""
    from hvdtrain.scaling.clusters import fit_alpha_beta as fit
    try:
        intercept, per_byte_bw = fit(dict(zip(byte_sizes, seconds)))
    except ValueError:
        return None
    return intercept / (2 * (n - 1)), 2 * (n - 1) / n * per_byte_bw


def measure(impl: str, n: int, args, env: dict) -> dict:
    """``args.repeats`` jobs of one implementation at ``n`` ranks; returns ``{"seconds": {size:
    median of every call}, "spread": {size: [min, max] of the jobs' medians}, "calls": {size:
    number of calls}}`` (seconds; sizes in bytes).

    Raises:
        RuntimeError: a job failed (:func:`common.run_json`; the message holds its output), or
            a wake series on a Horovod without hvdtrain's patch 08 (it would measure a plain
            1 ms cycle under the wake series' name).
    """
    import common
    impl_env = {**env, **series_env(impl)}
    if impl_env.get("HOROVOD_CYCLE_WAKE") == "1":
        from hvdtrain.launch.tuning import horovod_can_wake
        if not horovod_can_wake():
            raise RuntimeError(f"{impl}: this Horovod cannot wake its thread on enqueue "
                               "(hvdtrain's patch 08); install hvdtrain's Horovod (make setup)")
    calls: dict[int, list[float]] = {}
    job_medians: dict[int, list[float]] = {}
    for _ in range(args.repeats):
        out = common.run_json(launch_argv(impl, n, args), impl_env)
        for size, values in out["calls"].items():
            calls.setdefault(int(size), []).extend(values)
            job_medians.setdefault(int(size), []).append(float(np.median(values)))
    return {"seconds": {s: float(np.median(v)) for s, v in sorted(calls.items())},
            "spread": {s: [min(v), max(v)] for s, v in sorted(job_medians.items())},
            "calls": {s: len(v) for s, v in sorted(calls.items())}}


def as_json(measured: dict[str, dict]) -> dict:
    """``{impl: measure(...)}`` in allreduce.json's layout: ``{"seconds": {impl: {"bytes":
    s}}, "spread": ..., "calls": ...}`` (sizes as strings, as JSON keys are)."""
    return {key: {impl: {str(size): v for size, v in m[key].items()}
                  for impl, m in measured.items()} for key in ("seconds", "spread", "calls")}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=IMPLS + EXTRA_IMPLS)
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated (default: {','.join(IMPLS)}; also "
                   f"{','.join(EXTRA_IMPLS)}; all: every one). The results file is rewritten "
                   "with the series measured")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--iters", type=int, default=20,
                   help="timed calls per size and round (fewer above 1 MiB; default: 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls before each size's timed ones (default: 3)")
    p.add_argument("--rounds", type=int, default=5,
                   help="sweeps over every size in one job (default: 5)")
    p.add_argument("--repeats", type=int, default=3,
                   help="jobs per implementation, their calls pooled (default: 3)")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--json-out", help="worker: rank 0 writes its timings here")
    args = p.parse_args(argv)
    byte_sizes = sizes(args.min_bytes, args.max_bytes)
    if min(args.iters, args.rounds, args.repeats) < 1 or args.warmup < 0:
        p.error("--iters, --rounds and --repeats must be >= 1, --warmup >= 0")
    if args.worker:
        worker(args.worker, byte_sizes, args.iters, args.warmup, args.json_out, args.rounds)
        return {}
    import common
    env = common.base_env(True)
    env["PYTHONPATH"] = f"{common.HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    n = args.np
    impls = list(IMPLS + EXTRA_IMPLS) if args.impls == "all" else args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS + EXTRA_IMPLS))
    if unknown:
        p.error(f"unknown --impls {','.join(unknown)}; choose from "
                f"{','.join(IMPLS + EXTRA_IMPLS)} or all")
    from hvdtrain.launch.tuning import horovod_can_wake
    if "horovod-mpi-wake" in impls and not horovod_can_wake():
        impls.remove("horovod-mpi-wake")
        print("skipped horovod-mpi-wake: this Horovod cannot wake its thread on enqueue "
              "(hvdtrain's patch 08; make setup installs hvdtrain's Horovod)")
    measured = {impl: measure(impl, n, args, env) for impl in impls}
    results = {impl: m["seconds"] for impl, m in measured.items()}
    factor = 2 * (n - 1) / n
    headers = ["size"] + [f"{i} busbw GB/s" for i in results]
    rows = []
    for s in byte_sizes:
        rows.append([label(s)] + [factor * s / results[i][s] / 1e9 for i in results])
    fits = {i: fit_alpha_beta(byte_sizes, [results[i][s] for s in byte_sizes], n)
            for i in results}
    ratio_rows = []
    variants = [i for i in results if i.startswith("horovod-mpi")]
    if variants and "mpi4py" in results:
        for s in byte_sizes:
            if s >= (1 << 20):
                ratio_rows.append([f"{s >> 20} MiB"] + [results["mpi4py"][s] / results[v][s]
                                                         for v in variants])
    text = common.table(headers, rows)
    text += "\n\n" + common.table(["implementation", "alpha (us)", "B (GB/s)"],
                                  [[i, f[0] * 1e6, f[1] / 1e9] if f else [i, "-", "-"]
                                   for i, f in fits.items()])
    if ratio_rows:
        text += "\n\n" + common.table(["size"] + [f"busbw {v} / raw MPI_Allreduce"
                                                for v in variants], ratio_rows)
    horovods = [i for i in results if i.startswith("horovod")]
    if horovods:
        def spread(i, s):
            lo, hi = measured[i]["spread"][s]
            return f"{results[i][s] * 1e3:.3g} ({lo * 1e3:.3g}-{hi * 1e3:.3g})"
        text += "\n\n" + common.table(
            ["size"] + [f"{i} ms (jobs' medians)" for i in horovods],
            [[label(s)] + [spread(i, s) for i in horovods] for s in byte_sizes])
    print(text)
    payload = {"args": vars(args), "np": n, **as_json(measured),
               "busbw_bytes_per_s": {i: {str(s): factor * s / r[s] for s in byte_sizes}
                                     for i, r in results.items()},
               "alpha_beta": {i: {"alpha_s": f[0], "bandwidth_bytes_per_s": f[1]}
                              for i, f in fits.items() if f}}
    path = common.save("allreduce", payload)
    png = common.RESULTS / "allreduce.png"

    def draw(ax):
        for impl, r in results.items():
            ax.plot(byte_sizes, [factor * s / r[s] / 1e9 for s in byte_sizes], "o-", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"all-reduce, np={n}")
        ax.legend()
    common.plot(png, draw)
    print(f"wrote {path} and {png}")
    if args.readme:
        common.update_readme("allreduce", text)
    return payload


if __name__ == "__main__":
    main()
