"""Does ``hvdtrain plan`` predict what was measured? Its cost model (hvdtrain.scaling) against
(1) this machine: the benchmarks' PyTorch models at np=1 and np=2 against the committed medians
of ``benchmarks/results/vs_single.json`` ("hvdtrain np=1" / "hvdtrain np=2", total samples/s at
the same global batch), compute measured here now, side by side for np=2; (2) the all-reduce
model against ``benchmarks/results/allreduce.json``; (3) published cluster results, held apart
from the inputs (each prediction uses only the published single-GPU throughput, the model's
parameter count and the published network, and is printed before the published figure).

Writes ``benchmarks/results/plan_check.json`` and ``.png`` (predicted vs measured/published
scaling efficiency against N).

Run::

    flock /tmp/hvdtrain-cpu.lock .venv/bin/python benchmarks/plan_check.py
    flock /tmp/hvdtrain-cpu.lock .venv/bin/python benchmarks/plan_check.py --paths torch
    .venv/bin/python benchmarks/plan_check.py --skip-here     # published + all-reduce only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hvdtrain.scaling import clusters, measure  # noqa: E402
from hvdtrain.scaling.model import (MiB, Cluster, HorovodSettings, allreduce_seconds,  # noqa: E402
                                    efficiency, predict_step)

RESULTS = HERE / "results"
GLOBAL_BATCH = {"mnist": 64, "cnn": 64, "dense": 64, "gpt": 16}  # as benchmarks/vs_single.py
# hvdtrain's CPU rank settings (hvdtrain.launch.tuning): 4 MiB fusion, thread woken on enqueue.
CPU_SETTINGS = HorovodSettings(fusion_threshold=4 * MiB, cycle_time_s=1e-3, cycle_wake=True)
# Horovod as of the paper (v0.9-0.11, 2017): fusion buffer 64 MB, cycle time 5 ms (the cycle
# default became 1 ms in v0.21, horovod/horovod#2468).
HOROVOD_2017 = HorovodSettings(fusion_threshold=64 * MiB, cycle_time_s=5e-3)

TF_BENCH = ("TensorFlow performance benchmarks (tensorflow.org/performance/benchmarks, May 2017; "
            "tensorflow/docs site/en/r1/guide/performance/benchmarks.md)")
PUBLISHED_SOURCES = {
    "horovod-paper-fig6": "Sergeev & Del Balso 2018, arXiv:1802.05799, Fig. 6: Horovod on "
                          "25 GbE TCP, 128 Pascal GPUs (32 servers x 4): 88 % scaling efficiency "
                          "for Inception V3 and ResNet-101",
    "horovod-readme-512": "Horovod README / docs/benchmarks.rst (since v0.12): 128 servers x 4 "
                          "Pascal GPUs, 'RoCE-capable 25 Gbit/s network': 90 % Inception V3, 90 % "
                          "ResNet-101, 68 % VGG-16 at 512 GPUs",
    "horovod-paper-fig7": "Sergeev & Del Balso 2018, Fig. 7: RDMA vs TCP on the same cluster at "
                          "128 "
                          "GPUs: +3-4 % for Inception V3 and ResNet-101, about +30 % for VGG-16 "
                          "(a ratio; no absolute efficiency for VGG-16 over TCP is given)",
    "tf-k80-distributed": TF_BENCH + ", 'Details for Amazon EC2 Distributed (NVIDIA Tesla K80)': "
                          "p2.8xlarge hosts (8 K80 GPUs, 10 Gb/s network), synthetic data, "
                          "distributed_replicated (parameter servers on the workers' hosts)",
}

# Published single-GPU inputs: P100 (DGX-1) synthetic, batch 64: InceptionV3 142, ResNet-50 219,
# ResNet-152 91.8, VGG16 154 img/s (TF_BENCH). ResNet-101 is not in that table: interpolated by
# FLOPs between ResNet-50 (4.1 GFLOPs) and ResNet-152 (11.5) at 7.8 GFLOPs (He et al. 2016,
# Table 1): time per image 1/219 + (7.8-4.1)/(11.5-4.1) x (1/91.8 - 1/219) -> 129 img/s.
P100 = {"inception3": 142.0, "vgg16": 154.0,
        "resnet101": 1 / (1 / 219 + (7.8 - 4.1) / (11.5 - 4.1) * (1 / 91.8 - 1 / 219))}
# K80 (p2.8xlarge, one GPU) synthetic, from the distributed table's own 1-GPU row.
K80 = {"inception3": (29.7, 64), "resnet50": (52.4, 64), "resnet152": (19.4, 32)}
# Parameters (float32 gradients): Inception V3 23.8 M (Szegedy et al. 2016), ResNet-50 25.6 M,
# ResNet-101 44.5 M, ResNet-152 60.2 M (He et al. 2016), VGG-16 138.4 M of which 123.6 M in the
# three fully connected layers (Simonyan & Zisserman 2015).
PARAMS = {"inception3": 23.8e6, "resnet50": 25.6e6, "resnet101": 44.5e6, "resnet152": 60.2e6,
          "vgg16": 138.4e6}
PUBLISHED = [  # (source, model, cluster preset, ranks, efficiency)
    ("horovod-paper-fig6", "inception3", "pcie-25gbe", 128, 0.88),
    ("horovod-paper-fig6", "resnet101", "pcie-25gbe", 128, 0.88),
    ("horovod-readme-512", "inception3", "pcie-25gbe-rdma", 512, 0.90),
    ("horovod-readme-512", "resnet101", "pcie-25gbe-rdma", 512, 0.90),
    ("horovod-readme-512", "vgg16", "pcie-25gbe-rdma", 512, 0.68),
]
# tf-k80-distributed: GPUs -> total img/s (synthetic), the published table.
K80_TABLE = {"inception3": {8: 229, 16: 459, 32: 902, 64: 1783},
             "resnet50": {8: 378, 16: 751, 32: 1388, 64: 2744},
             "resnet152": {8: 146, 16: 291, 32: 565, 64: 981}}
# p2.8xlarge: 8 K80 GPUs on PCIe 3 behind PLX switches (~6 GB/s all-reduce busbw assumed),
# "10 Gigabit" network (AWS instance table), TCP.
P2_8XLARGE = Cluster("p2.8xlarge", 8, 6e9, 5e-6, 10 / 8 * 1e9 * clusters.NET_EFFICIENCY, 25e-6,
                     True, "8 K80 per host, PCIe (~6 GB/s assumed), 10 Gb/s Ethernet TCP")


def published_profile(model: str, throughput: float, batch: int):
    """A model known only by its published throughput and parameter count: gradients ready
    evenly over the backward pass, except VGG-16, whose fully connected layers (89 % of its
    bytes, ~1 % of its multiply-adds) finish in the first 2 % of it."""
    total = int(PARAMS[model] * 4)
    if model == "vgg16":
        fc = int(123.6e6 * 4)
        segments = [(measure.even_tensors(fc, 3, "fc"), 0.02),
                    (measure.even_tensors(total - fc, 26, "conv"), 0.98)]
    else:
        segments = [(measure.even_tensors(total, 100), 1.0)]
    return measure.profile_from_step_time(batch / throughput, batch, segments,
                                          source=f"published {throughput:.1f} img/s")


def implied_fraction(prof, n, c, target_eff) -> float | None:
    """The fraction of the cluster's network bandwidth at which the model gives ``target_eff``
    at ``n`` ranks (bisection; None when even the full bandwidth gives less)."""
    from dataclasses import replace

    def eff(f):
        cf = replace(c, inter_bw=c.inter_bw * f, intra_busbw=c.intra_busbw)
        return efficiency(predict_step(prof, n, cf, HOROVOD_2017),
                          predict_step(prof, 1, cf, HOROVOD_2017))
    if n <= c.ranks_per_host or eff(1.0) < target_eff:
        return None  # one host: no network to blame
    lo, hi = 1e-3, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if eff(mid) < target_eff else (lo, mid)
    return hi


def check_published() -> list[dict]:
    rows = []
    for source, model, preset, n, published in PUBLISHED:
        prof = published_profile(model, P100[model], 64)
        c = clusters.PRESETS[preset]
        pred = predict_step(prof, n, c, HOROVOD_2017)
        eff = efficiency(pred, predict_step(prof, 1, c, HOROVOD_2017))
        curve = {m: efficiency(predict_step(prof, m, c, HOROVOD_2017),
                               predict_step(prof, 1, c, HOROVOD_2017))
                 for m in (1, 4, 8, 16, 32, 64, 128, 256, 512) if m <= n}
        print(f"  predict {model:<10} {preset:<16} N={n:<4}: efficiency {eff:6.1%} "
              f"(comm {pred.comm_s * 1e3:6.1f} ms, exposed {pred.exposed_s * 1e3:6.1f} ms of a "
              f"{pred.step_s * 1e3:6.1f} ms step)")
        rows.append({"source": source, "model": model, "cluster": preset, "ranks": n,
                     "predicted": eff, "published": published, "curve": curve,
                     "implied_net_fraction": implied_fraction(prof, n, c, published),
                     "comm_ms": pred.comm_s * 1e3, "exposed_ms": pred.exposed_s * 1e3,
                     "step_ms": pred.step_s * 1e3})
    # Fig. 7's ratio: RDMA over TCP at 128 GPUs.
    for model, published in (("inception3", "1.03-1.04"), ("resnet101", "1.03-1.04"),
                             ("vgg16", "~1.30")):
        prof = published_profile(model, P100[model], 64)
        tcp = predict_step(prof, 128, clusters.PRESETS["pcie-25gbe"], HOROVOD_2017)
        rdma = predict_step(prof, 128, clusters.PRESETS["pcie-25gbe-rdma"], HOROVOD_2017)
        ratio = rdma.samples_per_s / tcp.samples_per_s
        print(f"  predict {model:<10} RDMA/TCP at N=128: {ratio:.3f}")
        tcp_fraction = None
        if model == "vgg16":  # what TCP bandwidth would make RDMA 1.30x faster?
            from dataclasses import replace
            base = clusters.PRESETS["pcie-25gbe"]
            lo, hi = 1e-3, 1.0
            for _ in range(40):
                mid = (lo + hi) / 2
                t = predict_step(prof, 128, replace(base, inter_bw=base.inter_bw * mid),
                                 HOROVOD_2017)
                lo, hi = (mid, hi) if rdma.samples_per_s / t.samples_per_s > 1.30 else (lo, mid)
            tcp_fraction = hi
        rows.append({"source": "horovod-paper-fig7", "model": model, "ranks": 128,
                     "predicted_ratio": ratio, "published_ratio": published,
                     "implied_tcp_fraction": tcp_fraction})
    for model, table in K80_TABLE.items():
        thr, batch = K80[model]
        prof = published_profile(model, thr, batch)
        single = predict_step(prof, 1, P2_8XLARGE, HOROVOD_2017)
        for n, total in table.items():
            eff = efficiency(predict_step(prof, n, P2_8XLARGE, HOROVOD_2017), single)
            print(f"  predict {model:<10} p2.8xlarge       N={n:<4}: efficiency {eff:6.1%}")
            rows.append({"source": "tf-k80-distributed", "model": model, "cluster": "p2.8xlarge",
                         "ranks": n, "predicted": eff, "published": total / (n * thr),
                         "implied_net_fraction": implied_fraction(prof, n, P2_8XLARGE,
                                                                  total / (n * thr))})
    return rows


def check_allreduce(path: Path | None = None) -> list[dict]:
    """The ring formula with the fitted alpha and B (not the interpolated table, which passes
    through the points by construction) plus Horovod's cycle (a call enqueued just after a tick
    waits for the next one: 0.1 ms or the default 1 ms), against both measured series."""
    from dataclasses import replace

    from hvdtrain.scaling.model import schedule
    path = path or clusters.find_allreduce_json()
    data = json.loads(path.read_text())
    fitted = replace(clusters.this_host(path), intra_table=())
    rows = []
    for impl, cycle in (("horovod-mpi-cycle0.1", 1e-4), ("horovod-mpi", 1e-3)):
        for size, seconds in data["seconds"].get(impl, {}).items():
            buckets = schedule([(1e-9, int(size))], data["np"], fitted,
                               HorovodSettings(cycle_time_s=cycle))
            pred = buckets[-1].end_s
            rows.append({"file": path.name, "impl": impl, "bytes": int(size), "predicted_s": pred,
                         "measured_s": seconds, "ratio": pred / seconds})
    return rows


def fresh_allreduce(path: Path) -> Path:
    """Measure Horovod's all-reduce here now (benchmarks/allreduce.py's worker, horovodrun -np 2,
    a 0.1 ms cycle) into ``path`` in allreduce.json's layout; results/allreduce.json untouched."""
    sys.path.insert(0, str(HERE))
    import allreduce
    import common
    env = common.base_env(True)
    env["PYTHONPATH"] = f"{common.HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["HOROVOD_CYCLE_TIME"] = "0.1"
    ns = argparse.Namespace(min_bytes=4096, max_bytes=64 << 20, iters=20, warmup=3)
    impl = "horovod-mpi-cycle0.1"
    out = common.run_json(allreduce.launch_argv(impl, 2, ns), env)
    path.write_text(json.dumps({"np": 2, "machine": common.machine(),
                                "seconds": {impl: out["seconds"]}}))
    return path


def live_baseline(path: str, model: str) -> dict[int, float]:
    """hvdtrain np=1 and np=2 samples/s measured now, one run each, by benchmarks/vs_single.py's
    own variants (nothing written to results/)."""
    sys.path.insert(0, str(HERE))
    import vs_single
    ns = argparse.Namespace(jit_compile="false", warmup=5, batches=None, iters=3, np=2)
    runs = vs_single.variants(path, model, ns)
    return {1: runs[vs_single.NP1](), 2: runs[vs_single.NP2]()}


def check_here(repeats: int, path: str = "torch", live: bool = False,
               allreduce_json: str | None = None) -> list[dict]:
    """np=1 and np=2 predictions of one path (``torch``, ``keras-tf``, ``keras-torch``; a Keras
    path runs in the backend ``KERAS_BACKEND`` names) against vs_single.json's medians (and,
    with ``live``, against runs made right after the prediction)."""
    measured = json.loads((RESULTS / "vs_single.json").read_text())["results"]
    c = clusters.this_host(allreduce_json)
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
        pred1 = predict_step(alone(model, batch), 1, c, CPU_SETTINGS)
        pred2 = predict_step(side(model, batch // 2), 2, c, CPU_SETTINGS)
        print(f"  predict {path}/{model:<6} np=1 {pred1.samples_per_s:9.1f}  np=2 "
              f"{pred2.samples_per_s:9.1f} samples/s (np=2: comm {pred2.comm_s * 1e3:.2f} ms, "
              f"compute {pred2.compute_s * 1e3:.2f} ms)", flush=True)
        now = live_baseline(path, model) if live else {}
        stats = measured[f"{path}/{model}"]["stats"]
        for n, pred, key in ((1, pred1, "hvdtrain np=1"), (2, pred2, "hvdtrain np=2")):
            row = {"model": f"{path}/{model}", "np": n, "predicted": pred.samples_per_s,
                   "measured_median": stats[key]["median"], "measured_min": stats[key]["min"],
                   "measured_max": stats[key]["max"],
                   "error": pred.samples_per_s / stats[key]["median"] - 1,
                   "comm_ms": pred.comm_s * 1e3, "step_ms": pred.step_s * 1e3}
            if now:
                row.update(measured_now=now[n], error_now=pred.samples_per_s / now[n] - 1)
            rows.append(row)
    return rows


def check_here_keras(repeats: int, path: str, extra: list[str]) -> list[dict]:
    """:func:`check_here` for a Keras path in a child process (one Keras backend per process)."""
    import os
    import subprocess
    env = {**os.environ, "KERAS_BACKEND": {"keras-tf": "tensorflow", "keras-torch": "torch"}[path],
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, __file__, "--here-path", path, "--repeats",
                           str(repeats), *extra], env=env, capture_output=True, text=True,
                          timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("  predict"):
            print(line)
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    raise RuntimeError(f"{path}: no result\n{proc.stderr[-2000:]}")


def plot(here, published, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in published:
        if "curve" in r:
            xs = sorted(r["curve"])
            line, = b.plot(xs, [r["curve"][x] for x in xs], "-", alpha=0.6,
                           label=f"{r['model']} {r['cluster']} (predicted)")
            b.plot([r["ranks"]], [r["published"]], "o", color=line.get_color())
    for model in K80_TABLE:
        pts = [r for r in published if r.get("source") == "tf-k80-distributed"
               and r["model"] == model]
        line, = b.plot([p["ranks"] for p in pts], [p["predicted"] for p in pts], "--",
                       label=f"{model} p2.8xlarge (predicted)")
        b.plot([p["ranks"] for p in pts], [p["published"] for p in pts], "s",
               color=line.get_color())
    b.set_xscale("log", base=2)
    b.set_xlabel("GPUs")
    b.set_ylabel("scaling efficiency")
    b.set_ylim(0.4, 1.05)
    b.set_title("published (markers) vs predicted (lines)")
    b.legend(fontsize=6)
    if here:
        names = sorted({r["model"] for r in here})
        for n, marker in ((1, "o"), (2, "s")):
            rs = [next(r for r in here if r["model"] == m and r["np"] == n) for m in names]
            a.scatter([r["measured_median"] for r in rs], [r["predicted"] for r in rs],
                      marker=marker, label=f"np={n}")
            for r in rs:
                a.annotate(r["model"], (r["measured_median"], r["predicted"]), fontsize=6)
        lim = [50, 10000]
        a.plot(lim, lim, "k-", lw=0.5)
        a.plot(lim, [x * 1.15 for x in lim], "k:", lw=0.5)
        a.plot(lim, [x * 0.85 for x in lim], "k:", lw=0.5)
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("measured samples/s (vs_single.json median)")
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
    ap.add_argument("--live", action="store_true",
                    help="also run hvdtrain np=1/np=2 now (vs_single's variants, one run each) "
                    "next to each prediction")
    ap.add_argument("--fresh-allreduce", action="store_true",
                    help="measure the all-reduce here now instead of results/allreduce.json")
    ap.add_argument("--allreduce-json", help=argparse.SUPPRESS)
    ap.add_argument("--here-path", help=argparse.SUPPRESS)  # one path, rows as JSON (internal)
    args = ap.parse_args(argv)
    if args.here_path:
        print("ROWS " + json.dumps(check_here(args.repeats, args.here_path, args.live,
                                              args.allreduce_json)))
        return 0
    fresh = Path(args.allreduce_json) if args.allreduce_json else None
    if args.fresh_allreduce and not args.skip_here:
        import tempfile
        fresh = fresh_allreduce(Path(tempfile.gettempdir()) / "hvdtrain-plan_check.allreduce.json")
        print(f"measured the all-reduce here now: {fresh}")

    print("== predictions: published clusters (inputs: single-GPU throughput, parameters, network)")
    published = check_published()
    print("\n== compared with the published figures")
    print(f"{'source':<20} {'model':<10} {'cluster':<16} {'N':>4} {'predicted':>9} "
          f"{'published':>9} {'gap (pts)':>9} {'net fit':>8}")
    for r in published:
        if "predicted" in r:
            f = r["implied_net_fraction"]
            print(f"{r['source']:<20} {r['model']:<10} {r['cluster']:<16} {r['ranks']:>4} "
                  f"{r['predicted']:>9.1%} {r['published']:>9.1%} "
                  f"{(r['predicted'] - r['published']) * 100:>+9.1f} "
                  f"{f'{f:.0%}' if f else '-':>8}")
        else:
            f = r["implied_tcp_fraction"]
            print(f"{r['source']:<20} {r['model']:<10} {'RDMA/TCP':<16} {r['ranks']:>4} "
                  f"{r['predicted_ratio']:>9.3f} {r['published_ratio']:>9} {'':>9} "
                  f"{f'{f:.0%}' if f else '-':>8}")
    print("(net fit: the share of the preset's network bandwidth at which the model gives the "
          "published figure)")
    print("\n== all-reduce model (fitted alpha + bytes/B, Horovod cycle) vs "
          "benchmarks/results/allreduce.json (np=2)")
    ar = check_allreduce()
    if fresh:
        ar += check_allreduce(fresh)
    print(f"{'series':<28} {'bytes':>10} {'predicted ms':>12} {'measured ms':>12} {'pred/meas':>9}")
    for r in ar:
        label = r["impl"] + (" (now)" if r["file"].startswith("plan_check") else "")
        print(f"{label:<28} {r['bytes']:>10} {r['predicted_s'] * 1e3:>12.3f} "
              f"{r['measured_s'] * 1e3:>12.3f} {r['ratio']:>9.2f}")
    print(f"all-reduce within 15 %: {sum(abs(r['ratio'] - 1) <= 0.15 for r in ar)} of {len(ar)}")
    here = []
    if not args.skip_here:
        print("\n== predictions: this machine (compute measured now; np=2 side by side)")
        here = []
        for path in args.paths.split(","):
            extra = (["--live"] if args.live else []) + (
                ["--allreduce-json", str(fresh)] if fresh else [])
            here += (check_here(args.repeats, "torch", args.live, fresh and str(fresh))
                     if path == "torch" else check_here_keras(args.repeats, path, extra))
        print("\n== compared with benchmarks/results/vs_single.json (median of 5 runs, min-max)")
        print(f"{'model':<17} {'np':>2} {'predicted':>10} {'measured':>10} {'min-max':>17} "
              f"{'error':>7} {'now':>9} {'error now':>9}")
        for r in here:
            now = (f"{r['measured_now']:>9.1f} {r['error_now']:>+9.1%}" if "measured_now" in r
                   else "")
            print(f"{r['model']:<17} {r['np']:>2} {r['predicted']:>10.1f} "
                  f"{r['measured_median']:>10.1f} "
                  f"{r['measured_min']:>8.0f}-{r['measured_max']:<8.0f} {r['error']:>+7.1%} "
                  f"{now}")
        errs = [abs(r["error"]) for r in here]
        print(f"within 15 %: {sum(e <= 0.15 for e in errs)} of {len(errs)}; median |error| "
              f"{statistics.median(errs):.1%}")
    gaps = [abs(r["predicted"] - r["published"]) * 100 for r in published if "predicted" in r]
    print(f"published: within 10 points: {sum(g <= 10 for g in gaps)} of {len(gaps)}")
    out = Path(args.out)
    sys.path.insert(0, str(HERE))
    import common
    result = {"machine": common.machine(),
              "allreduce_used": "measured here by --fresh-allreduce (allreduce_here)" if fresh else
              str(clusters.find_allreduce_json()),
              "allreduce_here": json.loads(fresh.read_text()) if fresh else None,
              "sources": PUBLISHED_SOURCES, "inputs": {"p100_img_s": P100, "k80": K80,
                                                       "params": PARAMS},
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
