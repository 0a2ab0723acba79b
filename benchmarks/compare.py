"""hvdtrain against what users run instead: PyTorch DistributedDataParallel and a hand-written
plain Horovod loop (``--framework torch``), or Horovod's own Keras layer and one Keras process on
all cores (``--framework keras``, Keras 3 on TensorFlow): the same model, synthetic data, local
batch and np=2, measured side by side (medians over interleaved repeats).

* hvdtrain: ``hvdtrain launch`` (its machine-specific MPI settings) + hvdtrain.torch or
  hvdtrain.keras
* plain Horovod, defaults: ``horovodrun`` as is + Horovod's example loop (torch) or
  ``horovod.tensorflow.keras``'s DistributedOptimizer and broadcast callback (Keras; on Keras 3
  with hvdtrain's Horovod build, patch 15)
* plain Horovod, tuned: the same with the settings every hvdtrain rank's ``init()``
  chooses on CPU hosts (:func:`hvdtrain.launch.tuning.rank_settings`: the background thread
  woken by work, a 4 MiB fusion threshold, mpi_yield_when_idle=1), to separate the adapter's
  cost from theirs
* DDP (torch): ``torchrun --standalone --nproc_per_node 2`` + DistributedDataParallel (Gloo)
* one process (Keras): ``model.fit`` on all cores with the global batch's samples per step
  (``np`` x the local batch), no Horovod

Run::

    .venv/bin/python benchmarks/compare.py [--framework keras] [--repeats 5] [--readme]
"""
from __future__ import annotations

import argparse
import sys

import common

from hvdtrain import runtime
from hvdtrain.launch import tuning


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "keras"), default="torch")
    p.add_argument("--model", default="cnn")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--readme", action="store_true")
    args = p.parse_args(argv)

    def synthetic(mode, *extra, batch_size=args.batch_size):
        return [sys.executable, str(common.HERE / "synthetic.py"), "--framework", args.framework,
                "--model", args.model, "--mode", mode, "--batch-size", str(batch_size),
                "--num-warmup-batches", str(args.warmup), "--num-batches-per-iter",
                str(args.batches), "--num-iters", str(args.iters), *extra]

    tuned = common.base_env(False)
    tuning.rank_settings(on_gpu=False, size=args.np, env=tuned)  # writes hvdtrain's CPU rule
    runs = {
        "hvdtrain": (common.hvdtrain_launch(args.np, synthetic("hvdtrain")),
                     common.base_env(False)),
        "plain Horovod (defaults)": (common.horovodrun(args.np, synthetic("plain")),
                                     common.base_env(False)),
        "plain Horovod (tuned launcher)": (common.horovodrun(args.np, synthetic("plain")),
                                           tuned),
    }
    if args.framework == "torch":
        other, short = "DDP (Gloo, torchrun)", "DDP"
        runs[other] = ([str(common.BIN / "torchrun"), "--standalone",
                        f"--nproc_per_node={args.np}", *synthetic("ddp")[1:]],
                       common.base_env(False))
    else:  # one process with every core, on the samples all ranks take per step
        other, short = "one process (all cores)", "one process"
        runs[other] = (synthetic("single", "--threads", str(runtime.available_cores()),
                                 batch_size=args.batch_size * args.np), common.base_env(False))
    samples = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit every variant
        for name, (argv_, env) in runs.items():
            samples[name].append(common.run_json(argv_, env)["total_img_sec"])
    medians = {name: common.median(v) for name, v in samples.items()}
    h = medians["hvdtrain"]
    ratios = {f"hvdtrain / {short}": h / medians[other],
              "hvdtrain / plain Horovod (defaults)": h / medians["plain Horovod (defaults)"],
              "hvdtrain / plain Horovod (tuned launcher)":
                  h / medians["plain Horovod (tuned launcher)"]}
    text = common.table(["run", "total img/s (median)", "runs"],
                        [[n, m, ", ".join(f"{x:.0f}" for x in samples[n])]
                         for n, m in medians.items()])
    text += "\n\n" + common.table(["ratio", "value"], [[k, v] for k, v in ratios.items()])
    print(text)
    name = "compare" if args.framework == "torch" else "compare_keras"
    path = common.save(name, {"args": vars(args), "samples": samples, "medians": medians,
                              "ratios": ratios})
    png = common.RESULTS / f"{name}.png"

    def draw(ax):
        ax.barh(list(medians), list(medians.values()))
        ax.set_xlabel("total img/s (median)")
        ax.set_title(f"{args.model}, batch {args.batch_size}/worker, np={args.np}")
    common.plot(png, draw)
    print(f"wrote {path} and {png}")
    if args.readme:
        common.update_readme(name, text)
    return {"medians": medians, "ratios": ratios}


if __name__ == "__main__":
    main()
