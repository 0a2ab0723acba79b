"""``hvdtrain plan``: the sub-command's options and its run (frameworks imported only when it
runs; :func:`add_parser` imports none)."""
from __future__ import annotations

import argparse
import json
import os
import sys

EXAMPLES = """\
examples:
  hvdtrain plan --model cnn --cluster this-host
  hvdtrain plan --model mymodels:build --batch-size 16 --cluster this-host
  hvdtrain plan --model dense --cluster nvlink-ib200 --step-time-ms 12 --max-ranks 256
  hvdtrain plan --params 25.6e6 --throughput 219 --batch-size 64 --cluster pcie-25gbe
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``hvdtrain`` sub-parsers ``sub``."""
    from hvdtrain.scaling.clusters import PRESETS
    p = sub.add_parser(
        "plan", help="predict samples/s at N ranks and hosts; recommend k, fusion, compression",
        description="Predict a data-parallel job's step time, samples/s and scaling efficiency "
        "at N = 1, 2, 4, ... ranks from its compute (measured here with PyTorch, or given) and "
        "a ring all-reduce cost model of the cluster, and the Horovod settings that would help "
        "(backward_passes_per_step, fusion threshold, fp16 compression, hierarchical "
        "all-reduce). Method and sources: docs/guides/planning.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("the model")
    what.add_argument("--model", default="cnn",
                      help="built-in benchmark model (mnist, cnn, dense, gpt) or module:function "
                      "returning (model, loss_fn, (inputs, targets)) (default: cnn)")
    what.add_argument("--framework", choices=("torch", "keras"), default="torch",
                      help="torch: per-gradient ready times from hooks; keras: fit steps on "
                      "KERAS_BACKEND's backend (TensorFlow: all gradients ready at the end; "
                      "PyTorch: per-gradient ready times from hooks; with --step-time-ms or "
                      "--throughput: all at the end) (default: torch)")
    what.add_argument("--batch-size", type=int, default=32,
                      help="samples per micro-batch per rank (default: 32)")
    what.add_argument("--params", type=float,
                      help="parameter count (float32) instead of the model's own: needs "
                      "--step-time-ms or --throughput")
    what.add_argument("--step-time-ms", type=float,
                      help="one rank's forward+backward+optimizer time per micro-batch, ms, "
                      "instead of measuring it here (without the per-step work given as "
                      "--optimizer-ms)")
    what.add_argument("--throughput", type=float,
                      help="one device's samples/s (e.g. a published single-GPU figure), "
                      "instead of measuring")
    what.add_argument("--optimizer-ms", type=float,
                      help="with --step-time-ms or --throughput: the work done once per "
                      "optimizer step rather than per micro-batch (the optimizer's update, "
                      "accumulators), ms, added to the given time, which then leaves it out; it "
                      "weighs more as k falls (default: 0)")
    what.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                      help="where to measure the compute (default: cpu)")
    what.add_argument("--repeats", type=int, default=10, help="timed steps (default: 10)")
    net = p.add_argument_group("the cluster")
    net.add_argument("--cluster", default="this-host",
                     choices=("this-host", "custom", *PRESETS),
                     help="preset (default: this-host, from benchmarks/results/allreduce.json)")
    net.add_argument("--ranks-per-host", type=int, help="GPUs (ranks) per host")
    net.add_argument("--intra-gbps", type=float, help="all-reduce bus bandwidth within a host, "
                     "GB/s (bytes)")
    net.add_argument("--inter-gbps", type=float, help="network bandwidth per host, GB/s (bytes)")
    net.add_argument("--latency-us", type=float, help="per-hop latency, microseconds")
    net.add_argument("--max-ranks", type=int,
                     help="largest N (default: this host's cores for this-host, else 64)")
    net.add_argument("--allreduce-json", help="benchmarks/allreduce.py results for this-host")
    hv = p.add_argument_group("Horovod settings (the baseline)")
    hv.add_argument("--fusion-threshold-mb", type=float,
                    help="HOROVOD_FUSION_THRESHOLD in MiB (default: hvdtrain's: 4 on CPU "
                    "ranks, Horovod's 128 on GPUs)")
    hv.add_argument("--cycle-time-ms", type=float, default=1.0,
                    help="HOROVOD_CYCLE_TIME (default: 1)")
    hv.add_argument("--cycle-wake", choices=("on", "off"),
                    help="HOROVOD_CYCLE_WAKE (hvdtrain's patch; default: on for CPU ranks)")
    hv.add_argument("--hierarchical", action="store_true",
                    help="HOROVOD_HIERARCHICAL_ALLREDUCE")
    hv.add_argument("--compression", choices=("none", "fp16"), default="none")
    hv.add_argument("--backward-passes-per-step", type=int, default=1, metavar="K")
    p.add_argument("--json-out", help="also write the plan as JSON to this file")
    p.set_defaults(func=cmd_plan)
    return p


def build_cluster(args):
    """The :class:`~hvdtrain.scaling.model.Cluster` the options describe."""
    from dataclasses import replace

    from hvdtrain.scaling import clusters
    if args.cluster == "custom":
        missing = [o for o, v in (("--ranks-per-host", args.ranks_per_host),
                                  ("--intra-gbps", args.intra_gbps),
                                  ("--inter-gbps", args.inter_gbps),
                                  ("--latency-us", args.latency_us)) if v is None]
        if missing:
            raise ValueError(f"--cluster custom needs {', '.join(missing)}")
        return clusters.custom(args.ranks_per_host, args.intra_gbps, args.inter_gbps,
                               args.latency_us)
    kw = {}
    if args.cluster == "this-host":
        kw = {"allreduce_json": args.allreduce_json, "binding": "torch"}
        if args.framework == "keras":
            from hvdtrain.config import default_keras_backend
            kw["binding"] = default_keras_backend()
    c = clusters.cluster(args.cluster, **kw)
    changes = {}
    if args.ranks_per_host:
        changes["ranks_per_host"] = args.ranks_per_host
    if args.intra_gbps:
        changes["intra_busbw"] = args.intra_gbps * clusters.GB
    if args.inter_gbps:
        changes["inter_bw"] = args.inter_gbps * clusters.GB
    if args.latency_us is not None:
        changes["intra_latency_s"] = changes["inter_latency_s"] = args.latency_us * 1e-6
    return replace(c, **changes, source=c.source + (" (changed on the command line)"
                                                   if changes else "")) if changes else c


def profile_source(args, cluster):
    """N -> :class:`~hvdtrain.scaling.model.ComputeProfile`, measured or from the given time."""
    from hvdtrain.scaling import measure
    given = args.step_time_ms is not None or args.throughput is not None
    if args.params is not None and not given:
        raise ValueError("--params needs --step-time-ms or --throughput (there is no model "
                         "to time)")
    if args.optimizer_ms is not None and (not given or args.optimizer_ms < 0):
        raise ValueError("--optimizer-ms needs --step-time-ms or --throughput and a value >= 0 "
                         "(a measured profile times the optimizer step itself)")
    if given:
        step = (args.step_time_ms / 1e3 if args.step_time_ms is not None
                else args.batch_size / args.throughput)
        keras = args.framework == "keras"
        if args.params is not None:
            tensors = measure.even_tensors(int(args.params * 4), 100)
        elif keras:
            from hvdtrain.scaling.measure_keras import keras_gradient_sizes
            tensors = keras_gradient_sizes(args.model)
        else:
            tensors = measure.gradient_sizes(args.model)
        what = (f"{args.params:.3g} parameters" if args.params is not None else args.model)
        prof = measure.profile_from_step_time(
            step, args.batch_size, [(tensors, 1.0)],
            source=f"given: {what}, {step * 1e3:.2f} ms per micro-batch of {args.batch_size}, "
            + ("gradients all ready at the end (Keras)" if keras
               else "gradients ready evenly over the backward pass"))
        if keras:
            prof = measure.all_ready_at_end(prof)
        if args.optimizer_ms:
            from dataclasses import replace
            prof = replace(prof, optimizer_s=args.optimizer_ms / 1e3,
                           source=prof.source + f", {args.optimizer_ms:g} ms per optimizer step")
        return lambda n: prof
    if args.framework == "keras":
        from hvdtrain.scaling.measure_keras import measure_keras_side_by_side
        alone = lambda: measure_keras_side_by_side(  # noqa: E731
            args.model, args.batch_size, os.cpu_count() or 1, 1, repeats=2 * args.repeats)
        side = lambda n, threads: measure_keras_side_by_side(  # noqa: E731
            args.model, args.batch_size, threads, n, repeats=2 * args.repeats)
    else:
        alone = lambda: measure.measure_torch(args.model, args.batch_size,  # noqa: E731
                                              device=args.device, repeats=args.repeats)
        side = lambda n, threads: measure.measure_side_by_side(  # noqa: E731
            args.model, args.batch_size, threads, n, repeats=args.repeats)
    if args.cluster == "this-host":
        cores = os.cpu_count() or 1
        cache = {}

        def per_n(n):
            if n not in cache:
                cache[n] = side(n, max(1, cores // n))
            return cache[n]
        return per_n
    if args.device != "cuda":
        print("hvdtrain plan: note: timing the model on this machine's CPU for a GPU cluster; "
              "give --step-time-ms or --throughput (the GPU's figure) for a real plan",
              file=sys.stderr)
    prof = alone()
    return lambda n: prof


def cmd_plan(args) -> int:
    """Run ``hvdtrain plan``: print the table (and write ``--json-out``). Exit 2 on bad input."""
    from dataclasses import asdict

    from hvdtrain.scaling.model import MiB, HorovodSettings
    from hvdtrain.scaling.plan import format_table, plan, ranks_list
    try:
        if args.batch_size < 1 or args.repeats < 1:
            raise ValueError("--batch-size and --repeats must be >= 1")
        cluster = build_cluster(args)
        cpu = not cluster.overlap
        threshold = (args.fusion_threshold_mb if args.fusion_threshold_mb is not None
                     else (4 if cpu else 128))
        wake = (args.cycle_wake == "on") if args.cycle_wake else cpu
        settings = HorovodSettings(int(threshold * MiB), args.cycle_time_ms / 1e3, wake,
                                   args.hierarchical, args.compression,
                                   args.backward_passes_per_step)
        max_ranks = args.max_ranks or (cluster.ranks_per_host if args.cluster == "this-host"
                                       else 64)
        if args.cluster == "this-host" and max_ranks > cluster.ranks_per_host:
            raise ValueError(f"--max-ranks {max_ranks}: this host has {cluster.ranks_per_host} "
                             "cores; more ranks than cores only share them")
        profile_for = profile_source(args, cluster)
        ranks = ranks_list(max_ranks)
        rows = plan(profile_for, cluster, ranks, settings)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"hvdtrain plan: {e}", file=sys.stderr)
        return 2
    p1 = profile_for(1)
    noisy = [n for n in ranks
             if profile_for(n).jitter_s > 0.2 * profile_for(n).micro_batch_s]
    if noisy:
        print(f"hvdtrain plan: note: step times varied by more than 20 % while measuring (N = "
              f"{', '.join(map(str, noisy))}): this machine is busy; rerun when it is quiet, or "
              "give --step-time-ms", file=sys.stderr)
    print(f"model: {args.model if args.params is None else f'{args.params:.3g} parameters'}; "
          f"{p1.gradient_bytes / 1e6:.2f} MB of gradients in {len(p1.gradients)} tensors")
    print(f"compute (N=1): {p1.source}: forward {p1.forward_s * 1e3:.2f} ms, backward "
          f"{p1.backward_s * 1e3:.2f} ms, optimizer {p1.optimizer_s * 1e3:.2f} ms")
    print(f"cluster: {cluster.name}: {cluster.source}")
    print(f"settings: fusion {settings.fusion_threshold / MiB:g} MiB, cycle "
          f"{settings.cycle_time_s * 1e3:g} ms{' (wake on enqueue)' if wake else ''}, "
          f"hierarchical {'on' if settings.hierarchical else 'off'}, compression "
          f"{settings.compression}, k={settings.backward_passes_per_step}")
    print()
    print(format_table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": args.model, "cluster": asdict(cluster),
                       "settings": asdict(settings), "rows": [r.as_dict() for r in rows]},
                      f, indent=1)
    return 0
