"""Does every job run at the same speed? N consecutive 2-rank jobs of one shape, each one's
samples/s, so that a second mode (some jobs at one speed, the rest at another, chosen at start-up)
shows up as such rather than as a wide min-max around a median.

The shape of issue 49: the MNIST CNN (``synthetic.py --model mnist``), global batch 64 (32 per
rank), SGD with momentum, Keras with ``jit_compile=False``, under plain ``horovodrun -np 2``
(whatever hvdtrain's ``init()`` chooses), for each path (Keras on TensorFlow, Keras on PyTorch,
PyTorch). Each round runs one hvdtrain np=2 job and one process on all cores doing the same work
(the same global batch), interleaved, so the ratio to one process is measured side by side.

For each path it prints every job's samples/s (sorted), the median, min and max, the share of
jobs within 15 % of the fastest, the largest gap between two consecutive sorted jobs (a gap of
more than 15 % splits the jobs into two modes), and the median np=2 over the median one process.

Run::

    .venv/bin/python benchmarks/modes.py [--jobs 10] [--paths keras-tf,keras-torch,torch] [--readme]
"""
from __future__ import annotations

import argparse

import common
import vs_single

MODEL = "mnist"
WITHIN = 0.15  # a job more than this below the fastest is slow; a larger gap splits modes


def distribution(values: list[float]) -> dict:
    """Where the jobs' samples/s lie: sorted values, median, min, max, the share within
    :data:`WITHIN` of the fastest, and the largest relative gap between consecutive sorted jobs
    (``gap`` = upper / lower - 1) with the jobs below and above it."""
    s = sorted(values)
    fastest = s[-1]
    gaps = [(s[i + 1] / s[i] - 1, i) for i in range(len(s) - 1)]
    gap, at = max(gaps) if gaps else (0.0, -1)
    return {"sorted": s, "median": common.median(s), "min": s[0], "max": fastest,
            "within_15pct_of_fastest": sum(v >= (1 - WITHIN) * fastest for v in s) / len(s),
            "largest_gap": gap, "below_gap": at + 1, "above_gap": len(s) - at - 1,
            "two_modes": gap > WITHIN}


def render(results: dict, jobs: int) -> str:
    """The table of :func:`main`'s results (``{path: {"np2": dist, "single": dist, ...}}``)."""
    rows = []
    for path, r in results.items():
        d = r["np2"]
        modes = (f"yes: {d['below_gap']} jobs <= {d['sorted'][d['below_gap'] - 1]:,.0f}, "
                 f"{d['above_gap']} >= {d['sorted'][d['below_gap']]:,.0f}"
                 if d["two_modes"] else "no")
        rows.append([path, f"{d['median']:,.0f} ({d['min']:,.0f}-{d['max']:,.0f})",
                     " ".join(f"{v:,.0f}" for v in d["sorted"]),
                     f"{d['within_15pct_of_fastest']:.0%}", f"{d['largest_gap']:.0%}", modes,
                     f"{r['single']['median']:,.0f}", f"{r['np2_over_single']:.2f}"])
    return common.table(
        ["path", "np=2 samples/s median (min-max)", "each job, sorted",
         "jobs within 15 % of the fastest", "largest gap", "two modes?",
         "one process (median)", "np2 / one"], rows) + (
        f"\n\n{MODEL} model, global batch {vs_single.GLOBAL_BATCH[MODEL]}, {jobs} consecutive "
        "np=2 jobs per path, each round beside one one-process run.")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default=",".join(vs_single.PATHS),
                   help=f"of {', '.join(vs_single.PATHS)}")
    p.add_argument("--jobs", type=int, default=10, help="np=2 jobs per path (and one-process runs)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before timing")
    p.add_argument("--batches", type=int, default=None,
                   help=f"steps per timed iteration (default {vs_single.ITER_STEPS[MODEL]})")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per job")
    p.add_argument("--jit-compile", default="false", choices=("auto", "true", "false"))
    p.add_argument("--readme", action="store_true")
    args = p.parse_args(argv)
    paths = args.paths.split(",")
    if bad := [x for x in paths if x not in vs_single.PATHS]:
        p.error(f"--paths: unknown {', '.join(bad)}; use {', '.join(vs_single.PATHS)}")
    if args.jobs < 2:
        p.error("--jobs must be at least 2: one job has no distribution")
    results = {}
    for path in paths:
        runs = vs_single.variants(path, MODEL, args)
        np2, single = [], []
        for j in range(args.jobs):  # one process first every other round
            order = [(vs_single.NP2, np2), (vs_single.SINGLE, single)]
            for name, into in (order if j % 2 else order[::-1]):
                into.append(runs[name]())
            print(f"{path} job {j + 1}/{args.jobs}: np=2 {np2[-1]:,.0f}, one process "
                  f"{single[-1]:,.0f} samples/s", flush=True)
        results[path] = {"np2": distribution(np2), "single": distribution(single),
                         "np2_over_single": common.median(np2) / common.median(single)}
    text = render(results, args.jobs)
    print(text)
    common.save("modes", {"args": vars(args), "results": results})

    def draw(ax):
        for i, (path, r) in enumerate(results.items()):
            ax.scatter(r["np2"]["sorted"], [i] * len(r["np2"]["sorted"]), marker="|", s=300)
            ax.scatter([r["single"]["median"]], [i], marker="x", color="black")
        ax.set_yticks(range(len(results)), list(results))
        ax.set_xlabel("samples/s of each np=2 job (|) and the one-process median (x)")
        ax.set_title("Every job's speed: one mode or two?")
    common.plot(common.RESULTS / "modes.png", draw)
    if args.readme:
        common.update_readme("modes", text)
    return results


if __name__ == "__main__":
    main()
