"""The training loop's own cost: ``hvdtrain train --framework torch`` against a plain Horovod loop
(Horovod's examples: DistributedOptimizer, loss / k, step, zero_grad; no metrics, no checks) on
the same model, data, sampler, batch and k, both at np=2 under the same launcher settings.
The model is the tiny digits CNN, so per-step overheads (host synchronisations, extra
collectives) show rather than hide behind compute. Samples/s are training samples of all ranks
per second of the training loop alone (evaluation and checkpoints excluded), the median over
epochs 2.. of each run and then over ``--repeats`` runs, made alternately.

Run::

    .venv/bin/python benchmarks/trainer.py [--repeats 3] [--readme]
    .venv/bin/python benchmarks/trainer.py --trainer-src /path/to/older/checkout  # "before"

The plain loop itself, under a launcher::

    horovodrun -np 2 python benchmarks/trainer.py --worker --json-out plain.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common


def worker(args) -> None:
    """The plain Horovod loop; rank 0 writes ``{"samples_per_sec": [per epoch]}``."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from hvdtrain import datasets, runtime
    from hvdtrain.torch.models import build_model

    hvd.init()
    torch.set_num_threads(runtime.thread_budget(hvd.local_size()))
    torch.manual_seed(args.seed)
    split = datasets.load("synthetic", synthetic_samples=args.samples)
    train = TensorDataset(torch.from_numpy(split.x_train), torch.from_numpy(split.y_train))
    sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = build_model(split.num_classes, split.x_train.shape[-1])
    k = args.k
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 * hvd.size() * k, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=k)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rates = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start, seen = time.perf_counter(), 0
        for i, (x, y) in enumerate(loader):
            (F.cross_entropy(model(x), y) / k).backward()
            seen += len(x)
            if (i + 1) % k == 0 or i + 1 == len(loader):
                optimizer.step()
                optimizer.zero_grad()
        seconds = time.perf_counter() - start
        total = hvd.allreduce(torch.tensor([seen, seconds], dtype=torch.float64), op=hvd.Sum)
        rates.append(float(total[0] / (total[1] / hvd.size())))
    if hvd.rank() == 0:
        Path(args.json_out).write_text(json.dumps({"samples_per_sec": rates}))


def run_trainer(args, env: dict) -> list[float]:
    """``hvdtrain train`` on the same data; epoch samples/s from its metrics.json."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-trainer-") as out:
        command = [str(common.BIN / "hvdtrain"), "train", "--framework", "torch", "--dataset",
                   "synthetic", "--synthetic-samples", str(args.samples), "--epochs",
                   str(args.epochs), "--batch-size", str(args.batch_size), "-k", str(args.k),
                   "--warmup-epochs", "0", "--seed", str(args.seed), "--no-progress",
                   "--output-dir", out]
        proc = subprocess.run(common.horovodrun(args.np, command), env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"hvdtrain train failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        metrics = json.loads((Path(out) / "metrics.json").read_text())
    return [e["samples_per_sec"] for e in metrics["epochs"]]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="run the plain loop (under a launcher)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--samples", type=int, default=4096, help="synthetic samples (80 %% train)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("-k", type=int, default=1)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trainer-src", help="run hvdtrain train from this checkout (PYTHONPATH)")
    p.add_argument("--json-out", help="--worker: rank 0 writes its result here")
    p.add_argument("--readme", action="store_true")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    env = common.base_env(True)  # both under the setting hvdtrain launch applies here
    trainer_env = dict(env)
    if args.trainer_src:
        trainer_env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(args.trainer_src).resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    plain_cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
                 "--samples", str(args.samples), "--batch-size", str(args.batch_size),
                 "-k", str(args.k), "--epochs", str(args.epochs), "--seed", str(args.seed)]
    plain, trainer = [], []
    for _ in range(args.repeats):  # alternate, so drifts in machine load hit both alike
        plain.append(common.median(
            common.run_json(common.horovodrun(args.np, plain_cmd), env)["samples_per_sec"][1:]))
        trainer.append(common.median(run_trainer(args, trainer_env)[1:]))
    result = {"plain_samples_per_sec": common.median(plain),
              "trainer_samples_per_sec": common.median(trainer),
              "plain_runs": plain, "trainer_runs": trainer}
    result["ratio"] = result["trainer_samples_per_sec"] / result["plain_samples_per_sec"]
    text = common.table(["loop", "samples/s (all ranks)", "vs plain Horovod"],
                        [["plain Horovod", result["plain_samples_per_sec"], 1.0],
                         ["hvdtrain train", result["trainer_samples_per_sec"], result["ratio"]]])
    print(text)
    common.save("trainer", {"args": vars(args), **result})
    if args.readme:
        common.update_readme("trainer", text)
    return result


if __name__ == "__main__":
    main()
