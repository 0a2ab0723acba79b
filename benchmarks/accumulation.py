"""The gain from gradient accumulation on a communication-heavy model: synthetic.py with the
``dense`` model (10.5 M parameters, 42 MB of gradients per step) at np=2 for
backward_passes_per_step k = 1, 2, 4, 8. All-reduces are counted in Horovod's timeline; samples/s
are training samples processed by all ranks per second.

Run::

    .venv/bin/python benchmarks/accumulation.py [--ks 1,2,4,8] [--repeats 3] [--readme]
"""
from __future__ import annotations

import argparse
import sys

import common


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", default="torch", choices=("torch", "keras"))
    p.add_argument("--model", default="dense")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=4, help="optimizer steps per timed iteration")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--readme", action="store_true")
    args = p.parse_args(argv)
    rows, results = [], []
    for k in (int(x) for x in args.ks.split(",")):
        command = [sys.executable, str(common.HERE / "synthetic.py"), "--framework",
                   args.framework, "--model", args.model, "-k", str(k), "--batch-size",
                   str(args.batch_size), "--num-warmup-batches", str(args.warmup),
                   "--num-batches-per-iter", str(args.batches), "--num-iters", str(args.iters),
                   "--timeline-allreduces"]
        runs = [common.run_json(common.hvdtrain_launch(args.np, command), common.base_env(False))
                for _ in range(args.repeats)]
        results.append({"k": k, "total_img_sec": common.median(r["total_img_sec"] for r in runs),
                        "allreduces_per_sample": runs[0]["allreduces_per_sample"],
                        "allreduces": runs[0]["allreduces"]})
    base = results[0]
    for r in results:
        r["speedup"] = r["total_img_sec"] / base["total_img_sec"]
        r["allreduce_ratio"] = r["allreduces_per_sample"] / base["allreduces_per_sample"]
        rows.append([r["k"], r["allreduces_per_sample"], r["allreduce_ratio"],
                     r["total_img_sec"], r["speedup"]])
    text = common.table(["k", "all-reduces per sample", "vs k=1", "samples/s (all ranks)",
                         "speed-up vs k=1"], rows)
    print(text)
    path = common.save("accumulation", {"args": vars(args), "results": results})
    png = common.RESULTS / "accumulation.png"

    def draw(ax):
        ax.plot([r["k"] for r in results], [r["speedup"] for r in results], "o-",
                label="samples/s vs k=1")
        ax.plot([r["k"] for r in results], [1 / r["allreduce_ratio"] for r in results], "s--",
                label="1 / all-reduces per sample (ideal)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("backward_passes_per_step k")
        ax.set_ylabel("x k=1")
        ax.set_title(f"{args.model} model, np={args.np}, {args.framework}")
        ax.legend()
    common.plot(png, draw)
    print(f"wrote {path} and {png}")
    if args.readme:
        common.update_readme("accumulation", text)
    return {"results": results}


if __name__ == "__main__":
    main()
