"""Does ``hvdtrain plan`` predict what was measured? Its cost model (hvdtrain.scaling) against
(1) this machine: the benchmarks' PyTorch models at np=1 and np=2 against the committed medians
of ``benchmarks/results/vs_single.json`` ("hvdtrain np=1" / "hvdtrain np=2", total samples/s at
the same global batch), compute measured here now, side by side for np=2; (2) the all-reduce
model: the committed ``benchmarks/results/allreduce.json`` curve that ``hvdtrain plan`` uses
against the same series measured again (``--fresh-allreduce``), and the ring formula's fit
against each; (3) published cluster results, held apart
from the inputs (each prediction uses only the published single-GPU throughput, the model's
parameter count and the published network, and is printed before the published figure).

Writes ``benchmarks/results/plan_check.json`` and ``.png`` (predicted vs measured/published
scaling efficiency against N).

Run::

    flock /tmp/hvdtrain-cpu.lock .venv/bin/python benchmarks/plan_check.py
    flock /tmp/hvdtrain-cpu.lock .venv/bin/python benchmarks/plan_check.py --paths torch
    flock /tmp/hvdtrain-cpu.lock .venv/bin/python benchmarks/plan_check.py --live 3 \
        --fresh-allreduce                                      # what the committed file holds
    .venv/bin/python benchmarks/plan_check.py --skip-here     # published + all-reduce only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hvdtrain.scaling import clusters, measure  # noqa: E402
from hvdtrain.scaling.model import MiB, HorovodSettings, predict_step  # noqa: E402

sys.path.insert(0, str(HERE))
from plan_published import (BERT_FIT_AT, DLE_BERT, DLE_RESNET50, K80, P100, PARAMS,  # noqa: E402
                            PUBLISHED_SOURCES, check_published)
import vs_single  # noqa: E402

RESULTS = HERE / "results"
GLOBAL_BATCH = vs_single.GLOBAL_BATCH  # the same global batches as the runs compared with
# hvdtrain's CPU rank settings (hvdtrain.launch.tuning): 4 MiB fusion, thread woken on enqueue.
CPU_SETTINGS = HorovodSettings(fusion_threshold=4 * MiB, cycle_time_s=1e-3, cycle_wake=True)


def check_allreduce(path: Path | None = None, now: Path | None = None) -> list[dict]:
    """The all-reduce model for a lone tensor at the file's ``np`` ranks (:func:`schedule`),
    two ways:

    - ``"curve"``: what ``hvdtrain plan`` uses for this host, the measured times of ``path``
      (default: the committed ``results/allreduce.json``) interpolated
      (:func:`clusters.this_host`), against the same series measured again ``now``
      (:func:`fresh_allreduce`'s file, with its jobs' spread): held out in time. Only with
      ``now``.
    - ``"ring fit"``: the ring formula alone, alpha and B fitted to each file's own times of
      the binding's series (in sample), with the series' settings
      (:data:`clusters.SERIES_SETTINGS`); PyTorch's other Horovod series (a 1 ms cycle, and the
      thread woken on enqueue) are predicted from that fit with their own wait for a cycle, so
      that term is checked out of sample. How far one bus bandwidth is from a CPU host's
      curve.

    Returns:
        rows ``{"kind", "file", "now", "impl", "bytes", "predicted_s", "measured_s", "ratio"}``
        (seconds; ``now``: measured by this check), with ``"spread_s"`` (the jobs' lowest and
        highest medians) and ``"within_spread"`` where the file has a spread.

    Raises:
        FileNotFoundError: no committed all-reduce results (run benchmarks/allreduce.py).
    """
    from dataclasses import replace

    from hvdtrain.scaling.model import schedule
    path = path or clusters.find_allreduce_json()
    if path is None:
        raise FileNotFoundError("no benchmarks/results/allreduce.json: run "
                                "benchmarks/allreduce.py")

    def lone(cluster, impl: str, size: int) -> float:
        # The curve's times hold the series' wait for a cycle; the fitted formula adds it.
        settings = CPU_SETTINGS if cluster.intra_table else clusters.SERIES_SETTINGS[impl]
        return schedule([(1e-9, size)], cluster.table_ranks, cluster, settings)[-1].end_s

    def row(kind, file, impl, size, predicted, data):
        measured = data["seconds"][impl][str(size)]
        r = {"kind": kind, "file": file.name, "now": file == now, "impl": impl, "bytes": size,
             "predicted_s": predicted, "measured_s": measured, "ratio": predicted / measured}
        if str(size) in data.get("spread", {}).get(impl, {}):
            r["spread_s"] = data["spread"][impl][str(size)]
            r["within_spread"] = r["spread_s"][0] <= predicted <= r["spread_s"][1]
        return r

    rows = []
    files = {f: json.loads(f.read_text()) for f in ((path, now) if now else (path,))}
    if now:
        fresh = files[now]
        for impl in clusters.BINDING_SERIES.values():
            if impl in files[path]["seconds"] and impl in fresh["seconds"]:
                curve = clusters.this_host(path, impl)
                rows += [row("curve", now, impl, int(size),
                             lone(curve, impl, int(size)), fresh)
                         for size in fresh["seconds"][impl]]
    for file, data in files.items():
        for binding, base in clusters.BINDING_SERIES.items():
            if base not in data["seconds"]:
                continue
            fitted = replace(clusters.this_host(file, base), intra_table=())
            others = ("horovod-mpi", "horovod-mpi-wake") if binding == "torch" else ()
            for impl in (base, *others):
                rows += [row("ring fit", file, impl, int(size),
                             lone(fitted, impl, int(size)), data)
                         for size in data["seconds"].get(impl, {})]
    return rows


def fresh_allreduce(path: Path, tensorflow: bool = True, repeats: int = 3,
                    rounds: int = 5) -> Path:
    """Measure Horovod's all-reduce here now as ``benchmarks/allreduce.py`` does (horovodrun
    -np 2, ``repeats`` jobs of ``rounds`` sweeps, every call pooled), the series ``hvdtrain
    plan`` uses (:data:`clusters.BINDING_SERIES`): PyTorch's binding and, with ``tensorflow``,
    TensorFlow's (the Keras/TensorFlow rows use it), into ``path`` in allreduce.json's layout
    (``seconds``, ``spread``, ``calls``); results/allreduce.json untouched.

    Raises:
        RuntimeError: a job failed (:func:`common.run_json`)."""
    sys.path.insert(0, str(HERE))
    import allreduce
    import common
    env = common.base_env(True)
    env["PYTHONPATH"] = f"{common.HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    ns = argparse.Namespace(min_bytes=4096, max_bytes=64 << 20, iters=20, warmup=3,
                            rounds=rounds, repeats=repeats)
    bindings = ("torch", "tensorflow") if tensorflow else ("torch",)
    measured = {impl: allreduce.measure(impl, 2, ns, env)
                for impl in (clusters.BINDING_SERIES[b] for b in bindings)}
    path.write_text(json.dumps({"np": 2, "machine": common.machine(),
                                **allreduce.as_json(measured)}))
    return path


def live_variants(path: str, model: str) -> dict[int, Callable[[], float]]:
    """``{np: run}`` for hvdtrain np=1 and np=2 run now by benchmarks/vs_single.py's own
    variants (each call one run, its samples/s; nothing written to results/)."""
    ns = argparse.Namespace(jit_compile="false", warmup=5, batches=None, iters=3, np=2)
    variants = vs_single.variants(path, model, ns)
    return {1: variants[vs_single.NP1], 2: variants[vs_single.NP2]}


def middle(values: list[float]) -> int:
    """The index of the median of ``values`` (the lower middle one for an even count, where
    ``statistics.median`` of the runs averages the two: use an odd ``--live``)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(values) - 1) // 2]


def check_here(repeats: int, path: str = "torch", live: int = 0,
               allreduce_json: str | None = None) -> list[dict]:
    """np=1 and np=2 predictions of one path (``torch``, ``keras-tf``, ``keras-torch``; a Keras
    path runs in the backend ``KERAS_BACKEND`` names) against vs_single.json's medians and, with
    ``live`` > 0, against hvdtrain run now: ``live`` rounds, each one prediction (its compute
    measured then) followed right away by one np=1 and one np=2 run, so that a change in the
    machine's load hits the prediction and the run alike. The row's prediction is the median of
    the rounds' (``predicted_runs``, the median round's by :func:`middle`; ``predicted_first``
    is round 1's, what a single prediction, as one ``hvdtrain plan`` makes, gives), compared
    with the median of the rounds' runs. ``cluster`` says which all-reduce series was used."""
    measured = json.loads((RESULTS / "vs_single.json").read_text())["results"]
    c = clusters.this_host(allreduce_json, binding=vs_single.PATHS[path][1] or "torch")
    cores = c.ranks_per_host
    if path == "torch":
        alone = lambda m, b: measure.measure_torch(m, b, cores, repeats=repeats)  # noqa: E731
        side = lambda m, b: measure.measure_side_by_side(  # noqa: E731
            m, b, max(1, cores // 2), 2, repeats=repeats)
    else:
        from hvdtrain.scaling.measure_keras import measure_keras_side_by_side
        alone = lambda m, b: measure_keras_side_by_side(  # noqa: E731
            m, b, cores, 1, repeats=2 * repeats)
        side = lambda m, b: measure_keras_side_by_side(  # noqa: E731
            m, b, max(1, cores // 2), 2, repeats=2 * repeats)
    rows = []
    for model, batch in GLOBAL_BATCH.items():
        runs = live_variants(path, model) if live else {}
        preds: dict[int, list] = {1: [], 2: []}
        one_cycle, now = [], {1: [], 2: []}
        for _ in range(max(1, live)):
            preds[1].append(predict_step(alone(model, batch), 1, c, CPU_SETTINGS))
            prof2 = side(model, batch // 2)
            preds[2].append(predict_step(prof2, 2, c, CPU_SETTINGS))
            # Before 2026-11-27 the model sent a CPU rank's gradients in one cycle at the end
            # of the backward pass; kept side by side to show what the cycle-per-gradient term
            # changed.
            one_cycle.append(predict_step(measure.all_ready_at_end(prof2), 2, c, CPU_SETTINGS))
            p1, p2 = preds[1][-1], preds[2][-1]
            print(f"  predict {path}/{model:<6} np=1 {p1.samples_per_s:9.1f}  np=2 "
                  f"{p2.samples_per_s:9.1f} samples/s (np=2: comm {p2.comm_s * 1e3:.2f} ms in "
                  f"{len(p2.buckets)} all-reduces, compute {p2.compute_s * 1e3:.2f} ms; one "
                  f"cycle at the end: {one_cycle[-1].samples_per_s:.1f})", flush=True)
            for n in runs:
                now[n].append(runs[n]())
            if runs:
                print(f"  run now {path}/{model:<6} np=1 {now[1][-1]:9.1f}  np=2 "
                      f"{now[2][-1]:9.1f} samples/s", flush=True)
        stats = measured[f"{path}/{model}"]["stats"]
        for n, key in ((1, "hvdtrain np=1"), (2, "hvdtrain np=2")):
            values = [p.samples_per_s for p in preds[n]]
            pred = preds[n][middle(values)]
            row = {"model": f"{path}/{model}", "np": n, "predicted": pred.samples_per_s,
                   "predicted_runs": values, "predicted_first": values[0],
                   "measured_median": stats[key]["median"], "measured_min": stats[key]["min"],
                   "measured_max": stats[key]["max"],
                   "error": pred.samples_per_s / stats[key]["median"] - 1,
                   "comm_ms": pred.comm_s * 1e3, "step_ms": pred.step_s * 1e3,
                   "allreduces": len(pred.buckets), "cluster": c.source}
            if now[n]:
                mid = statistics.median(now[n])
                row.update(measured_now=mid, measured_now_runs=now[n],
                           error_now=pred.samples_per_s / mid - 1,
                           error_now_first=values[0] / mid - 1)
            if n == 2:
                row["predicted_one_cycle"] = statistics.median(
                    p.samples_per_s for p in one_cycle)
                if now[n]:
                    row["error_now_one_cycle"] = row["predicted_one_cycle"] / mid - 1
            rows.append(row)
    return rows


def check_here_keras(repeats: int, path: str, extra: list[str], live: int = 0) -> list[dict]:
    """:func:`check_here` for a Keras path in a child process (one Keras backend per process)."""
    import subprocess
    env = {**os.environ, "KERAS_BACKEND": vs_single.PATHS[path][1],
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, __file__, "--here-path", path, "--repeats",
                           str(repeats), *extra], env=env, capture_output=True, text=True,
                          timeout=900 * max(1, live))
    for line in proc.stdout.splitlines():
        if line.startswith(("  predict", "  run now")):
            print(line)
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    raise RuntimeError(f"{path}: no result\n{proc.stderr[-2000:]}")


def plot_published(ax, rows: list[dict], title: str) -> None:
    """Predicted efficiency (lines) and the published figure (markers) against N, one colour per
    model and cluster; BERT's predictions with the fitted per-step cost dotted (+)."""
    import matplotlib.pyplot as plt
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["cluster"]), []).append(r)
    colours = plt.get_cmap("tab20").colors
    for i, ((model, cluster), rs) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        label = f"{model}, {cluster.split(' (')[0]}"
        if len(rs) == 1 and "curve" in rs[0]:
            xs = sorted(rs[0]["curve"], key=int)
            ax.plot([int(x) for x in xs], [rs[0]["curve"][x] for x in xs], "-", color=colour,
                    label=label)
        else:
            ax.plot([r["ranks"] for r in rs], [r["predicted"] for r in rs], "--", marker="x",
                    color=colour, label=label)
        ax.plot([r["ranks"] for r in rs], [r["published"] for r in rs], "o", color=colour)
        fitted = [r for r in rs if r.get("predicted_with_step_cost") is not None]
        if fitted:
            ax.plot([r["ranks"] for r in fitted], [r["predicted_with_step_cost"] for r in fitted],
                    ":", marker="+", color=colour)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0.6, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)


def plot(here, published, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5))
    rows = [r for r in published if "predicted" in r]
    plot_published(b, [r for r in rows if not r["source"].startswith("dle")],
                   "Horovod 2017-18 and TF K80: published (o) vs predicted (lines)")
    plot_published(c, [r for r in rows if r["source"].startswith("dle")],
                   "NVIDIA DeepLearningExamples 2020: published (o) vs predicted\n"
                   "(BERT dotted +: per-step cost fitted at 32 GPUs)")
    if here:
        key = "measured_now" if all("measured_now" in r for r in here) else "measured_median"
        names = sorted({r["model"] for r in here})
        for n, marker in ((1, "o"), (2, "s")):
            rs = [next(r for r in here if r["model"] == m and r["np"] == n) for m in names]
            a.scatter([r[key] for r in rs], [r["predicted"] for r in rs], marker=marker,
                      label=f"np={n}")
            for r in rs:
                a.annotate(r["model"], (r[key], r["predicted"]), fontsize=6)
        lim = [50, 15000]
        a.plot(lim, lim, "k-", lw=0.5)
        a.plot(lim, [x * 1.15 for x in lim], "k:", lw=0.5)
        a.plot(lim, [x * 0.85 for x in lim], "k:", lw=0.5)
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("measured samples/s (" + ("median of the rounds run now"
                                               if key == "measured_now"
                                               else "vs_single.json median") + ")")
        a.set_ylabel("predicted samples/s")
        a.set_title("this machine (dotted: +-15 %)")
        a.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-here", action="store_true", help="no measurement on this machine")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS / "plan_check.json"))
    ap.add_argument("--paths", default="torch,keras-tf,keras-torch",
                    help="this machine's paths to check (default: all three)")
    ap.add_argument("--live", type=int, nargs="?", const=3, default=0, metavar="ROUNDS",
                    help="also run hvdtrain np=1/np=2 now (vs_single's variants): ROUNDS rounds "
                    "(default 3), each a prediction followed by one np=1 and one np=2 run; the "
                    "median prediction is compared with the median run")
    ap.add_argument("--fresh-allreduce", action="store_true",
                    help="measure the all-reduce here now instead of results/allreduce.json")
    ap.add_argument("--allreduce-json", help=argparse.SUPPRESS)
    ap.add_argument("--here-path", help=argparse.SUPPRESS)  # one path, rows as JSON (internal)
    args = ap.parse_args(argv)
    if args.here_path:
        print("ROWS " + json.dumps(check_here(args.repeats, args.here_path, args.live,
                                              args.allreduce_json)))
        return 0
    import tempfile
    fresh = Path(args.allreduce_json) if args.allreduce_json else None
    fresh_path = Path(tempfile.gettempdir()) / "hvdtrain-plan_check.allreduce.json"
    if args.fresh_allreduce and not args.skip_here:
        fresh = fresh_allreduce(fresh_path, tensorflow="keras-tf" in args.paths.split(","))
        print(f"measured the all-reduce here now: {fresh}")
    elif args.skip_here and not fresh and Path(args.out).exists():
        # The last run's all-reduce measured then, to check the committed curve against again.
        stored = json.loads(Path(args.out).read_text()).get("allreduce_here")
        if stored:
            fresh_path.write_text(json.dumps(stored))
            fresh = fresh_path
            print(f"the all-reduce measured by the last --fresh-allreduce run: {args.out}")

    print("== predictions: published clusters (inputs: single-GPU throughput, parameters, network)")
    published = check_published()
    print("\n== compared with the published figures")
    print(f"{'source':<20} {'model':<15} {'cluster':<26} {'N':>4} {'predicted':>9} "
          f"{'published':>9} {'gap (pts)':>9} {'net fit':>8}")
    for r in published:
        if "predicted" in r:
            f = r.get("implied_net_fraction")
            print(f"{r['source']:<20} {r['model']:<15} {r['cluster']:<26} {r['ranks']:>4} "
                  f"{r['predicted']:>9.1%} {r['published']:>9.1%} "
                  f"{(r['predicted'] - r['published']) * 100:>+9.1f} "
                  f"{f'{f:.0%}' if f else '-':>8}"
                  + (f"  with the per-step cost fitted at {BERT_FIT_AT}: "
                     f"{r['predicted_with_step_cost']:.1%}"
                     if r.get("predicted_with_step_cost") is not None else "")
                  + (f"  unmodelled {r['extra_ms']:.1f} ms/step" if "extra_ms" in r else "")
                  + (f"  nothing overlapped: {r['predicted_no_overlap']:.1%}"
                     if "predicted_no_overlap" in r else ""))
        else:
            f = r["implied_tcp_fraction"]
            print(f"{r['source']:<20} {r['model']:<15} {'RDMA/TCP':<26} {r['ranks']:>4} "
                  f"{r['predicted_ratio']:>9.3f} {r['published_ratio']:>9} {'':>9} "
                  f"{f'{f:.0%}' if f else '-':>8}")
    print("(net fit: the share of the preset's network bandwidth at which the model gives the "
          "published figure)")
    print("\n== all-reduce model, np=2, a lone tensor: the curve hvdtrain plan uses (the "
          "committed benchmarks/results/allreduce.json) against the same series measured now; "
          "the ring formula with a fitted alpha and B against each file")
    ar = check_allreduce(now=fresh)
    print(f"{'check':<9} {'series':<26} {'bytes':>10} {'predicted ms':>12} {'measured ms':>12} "
          f"{'jobs min-max ms':>16} {'pred/meas':>9}")
    for r in ar:
        label = r["impl"] + (" (now)" if r.get("now") else "")
        lo, hi = r.get("spread_s") or (r["measured_s"], r["measured_s"])
        print(f"{r['kind']:<9} {label:<26} {r['bytes']:>10} {r['predicted_s'] * 1e3:>12.3f} "
              f"{r['measured_s'] * 1e3:>12.3f} {f'{lo * 1e3:.3f}-{hi * 1e3:.3f}':>16} "
              f"{r['ratio']:>9.2f}")
    for kind in ("curve", "ring fit"):
        rows = [r for r in ar if r["kind"] == kind]
        close = [abs(r["ratio"] - 1) <= 0.15 for r in rows]
        if rows:
            print(f"all-reduce, {kind}: within 15 %: {sum(close)} of {len(rows)}; within 15 % "
                  f"or between the lowest and highest of the jobs' own medians: "
                  f"{sum(c or r.get('within_spread', False) for c, r in zip(close, rows))} of "
                  f"{len(rows)}")
    here = []
    if not args.skip_here:
        print("\n== predictions: this machine (compute measured now; np=2 side by side)")
        here = []
        for path in args.paths.split(","):
            extra = (["--live", str(args.live)] if args.live else []) + (
                ["--allreduce-json", str(fresh)] if fresh else [])
            here += (check_here(args.repeats, "torch", args.live, fresh and str(fresh))
                     if path == "torch" else check_here_keras(args.repeats, path, extra, args.live))
        print("\n== compared with benchmarks/results/vs_single.json (median of 5 runs, min-max)"
              + (f" and with {args.live} rounds run now (median, min-max)" if args.live else ""))
        print(f"{'model':<17} {'np':>2} {'predicted':>10} {'pred min-max':>17} {'measured':>10} "
              f"{'min-max':>17} {'error':>7} {'now':>9} {'min-max now':>17} {'error now':>9}")
        for r in here:
            now = ""
            if "measured_now" in r:
                runs = r.get("measured_now_runs") or [r["measured_now"]]
                now = (f"{r['measured_now']:>9.1f} {min(runs):>8.0f}-{max(runs):<8.0f} "
                       f"{r['error_now']:>+9.1%}")
            preds = r.get("predicted_runs") or [r["predicted"]]
            print(f"{r['model']:<17} {r['np']:>2} {r['predicted']:>10.1f} "
                  f"{min(preds):>8.0f}-{max(preds):<8.0f} {r['measured_median']:>10.1f} "
                  f"{r['measured_min']:>8.0f}-{r['measured_max']:<8.0f} {r['error']:>+7.1%} "
                  f"{now}")
        errs = [abs(r["error"]) for r in here]
        print(f"within 15 % of the committed medians: {sum(e <= 0.15 for e in errs)} of "
              f"{len(errs)}; median |error| {statistics.median(errs):.1%}")
        nows = [abs(r["error_now"]) for r in here if "error_now" in r]
        if nows:
            print(f"within 15 % of the medians run now: {sum(e <= 0.15 for e in nows)} of "
                  f"{len(nows)}; median |error| {statistics.median(nows):.1%} (the median of "
                  f"{args.live} predictions, each measured right before its round)")
            firsts = [abs(r["error_now_first"]) for r in here if "error_now_first" in r]
            print(f"the first round's prediction alone (one hvdtrain plan): "
                  f"{sum(e <= 0.15 for e in firsts)} of {len(firsts)} within 15 %; median "
                  f"|error| {statistics.median(firsts):.1%}")
        old = [(abs(r["error_now"]), abs(r["error_now_one_cycle"])) for r in here
               if "error_now_one_cycle" in r]
        if old:
            print(f"np=2 within 15 % of the medians run now: {sum(a <= 0.15 for a, _ in old)} "
                  f"of {len(old)}; with one cycle at the end of the backward pass (the model "
                  f"before): {sum(b <= 0.15 for _, b in old)} of {len(old)}")
    gaps = [abs(r["predicted"] - r["published"]) * 100 for r in published if "predicted" in r]
    print(f"published: within 10 points: {sum(g <= 10 for g in gaps)} of {len(gaps)}")
    fitted = [abs(r["predicted_with_step_cost"] - r["published"]) * 100 for r in published
              if r.get("predicted_with_step_cost") is not None]
    k80 = [r for r in published if "predicted_no_overlap" in r]
    if k80:
        below = max(r["predicted_no_overlap"] - r["published"] for r in k80) * 100
        print(f"K80 parameter-server runs between the full-overlap and no-overlap predictions: "
              f"{sum(r['predicted_no_overlap'] <= r['published'] <= r['predicted'] for r in k80)}"
              f" of {len(k80)}; at most {below:.1f} points below the no-overlap one")
    if fitted:
        print(f"BERT with the per-step cost fitted at 32 GPUs, held-out N: within 10 points: "
              f"{sum(g <= 10 for g in fitted)} of {len(fitted)}, largest gap "
              f"{max(fitted):.1f} points")
    out = Path(args.out)
    sys.path.insert(0, str(HERE))
    import common
    result = {"machine": common.machine(),
              "allreduce_used": "measured here by --fresh-allreduce (allreduce_here)" if fresh else
              str(clusters.find_allreduce_json()),
              "allreduce_here": json.loads(fresh.read_text()) if fresh else None,
              "sources": PUBLISHED_SOURCES, "inputs": {"p100_img_s": P100, "k80": K80,
                                                       "params": PARAMS,
                                                       "dle_resnet50": DLE_RESNET50,
                                                       "dle_bert": DLE_BERT},
              "here": here, "published": published, "allreduce": ar}
    if out.exists():  # keep the last measured rows of the paths not measured now
        done = set() if args.skip_here else set(args.paths.split(","))
        old = json.loads(out.read_text())
        kept = [r for r in old.get("here", []) if r["model"].split("/")[0] not in done]
        result["here"] = kept + here
        if not fresh and old.get("allreduce_here"):
            result["allreduce_here"] = old["allreduce_here"]
            result["allreduce_used"] = old.get("allreduce_used")
    out.write_text(json.dumps(result, indent=1, default=str))
    plot(result["here"], published, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
