"""Is distributing faster than not distributing? hvdtrain at np=2 against what a user would run
instead on the same machine: one process on all cores doing the same work (same model, synthetic
data, global batch), and PyTorch DDP (Gloo, torchrun) where it applies; plus hvdtrain at np=1
against that plain loop (the adapter's own cost); and "np=2 apart": np copies of that loop on
their share of the cores and of the batch, timed side by side with no all-reduce, the most any
data-parallel run can reach on this machine ("apart / one" is what splitting the machine costs,
"np2 / apart" what distributing costs beyond that: the all-reduce, the ranks' waiting for each
other every step, the adapter).

Each variant is a real launch of ``benchmarks/synthetic.py`` the way a user starts it (plain
``horovodrun -np 2``, no tuning flags, Open MPI's yield setting unset: whatever hvdtrain's
``init()`` chooses is what is measured). Variants run interleaved, ``--repeats`` rounds, their
order turned by one each round (each goes first once in as many rounds as there are); the
table gives the median and the min-max of the total samples/s (a ``gpt`` sample is one sequence
of 64 tokens), and the ratios of medians.

Run::

    .venv/bin/python benchmarks/vs_single.py [--repeats 5] [--readme]
    .venv/bin/python benchmarks/vs_single.py --paths torch --models mnist --repeats 1 --iters 1
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable

import common

from hvdtrain import runtime

# path -> (synthetic.py --framework, KERAS_BACKEND)
PATHS = {"torch": ("torch", None), "keras-tf": ("keras", "tensorflow"),
         "keras-torch": ("keras", "torch")}
MODELS = ("mnist", "cnn", "dense", "gpt")
GLOBAL_BATCH = {"mnist": 64, "cnn": 64, "dense": 64, "gpt": 16}
# Optimizer steps per timed iteration: about 1 s of one process on 2 cores, so that a run's
# number is not the noise of a 0.1 s window (mnist 20 steps took 0.15 s: spreads up to 1.6).
ITER_STEPS = {"mnist": 120, "cnn": 16, "dense": 36, "gpt": 8}
SINGLE, NP1, NP2, DDP = "one process", "hvdtrain np=1", "hvdtrain np=2", "DDP np=2"
APART = "np=2 apart"  # np=2 without the all-reduce


def variants(path: str, model: str, args) -> dict[str, Callable[[], float]]:
    """``{variant: measure}`` of one path and model: ``measure()`` makes one run and returns its
    total samples/s."""
    framework, backend = PATHS[path]
    batch = GLOBAL_BATCH[model]

    def synthetic(mode: str, local_batch: int, *extra: str) -> list[str]:
        return [sys.executable, str(common.HERE / "synthetic.py"), "--framework", framework,
                "--model", model, "--mode", mode, "--batch-size", str(local_batch),
                "--jit-compile", args.jit_compile,
                "--num-warmup-batches", str(args.warmup), "--num-batches-per-iter",
                str(args.batches or ITER_STEPS[model]), "--num-iters", str(args.iters), *extra]

    env = common.base_env(False)  # a user's shell: no OMPI_MCA_mpi_yield_when_idle
    if backend:
        env["KERAS_BACKEND"] = backend

    def one(argv: list[str]) -> Callable[[], float]:
        return lambda: common.run_json(argv, env)["total_img_sec"]

    def apart() -> float:
        # np processes of one process's loop on their share of the cores, each on its share
        # of the batch, timed side by side from a common start: data parallelism without the
        # all-reduce, the most any np=2 run can reach on this machine.
        # Every timed sample over the span from the first start to the last end (one clock
        # for all processes): a process that finishes first leaves the machine to the others,
        # which a sum of the processes' own rates would count as speed.
        with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-barrier-") as where:
            argv = synthetic("single", batch // args.np, "--threads",
                             str(runtime.thread_budget(args.np)),
                             "--start-barrier", f"{where},{args.np}")
            runs = common.run_json_together([argv] * args.np, env)
        span = (max(r["timed_window"][1] for r in runs) - min(r["timed_window"][0] for r in runs))
        return sum(r["samples_timed"] for r in runs) / span

    runs = {SINGLE: one(synthetic("single", batch)),
            NP1: one(synthetic("hvdtrain", batch)),
            NP2: one(common.horovodrun(args.np, synthetic("hvdtrain", batch // args.np))),
            APART: apart}
    if framework == "torch":
        runs[DDP] = one([str(common.BIN / "torchrun"), "--standalone",
                         f"--nproc_per_node={args.np}", *synthetic("ddp", batch // args.np)[1:]])
    return runs


# The ratios summarise() reports: {name: (numerator variant, denominator variant)}.
PAIRS = {"np2 / one process": (NP2, SINGLE), "np1 / one process": (NP1, SINGLE),
         "np2 / DDP": (NP2, DDP), "np2 / apart": (NP2, APART),
         "apart / one process": (APART, SINGLE)}


def summarise(samples: dict[str, list[float]], pairs: dict[str, tuple[str, str]] = PAIRS) -> dict:
    """Median, min, max and max/min of each variant's samples/s, the ratios of medians of
    ``pairs`` (``{name: (a, b)}``, those whose variants both ran) and each round's own ratios."""
    stats = {name: {"median": common.median(v), "min": min(v), "max": max(v),
                    "spread": max(v) / min(v), "runs": v} for name, v in samples.items()}
    med = {name: s["median"] for name, s in stats.items()}
    ratios = {name: med[a] / med[b] for name, (a, b) in pairs.items() if a in med and b in med}
    return {"stats": stats, "ratios": ratios, "round_ratios": round_ratios(stats, pairs)}


def round_ratios(stats: dict, pairs: dict[str, tuple[str, str]]) -> dict[str, list[float]]:
    """Each round's own ratio ``a / b`` for each ``{name: (a, b)}`` of variants in ``stats``
    (their ``runs``, in round order): the two runs were made minutes apart, so a drift of the
    machine's speed over the rounds (which widens every variant's min-max alike) cancels out."""
    return {name: [x / y for x, y in zip(stats[a]["runs"], stats[b]["runs"])]
            for name, (a, b) in pairs.items() if a in stats and b in stats}


def render(results: dict, models: list[str], repeats: int, jit_compile: str) -> str:
    """The README table of :func:`summarise`'s results (``{"path/model": summary}``)."""
    rows = []
    for key, res in results.items():
        s, ratio = res["stats"], res["ratios"]

        def cell(name):
            if name not in s:
                return "-"
            return f"{s[name]['median']:,.0f} ({s[name]['min']:,.0f}-{s[name]['max']:,.0f})"

        def r(name):
            return f"{ratio[name]:.2f}" if name in ratio else "-"

        per_round = round_ratios(s, {"np2 / one": (NP2, SINGLE)}).get("np2 / one")
        rows.append([key, cell(SINGLE), cell(NP2), cell(DDP), r("np2 / one process"),
                     f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "-",
                     r("np2 / DDP"), r("np1 / one process"), r("apart / one process"),
                     r("np2 / apart"),
                     f"{s[NP2]['spread']:.2f}" if NP2 in s else "-",
                     f"{max(v['spread'] for v in s.values()):.2f}"])
    text = common.table(
        ["path/model", "one process, all cores: samples/s median (min-max)", "hvdtrain np=2",
         "DDP np=2", "np2 / one", "np2 / one, each round", "np2 / DDP", "np1 / one",
         "apart / one", "np2 / apart", "np2 max/min", "any variant's max/min"], rows)
    return text + (f"\n\nGlobal batch {', '.join(f'{m} {GLOBAL_BATCH[m]}' for m in models)}; "
                   f"{repeats} interleaved rounds; Keras jit_compile={jit_compile}.")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before timing")
    p.add_argument("--batches", type=int, default=None,
                   help="optimizer steps per timed iteration (default: about 1 s on 2 cores, "
                        "per model: " + ", ".join(f"{m} {n}" for m, n in ITER_STEPS.items()) + ")")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    p.add_argument("--jit-compile", default="false", choices=("auto", "true", "false"),
                   help="Keras: model.compile's jit_compile, in every Keras variant")
    p.add_argument("--variants", default=",".join((SINGLE, NP1, NP2, DDP, APART)),
                   help="which runs, comma-separated (a ratio needs both of its runs)")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--render", metavar="JSON",
                   help="print (with --readme: write) the table of a saved "
                        "results/vs_single.json instead of measuring")
    args = p.parse_args(argv)
    if args.render:
        import json
        saved = json.loads(open(args.render).read())
        text = render(saved["results"], saved["args"]["models"].split(","),
                      saved["args"]["repeats"], saved["args"]["jit_compile"])
        print(text)
        if args.readme:
            common.update_readme("vs_single", text)
        return saved["results"]
    wanted = args.variants.split(",")
    paths, models = args.paths.split(","), args.models.split(",")
    for name, allowed, chosen in (("--paths", PATHS, paths), ("--models", MODELS, models)):
        if bad := [c for c in chosen if c not in allowed]:
            p.error(f"{name}: unknown {', '.join(bad)}; use {', '.join(allowed)}")
    groups = {(path, model): {n: r for n, r in variants(path, model, args).items() if n in wanted}
              for path in paths for model in models}
    samples = {g: {name: [] for name in runs} for g, runs in groups.items()}
    for r in range(args.repeats):  # interleaved: a drift in machine load hits every variant
        for g, runs in groups.items():
            # The order turns by one each round (each variant goes first once in as many
            # rounds as there are variants): no variant always runs first, on a machine just
            # left idle (the next path or model's set-up) by the run before.
            names = list(runs)
            turn = r % len(names) if names else 0
            for name in names[turn:] + names[:turn]:
                samples[g][name].append(runs[name]())
            print(f"round {r + 1}/{args.repeats} {g[0]} {g[1]}: " + ", ".join(
                f"{n} {v[-1]:.0f}" for n, v in samples[g].items()), flush=True)
    results = {f"{path}/{model}": summarise(samples[(path, model)]) for path, model in groups}
    text = render(results, models, args.repeats, args.jit_compile)
    print(text)
    path = common.save("vs_single", {"args": vars(args), "results": results})
    png = common.RESULTS / "vs_single.png"

    def draw(ax):
        names = list(results)
        ax.barh(names, [results[n]["ratios"].get("np2 / one process", 0.0) for n in names])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.axvline(0.95, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(f"hvdtrain np={args.np} / one process on all cores (samples/s, medians)")
        ax.set_title("Distributing vs one process, same global batch")
    common.plot(png, draw)
    print(f"wrote {path} and {png}")
    if args.readme:
        common.update_readme("vs_single", text)
    return results


if __name__ == "__main__":
    main()
