"""The bookkeeping of ``benchmarks/gpu.py``'s interleaved rounds, free of any framework: whether
another round fits the time budget, each variant's statistics (Horovod's mean +-1.96 std of the
iterations, the median of the rounds, the per-round ratios hvdtrain / plain with their median,
min and max), what is printed at the end, and the JSON written after each variant's pair of blocks.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

LOOPS = ("plain", "hvdtrain")
TARGET_RATIO = 0.98  # hvdtrain / plain, median of the rounds: reported, not asserted


def another_round(done: int, args, elapsed: float, last_round: float) -> bool:
    """Whether round ``done + 1`` runs: always up to ``min(args.min_rounds, args.rounds)``, never
    past ``args.rounds``; in between only when, taking ``last_round`` seconds after ``elapsed``
    seconds since the start, it would end within ``args.time_budget`` seconds (0: no budget)."""
    if done >= args.rounds:
        return False
    if done < min(args.min_rounds, args.rounds) or not args.time_budget:
        return True
    return elapsed + last_round <= args.time_budget


def summary(values: list[float]) -> tuple[float, float]:
    """Mean and 1.96 x the (population) standard deviation, as Horovod's benchmark prints."""
    mean = statistics.fmean(values)
    return mean, 1.96 * statistics.pstdev(values) if len(values) > 1 else 0.0


def results_of(kinds: dict[str, dict], iters: dict, rounds: dict, size: int) -> dict:
    """Per variant (``kinds``: variant -> its ``model`` and ``framework``): each loop's img/s per
    device (mean and 1.96 std of ``iters[(variant, loop)]``, the median of ``rounds[...]``, both
    lists), ``round_ratios`` hvdtrain / plain, their median (``ratio``), ``ratio_min``,
    ``ratio_max``, ``ratio_of_means``, and whether the median ``meets_target``. A variant not yet
    timed in both loops is left out (a round in progress: the JSON is written after each variant's
    pair of blocks)."""
    results = {}
    for variant, kind in kinds.items():
        if not all(rounds[(variant, loop)] for loop in LOOPS):
            continue
        entry = dict(kind)
        for loop in LOOPS:
            mean, conf = summary(iters[(variant, loop)])
            entry[loop] = {"img_sec_per_device": mean, "img_sec_per_device_conf": conf,
                           "total_img_sec": size * mean,
                           "img_sec_median_of_rounds": statistics.median(rounds[(variant, loop)]),
                           "rounds": rounds[(variant, loop)], "iters": iters[(variant, loop)]}
        ratios = [h / p for h, p in zip(rounds[(variant, "hvdtrain")], rounds[(variant, "plain")])]
        entry.update(round_ratios=ratios, ratio=statistics.median(ratios), ratio_min=min(ratios),
                     ratio_max=max(ratios), ratio_of_means=(entry["hvdtrain"]["img_sec_per_device"]
                                                            / entry["plain"]["img_sec_per_device"]))
        entry["meets_target"] = entry["ratio"] >= TARGET_RATIO
        results[variant] = entry
    return results


def print_results(log, results: dict, unit: str, size: int, loop_name) -> None:
    """Horovod's summary lines per variant and loop (``loop_name(variant, loop)`` names it),
    the ratio with its spread, then one Markdown table."""
    for variant, entry in results.items():
        for loop in LOOPS:
            e = entry[loop]
            log(f"{variant}, {loop_name(variant, loop)}:")
            log(f"Img/sec per {unit}: {e['img_sec_per_device']:.1f} "
                f"+-{e['img_sec_per_device_conf']:.1f}")
            log(f"Total img/sec on {size} {unit}(s): {e['total_img_sec']:.1f} "
                f"+-{size * e['img_sec_per_device_conf']:.1f}")
        log(f"Ratio hvdtrain / plain ({variant}): {entry['ratio']:.3f} (median of "
            f"{len(entry['round_ratios'])} round(s), min {entry['ratio_min']:.3f}, max "
            f"{entry['ratio_max']:.3f}; target >= {TARGET_RATIO}: "
            f"{'met' if entry['meets_target'] else 'NOT met'})")
    log("")
    log(f"| variant | plain img/s per {unit} | hvdtrain img/s per {unit} "
        "| hvdtrain / plain: median of rounds (min-max) |")
    log("|---|---|---|---|")
    for variant, e in results.items():
        log(f"| {variant} | {e['plain']['img_sec_median_of_rounds']:,.1f} | "
            f"{e['hvdtrain']['img_sec_median_of_rounds']:,.1f} | {e['ratio']:.3f} "
            f"({e['ratio_min']:.3f}-{e['ratio_max']:.3f}) |")


def write_json(path: str | Path, report: dict) -> None:
    """``report`` to ``path`` (folders made), atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
