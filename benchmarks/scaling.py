"""Scaling efficiency: synthetic.py at np = 1, 2 (and 4, oversubscribed on a 2-core machine) for
both frameworks, against a plain single-process loop with no Horovod at all.

    efficiency(N) = T(N) / (N x T_single(threads = cores // N))     (T: total img/sec)

All workers share one machine here, so the baseline is a single process with the resources one
worker gets (hvdtrain's thread budget, cores // N): N such processes would be ideal scaling, and
the efficiency measures what Horovod and hvdtrain cost. The speed-up over one process using all
cores is reported beside it.

Run::

    .venv/bin/python benchmarks/scaling.py [--repeats 3] [--nps 1,2,4] [--readme]
"""
from __future__ import annotations

import argparse
import sys

import common


def synthetic(framework: str, mode: str, args, threads: int | None = None) -> list[str]:
    return [sys.executable, str(common.HERE / "synthetic.py"), "--framework",
            "keras" if framework.startswith("keras") else framework,
            "--model", args.model, "--mode", mode, "--batch-size", str(args.batch_size),
            "--num-warmup-batches", str(args.warmup), "--num-batches-per-iter",
            str(args.batches), "--num-iters", str(args.iters),
            *(["--threads", str(threads)] if threads else [])]


# The Keras 3 backend of each --frameworks entry (the launched jobs' KERAS_BACKEND).
KERAS_BACKEND = {"keras": {"KERAS_BACKEND": "tensorflow"}, "keras-torch": {"KERAS_BACKEND": "torch"}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="torch,keras,keras-torch",
                   help="torch, keras (Keras 3, TensorFlow backend), keras-torch (Keras 3, "
                        "PyTorch backend)")
    p.add_argument("--nps", default="1,2,4")
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--readme", action="store_true", help="rewrite benchmarks/README.md's table")
    args = p.parse_args(argv)
    cores = common.machine()["cores"]
    rows, results = [], []
    nps = [int(n) for n in args.nps.split(",")]
    for framework in args.frameworks.split(","):
        env = {**common.base_env(False), **KERAS_BACKEND.get(framework, {})}
        singles = {}
        for threads in sorted({max(1, cores // n) for n in nps} | {cores}):
            singles[threads] = common.median(
                common.run_json(synthetic(framework, "single", args, threads),
                                env)["total_img_sec"]
                for _ in range(args.repeats))
        for np_ in nps:
            total = common.median(
                common.run_json(common.hvdtrain_launch(np_, synthetic(framework, "hvdtrain", args)),
                                env)["total_img_sec"]
                for _ in range(args.repeats))
            threads = max(1, cores // np_)
            efficiency = total / (np_ * singles[threads])
            speedup = total / singles[cores]
            note = "oversubscribed" if np_ > cores else ""
            results.append({"framework": framework, "np": np_, "total_img_sec": total,
                            "single_img_sec": singles[threads], "single_threads": threads,
                            "single_all_cores_img_sec": singles[cores],
                            "efficiency": efficiency, "speedup_vs_all_cores": speedup,
                            "note": note})
            rows.append([framework, np_, f"{singles[threads]:.1f} ({threads} thr)", total,
                         efficiency, speedup, note])
    headers = ["framework", "np", "single process img/s (threads)", "hvdtrain total img/s",
               "efficiency T(N)/(N x T1)", "speed-up vs 1 process on all cores", "note"]
    text = common.table(headers, rows)
    print(text)
    path = common.save("scaling", {"args": vars(args), "results": results})
    png = common.RESULTS / "scaling.png"

    def draw(ax):
        for framework in args.frameworks.split(","):
            pts = [r for r in results if r["framework"] == framework]
            ax.plot([r["np"] for r in pts], [r["efficiency"] for r in pts], "o-", label=framework)
        ax.axhline(0.9, ls="--", c="grey", label="target 0.90")
        ax.set_xlabel("processes (np)")
        ax.set_ylabel("scaling efficiency")
        ax.set_title(f"{args.model}, batch {args.batch_size}/worker, {cores} cores")
        ax.legend()
    common.plot(png, draw)
    print(f"wrote {path} and {png}")
    if args.readme:
        common.update_readme("scaling", text)
    return {"results": results}


if __name__ == "__main__":
    main()
