"""How far the learning-rate scaling rules hold: ``hvdtrain train --framework torch`` on MNIST at
global batches 32, 256, 1,024 and 4,096 with ``--lr-scaling linear`` and ``sqrt`` (local batch 32,
base lr 0.01 tuned for one process at batch 32, momentum 0.9, one warmup epoch, 3 epochs), each
run's final test accuracy against Goyal et al. 2017's limit for the linear rule (a global batch of
8,192 of ImageNet's 1,281,167 training images, 0.64 % of the training set per step).

Global batch 32 is one rank with k=1 (scale factor 1: linear and sqrt are the same run, trained
once and reported for both rules); larger ones are 2 ranks x k = global / 64, launched with
``horovodrun -np N -H localhost:N``. Every number comes from the ``metrics.json`` the run writes.

Run::

    .venv/bin/python benchmarks/scaling_rule.py [--global-batches 32,256,1024,4096]
        [--rules linear,sqrt] [--epochs 3] [--dataset mnist] [--json-out PATH] [--readme]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import common
from hvdtrain.files import write_json

# Goyal et al. 2017 (table 2, figure 1): ResNet-50's error matched the small-batch run up to a
# global batch of 8,192 of ImageNet-1k's 1,281,167 training images.
GOYAL_FRACTION = 8192 / 1281167


def layout(global_batch: int, local_batch: int) -> tuple[int, int]:
    """Ranks and k for a global batch: one rank at the local batch, else two ranks.

    Args:
        global_batch: samples per optimizer step over all ranks.
        local_batch: samples per micro-batch on each rank.

    Returns:
        ``(size, k)`` with ``size x local_batch x k == global_batch``.

    Raises:
        ValueError: the global batch is not ``local_batch`` or a multiple of ``2 x local_batch``.
    """
    if global_batch == local_batch:
        return 1, 1
    if global_batch % (2 * local_batch):
        raise ValueError(f"global batch {global_batch} is neither {local_batch} nor a multiple of "
                         f"2 x {local_batch}: pick it from {local_batch}, {2 * local_batch}, ...")
    return 2, global_batch // (2 * local_batch)


def train(size: int, k: int, rule: str, args) -> dict:
    """One ``hvdtrain train`` run under horovodrun; returns its ``metrics.json`` and wall time.

    Raises:
        RuntimeError: the run failed or wrote no metrics; the message holds its output tail.
    """
    with tempfile.TemporaryDirectory(prefix="hvdtrain-scaling-rule-") as out:
        command = [str(common.BIN / "hvdtrain"), "train", "--framework", "torch", "--dataset",
                   args.dataset, "--batch-size", str(args.batch_size), "-k", str(k), "--lr",
                   str(args.lr), "--momentum", str(args.momentum), "--lr-scaling", rule,
                   "--lr-schedule", "constant",
                   "--warmup-epochs", str(args.warmup_epochs), "--epochs", str(args.epochs),
                   "--no-divergence-check", "--no-progress", "--no-tensorboard",
                   "--output-dir", out]
        t0 = time.perf_counter()
        proc = subprocess.run(common.horovodrun(size, command), env=common.base_env(True),
                              capture_output=True, text=True, timeout=3600)
        seconds = time.perf_counter() - t0
        path = Path(out) / "metrics.json"
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"np={size} k={k} {rule} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return {"metrics": json.loads(path.read_text()), "seconds": seconds}


def would_stop(epochs: list[dict], warmup_epochs: float,
               num_classes: int = 10) -> tuple[int, str] | None:
    """hvdtrain's divergence check replayed after every epoch, as the trainer runs it.

    Args:
        epochs: ``metrics.json``'s ``epochs`` (dicts of :class:`hvdtrain.run.report.EpochMetrics`).
        warmup_epochs: the run's warmup in epochs.
        num_classes: classes in the dataset (chance accuracy is their inverse).

    Returns:
        ``(epoch, message)`` of the first epoch :func:`hvdtrain.guard.divergence` flags, or None.
    """
    from hvdtrain.guard import divergence
    from hvdtrain.run.report import EpochMetrics
    history = [EpochMetrics(**e) for e in epochs]
    for i in range(1, len(history) + 1):
        why = divergence(history[:i], warmup_epochs, num_classes)
        if why:
            return history[i - 1].epoch, why
    return None


def draw_plot(results: list[dict], rules: list[str], png: Path, title: str) -> None:
    """Test accuracy against global batch (log2 x), one line per rule, Goyal et al.'s limit."""
    def draw(ax):
        for rule in rules:
            rows = [r for r in results if r["rule"] == rule]
            ax.plot([r["global_batch"] for r in rows], [r["final_test_accuracy"] for r in rows],
                    "o-" if rule == "linear" else "s--", label=f"{rule} scaling")
        limit = GOYAL_FRACTION * results[0]["train_samples"]
        ax.axvline(limit, color="grey", linestyle=":",
                   label=f"Goyal et al. 2017 limit, {GOYAL_FRACTION:.2%} ({limit:.0f} samples)")
        ax.set_xscale("log", base=2)
        batches = sorted({r["global_batch"] for r in results})
        ax.set_xticks(batches, [f"{b:,}" for b in batches])
        ax.set_xlabel("global batch (samples per optimizer step)")
        ax.set_ylabel("final test accuracy")
        ax.set_title(title)
        ax.legend()
    common.plot(png, draw)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batches", default="32,256,1024,4096")
    p.add_argument("--rules", default="linear,sqrt")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset", default="mnist", help="mnist, or digits for a quick check")
    p.add_argument("--batch-size", type=int, default=32, help="local batch")
    p.add_argument("--lr", type=float, default=0.01, help="the rate tuned for one process")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--json-out", type=Path, default=common.RESULTS / "scaling_rule.json",
                   help="the PNG goes beside it")
    p.add_argument("--readme", action="store_true", help="rewrite benchmarks/README.md's table")
    args = p.parse_args(argv)
    rules = args.rules.split(",")
    start = time.perf_counter()
    runs, results, rows = {}, [], []
    for gb in (int(x) for x in args.global_batches.split(",")):
        for rule in rules:
            size, k = layout(gb, args.batch_size)
            key = (size, k, "same" if size * k == 1 else rule)  # factor 1: one run for all rules
            if key not in runs:
                print(f"training global batch {gb} = {size} rank(s) x {args.batch_size} x k={k}, "
                      f"{rule} ...", flush=True)
                runs[key] = train(size, k, rule, args)
            m, seconds = runs[key]["metrics"], runs[key]["seconds"]
            stop = would_stop(m["epochs"], args.warmup_epochs)
            r = {"global_batch": m["global_batch"], "size": m["size"], "k": k, "rule": rule,
                 "train_samples": m["train_samples"],
                 "fraction": m["global_batch"] / m["train_samples"], "scaled_lr": m["scaled_lr"],
                 "final_test_accuracy": m["final_test_accuracy"],
                 "large_batch_warning": m["large_batch_warning"],
                 "would_stop": stop and {"epoch": stop[0], "message": stop[1]},
                 "shared_run": size * k == 1, "seconds": seconds, "epochs": m["epochs"]}
            results.append(r)
            rows.append([r["global_batch"], f"{m['size']} x {k}", f"{r['fraction']:.2%}", rule,
                         f"{r['scaled_lr']:.4g}", f"{r['final_test_accuracy']:.4f}",
                         "yes" if r["large_batch_warning"] else "no",
                         f"yes, after epoch {stop[0]}" if stop else "no"])
    text = common.table(["global batch", "ranks x k", "training set per step", "rule",
                         "scaled lr", "final test accuracy", "hvdtrain warned",
                         "divergence check would stop it"], rows)
    total = time.perf_counter() - start
    print(text)
    print(f"{len(runs)} trainings in {total:.0f} s")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": common.machine(), "args": {**vars(args), "json_out": str(args.json_out)},
               "trainings": len(runs), "total_seconds": total,
               "goyal_fraction": GOYAL_FRACTION, "results": results}
    write_json(args.json_out, payload)
    png = args.json_out.with_suffix(".png")
    draw_plot(results, rules, png, f"{args.dataset}, local batch {args.batch_size}, base lr "
                                   f"{args.lr:g}, {args.epochs} epoch(s)")
    print(f"wrote {args.json_out} and {png}")
    if args.readme:
        common.update_readme("scaling_rule", text)
    return payload


if __name__ == "__main__":
    main()
