"""Horovod over Gloo against Horovod over MPI, and what this build's Gloo patch is worth.

Ranks that Spark (HorovodRunner), Ray, ``--elastic`` or ``horovodrun --gloo`` start carry
Horovod's collectives over Gloo's TCP transport; ``horovodrun``, ``mpirun`` and ``srun`` use MPI.
Three variants of one 2-rank job (``benchmarks/synthetic.py``, hvdtrain mode, global batch as in
``vs_single.py``; PyTorch and Keras 3 on TensorFlow by default, ``--paths`` also Keras 3 on
PyTorch), each a real launch with plain ``horovodrun -np 2`` the way a user starts it, run
interleaved for ``--repeats`` rounds with their order turned by one each round:

* ``MPI``: ``horovodrun -np 2``
* ``Gloo``: ``horovodrun --gloo -np 2`` (this build: Gloo's event loop yields its core while a
  pair is locked, Horovod patch 13, ``scripts/horovod_patches/13-gloo-loop-yields.patch``)
* ``Gloo spin``: the same with ``HOROVOD_GLOO_LOOP_YIELD=0``, upstream's loop that spins on
  ``epoll_wait`` until the pair is free (left out, with a note, on a Horovod without patch 13)

Each run's JSON says which controller carried it (``controller``: gloo or mpi), checked against
the variant. The table gives the median and min-max of the total samples/s and the ratios of
medians (``Gloo / Gloo spin``: the patch; ``Gloo / MPI``: what Gloo still costs), with each
round's own ratio (its two runs made minutes apart at most).

Run::

    .venv/bin/python benchmarks/gloo.py [--repeats 5] [--paths torch,keras-tf,keras-torch]
        [--models mnist,cnn,dense] [--readme]
"""
from __future__ import annotations

import argparse
import sys

import common
import vs_single

MPI, GLOO, SPIN = "MPI", "Gloo", "Gloo spin"
VARIANTS = (MPI, GLOO, SPIN)
MODELS = ("mnist", "cnn", "dense", "gpt")
PAIRS = {"Gloo / Gloo spin": (GLOO, SPIN), "Gloo / MPI": (GLOO, MPI),
         "Gloo spin / MPI": (SPIN, MPI)}


def gloo_loop_yields() -> bool:
    """Whether the installed Horovod has hvdtrain's patch 13 (``horovod.common.basics``
    ``GLOO_LOOP_YIELD``): only then does ``HOROVOD_GLOO_LOOP_YIELD=0`` bring upstream's loop
    back, so only then is ``Gloo spin`` a different variant."""
    import horovod.common.basics as basics
    return bool(getattr(basics, "GLOO_LOOP_YIELD", 0))


def variants(path: str, model: str, args, wanted: list[str]) -> dict:
    """``{variant: measure}`` for one path (``vs_single.PATHS``) and model: ``measure()`` makes
    one run and returns its total samples/s.

    Raises (from ``measure()``):
        RuntimeError: the job failed, or its ranks ran over another controller than the
            variant names (``--gloo`` not honoured, say).
    """
    batch = vs_single.GLOBAL_BATCH[model]
    framework, backend = vs_single.PATHS[path]
    command = [sys.executable, str(common.HERE / "synthetic.py"), "--framework", framework,
               "--model", model, "--mode", "hvdtrain", "--batch-size", str(batch // args.np),
               "--num-warmup-batches", str(args.warmup), "--num-batches-per-iter",
               str(args.batches or vs_single.ITER_STEPS[model]), "--num-iters", str(args.iters)]
    env = common.base_env(False)  # a user's shell: no HOROVOD_* and no Open MPI yield setting
    if backend:
        env["KERAS_BACKEND"] = backend

    def one(extra: tuple[str, ...], controller: str, **more: str):
        def measure() -> float:
            out = common.run_json(common.horovodrun(args.np, command, extra), {**env, **more})
            if out.get("controller") != controller:
                raise RuntimeError(f"{path}/{model}: expected the job over {controller}, its "
                                   f"ranks report {out.get('controller')!r}")
            return out["total_img_sec"]
        return measure

    runs = {MPI: one((), "mpi"), GLOO: one(("--gloo",), "gloo"),
            SPIN: one(("--gloo",), "gloo", HOROVOD_GLOO_LOOP_YIELD="0")}
    return {name: run for name, run in runs.items() if name in wanted}


def render(results: dict, repeats: int, np_: int, note: str = "") -> str:
    """The README table of the results (``{"path/model": vs_single.summarise(..., PAIRS)}``)."""
    rows = []
    for key, res in results.items():
        s, ratio, rounds = res["stats"], res["ratios"], res["round_ratios"]

        def cell(name):
            if name not in s:
                return "-"
            return f"{s[name]['median']:,.0f} ({s[name]['min']:,.0f}-{s[name]['max']:,.0f})"

        def r(name):
            if name not in ratio:
                return "-"
            each = rounds[name]
            return f"{ratio[name]:.2f} ({min(each):.2f}-{max(each):.2f})"

        rows.append([key, cell(MPI), cell(GLOO), cell(SPIN),
                     r("Gloo / Gloo spin"), r("Gloo / MPI"), r("Gloo spin / MPI")])
    text = common.table(
        ["path/model", "MPI: samples/s median (min-max)", "Gloo (this build)",
         "Gloo spin (HOROVOD_GLOO_LOOP_YIELD=0)", "Gloo / Gloo spin (each round)",
         "Gloo / MPI (each round)", "Gloo spin / MPI (each round)"], rows)
    models = dict.fromkeys(key.split("/")[-1] for key in results)
    batches = ", ".join(f"{m} {vs_single.GLOBAL_BATCH[m]}" for m in models)
    return text + (f"\n\n{np_} ranks on one host, plain horovodrun; global batch {batches}; "
                   f"{repeats} interleaved rounds.") + (f" {note}" if note else "")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="torch,keras-tf", help=f"of {', '.join(vs_single.PATHS)}")
    p.add_argument("--models", default="mnist,cnn,dense", help=f"of {', '.join(MODELS)}")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before timing")
    p.add_argument("--batches", type=int, default=None,
                   help="optimizer steps per timed iteration (default: vs_single.py's, about 1 s"
                        " on 2 cores)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="which runs, comma-separated (a ratio needs both of its runs)")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--render", metavar="JSON",
                   help="print (with --readme: write) the table of a saved results/gloo.json "
                        "instead of measuring")
    args = p.parse_args(argv)
    if args.render:
        import json
        saved = json.loads(open(args.render).read())
        text = render(saved["results"], saved["args"]["repeats"], saved["args"]["np"],
                      saved["note"])
        print(text)
        if args.readme:
            common.update_readme("gloo", text)
        return saved["results"]
    paths, models = args.paths.split(","), args.models.split(",")
    wanted = args.variants.split(",")
    for name, allowed, chosen in (("--paths", vs_single.PATHS, paths),
                                  ("--models", MODELS, models), ("--variants", VARIANTS, wanted)):
        if bad := [c for c in chosen if c not in allowed]:
            p.error(f"{name}: unknown {', '.join(bad)}; use {', '.join(allowed)}")
    note = ""
    if SPIN in wanted and not gloo_loop_yields():
        wanted.remove(SPIN)
        note = ("This Horovod has no hvdtrain patch 13 (its Gloo loop spins as upstream's): "
                "'Gloo spin' left out.")
        print(note, flush=True)
    if not wanted:
        p.error(f"--variants {args.variants}: nothing left to run ({note})")
    groups = {f"{path}/{model}": variants(path, model, args, wanted)
              for path in paths for model in models}
    samples = {key: {name: [] for name in runs} for key, runs in groups.items()}
    for r in range(args.repeats):  # interleaved; the order turns by one each round
        for key, runs in groups.items():
            names = list(runs)
            turn = r % len(names)
            for name in names[turn:] + names[:turn]:
                samples[key][name].append(runs[name]())
            print(f"round {r + 1}/{args.repeats} {key}: " + ", ".join(
                f"{n} {v[-1]:.0f}" for n, v in samples[key].items()), flush=True)
    results = {key: vs_single.summarise(samples[key], PAIRS) for key in groups}
    text = render(results, args.repeats, args.np, note)
    print(text)
    path = common.save("gloo", {"args": vars(args), "results": results, "note": note})
    png = common.RESULTS / "gloo.png"

    def draw(ax):
        names = list(results)
        pairs = [pair for pair in PAIRS if any(pair in results[n]["ratios"] for n in names)]
        height = 0.8 / max(1, len(pairs))
        for i, pair in enumerate(pairs):
            at = [(j + i * height, results[n]["ratios"][pair]) for j, n in enumerate(names)
                  if pair in results[n]["ratios"]]
            ax.barh([a for a, _ in at], [v for _, v in at], height=height, label=pair)
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel(f"ratio of total samples/s, np={args.np} (medians)")
        ax.set_title("Horovod over Gloo: this build's loop, upstream's spin, MPI")
        ax.legend()
    common.plot(png, draw)
    print(f"wrote {path} and {png}")
    if args.readme:
        common.update_readme("gloo", text)
    return results


if __name__ == "__main__":
    main()
