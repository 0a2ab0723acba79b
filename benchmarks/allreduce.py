"""All-reduce time and bus bandwidth at np=2 for message sizes 4 KiB .. 64 MiB: Horovod (MPI and
Gloo controllers), raw MPI_Allreduce (mpi4py), torch.distributed (Gloo) and the reference ring
(benchmarks/ring.py), with the alpha-beta fit of the ring cost model.

    busbw = 2(N-1)/N x S / t            (nccl-tests convention; bytes/s)
    T(S)  = 2(N-1) alpha + 2(N-1)/N x S / B   (Patarasuk & Yuan 2009)

Run::

    .venv/bin/python benchmarks/allreduce.py [--min-bytes 4096] [--max-bytes 67108864] [--readme]

One job per implementation measures every size (median of ``--iters`` timed calls after
``--warmup``) and rank 0 writes the timings as JSON; this driver tabulates, fits and plots.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

IMPLS = ("horovod-mpi", "horovod-mpi-cycle0.1", "horovod-gloo", "mpi4py", "torch-gloo", "ring")
# Not run unless named in --impls (or --impls all): Horovod's TensorFlow binding (hvd.allreduce
# out of place, as hvdtrain.keras's grouped all-reduce on the TensorFlow backend, which averages
# where this sums), which `hvdtrain plan` uses for Keras on TensorFlow when the file has it; the
# torch binding reduces in place.
EXTRA_IMPLS = ("horovod-tf-cycle0.1",)
# Horovod's background thread batches requests every HOROVOD_CYCLE_TIME ms; the cycle0.1 variant
# sets it to 0.1 ms (hvdtrain launch --cycle-time-ms 0.1) to show what that latency costs.
CYCLE_TIME = {"horovod-mpi-cycle0.1": "0.1", "horovod-tf-cycle0.1": "0.1"}


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def iters_for(nbytes: int, iters: int) -> int:
    return max(3, min(iters, int(iters * (1 << 20) / max(nbytes, 1)) or 3))


def worker(impl: str, byte_sizes: list[int], iters: int, warmup: int, json_out: str) -> None:
    """Time one implementation for every size; rank 0 writes ``{size: seconds}`` to json_out."""
    if impl.startswith("horovod-tf"):
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def make(n):
            return tf.ones([n // 4], dtype=tf.float32)

        def op(t, i):
            return hvd.allreduce(t, op=hvd.Sum, name=f"bench.{t.shape[0]}")

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
            hvd.allreduce_(t, op=hvd.Sum, name=f"bench.{t.numel()}")

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
    result = {}
    for nbytes in byte_sizes:
        t = make(nbytes)
        for i in range(warmup):
            op(t, i)
        times = []
        for i in range(iters_for(nbytes, iters)):
            barrier()
            start = time.perf_counter()
            op(t, i)
            times.append(time.perf_counter() - start)
        result[nbytes] = float(np.median(times))
    if rank == 0:
        with open(json_out, "w") as f:
            json.dump({"impl": impl, "size": size, "seconds": result}, f)
    if impl == "torch-gloo":
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()  # else Gloo's threads may abort the interpreter at exit


def launch_argv(impl: str, np_: int, args) -> list[str]:
    import common
    me = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--min-bytes",
          str(args.min_bytes), "--max-bytes", str(args.max_bytes), "--iters", str(args.iters),
          "--warmup", str(args.warmup)]
    if impl.startswith(("horovod-mpi", "horovod-tf")):
        return common.horovodrun(np_, me)
    if impl == "horovod-gloo":
        return common.horovodrun(np_, me, extra=("--gloo",))
    if impl == "torch-gloo":
        return [str(common.BIN / "torchrun"), "--standalone", f"--nproc_per_node={np_}", *me[1:]]
    return ["mpirun", "--allow-run-as-root", "-np", str(np_), "-bind-to", "none", *me]


def fit_alpha_beta(byte_sizes, seconds, n: int) -> tuple[float, float]:
    """Least-squares fit of T = 2(N-1) alpha + 2(N-1)/N x S / B; returns (alpha s, B bytes/s)."""
    slope, intercept = np.polyfit(np.array(byte_sizes, float), np.array(seconds, float), 1)
    alpha = max(intercept, 0.0) / (2 * (n - 1))
    bandwidth = 2 * (n - 1) / n / slope if slope > 0 else float("inf")
    return float(alpha), float(bandwidth)


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
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--readme", action="store_true")
    p.add_argument("--json-out", help="worker: rank 0 writes its timings here")
    args = p.parse_args(argv)
    byte_sizes = sizes(args.min_bytes, args.max_bytes)
    if args.worker:
        worker(args.worker, byte_sizes, args.iters, args.warmup, args.json_out)
        return {}
    import common
    env = common.base_env(True)
    env["PYTHONPATH"] = f"{common.HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    n = args.np
    results = {}
    impls = IMPLS + EXTRA_IMPLS if args.impls == "all" else args.impls.split(",")
    for impl in impls:
        impl_env = dict(env)
        if impl in CYCLE_TIME:
            impl_env["HOROVOD_CYCLE_TIME"] = CYCLE_TIME[impl]
        out = common.run_json(launch_argv(impl, n, args), impl_env)
        results[impl] = {int(k): v for k, v in out["seconds"].items()}
    factor = 2 * (n - 1) / n
    headers = ["size"] + [f"{i} busbw GB/s" for i in results]
    rows = []
    for s in byte_sizes:
        label = f"{s // 1024} KiB" if s < (1 << 20) else f"{s >> 20} MiB"
        rows.append([label] + [factor * s / results[i][s] / 1e9 for i in results])
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
                                  [[i, a * 1e6, b / 1e9] for i, (a, b) in fits.items()])
    if ratio_rows:
        text += "\n\n" + common.table(["size"] + [f"busbw {v} / raw MPI_Allreduce"
                                                for v in variants], ratio_rows)
    print(text)
    payload = {"args": vars(args), "np": n,
               "seconds": {i: {str(k): v for k, v in r.items()} for i, r in results.items()},
               "busbw_bytes_per_s": {i: {str(s): factor * s / r[s] for s in byte_sizes}
                                     for i, r in results.items()},
               "alpha_beta": {i: {"alpha_s": a, "bandwidth_bytes_per_s": b}
                              for i, (a, b) in fits.items()}}
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
