"""The plan: predictions for N = 1, 2, 4, ... ranks and the settings worth changing.

Pure functions over :mod:`hvdtrain.scaling.model`; :mod:`hvdtrain.scaling.cli` measures and
prints.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from hvdtrain.scaling.model import (MiB, Cluster, ComputeProfile, HorovodSettings,
                                    StepPrediction, efficiency, predict_step, with_settings)

K_CHOICES = (1, 2, 4, 8)
THRESHOLD_CHOICES_MIB = (1, 4, 16, 64, 128)
# A recommendation must gain at least this much (predicted samples/s) to be shown.
MIN_GAIN = 0.02


def ranks_list(max_ranks: int) -> list[int]:
    """1, 2, 4, ... up to and including ``max_ranks`` (which need not be a power of two).

    Raises:
        ValueError: ``max_ranks`` < 1.
    """
    if max_ranks < 1:
        raise ValueError(f"the largest rank count must be >= 1, got {max_ranks}")
    out, n = [], 1
    while n < max_ranks:
        out.append(n)
        n *= 2
    return out + [max_ranks]


@dataclass
class Recommendation:
    """One setting changed from the baseline, and what the model predicts it gains."""
    setting: str  # "backward_passes_per_step" | "fusion_threshold" | "compression" | "hierarchical"
    value: object
    samples_per_s: float
    gain: float  # relative to the baseline's samples/s: 0.10 = +10 %
    note: str = ""


@dataclass
class PlanRow:
    """The prediction at one N with the baseline settings, and the changes that help."""
    ranks: int
    hosts: int
    prediction: StepPrediction
    efficiency: float
    recommendations: list[Recommendation] = field(default_factory=list)
    best: Recommendation | None = None

    def as_dict(self) -> dict:
        p = self.prediction
        return {"ranks": self.ranks, "hosts": self.hosts, "step_ms": p.step_s * 1e3,
                "samples_per_s": p.samples_per_s, "efficiency": self.efficiency,
                "comm_ms": p.comm_s * 1e3, "exposed_ms": p.exposed_s * 1e3,
                "overlap": p.overlap, "allreduces": len(p.buckets),
                "straggler_ms": p.straggler_s * 1e3,
                "recommendations": [asdict(r) for r in self.recommendations],
                "best": asdict(self.best) if self.best else None}


def candidates(settings: HorovodSettings, multi_host: bool) -> list[tuple[str, object,
                                                                          HorovodSettings]]:
    """The one-setting changes tried: k, fusion threshold, fp16 compression, hierarchical."""
    out = [("backward_passes_per_step", k, with_settings(settings, backward_passes_per_step=k))
           for k in K_CHOICES if k != settings.backward_passes_per_step]
    out += [("fusion_threshold", f"{mib} MiB", with_settings(settings, fusion_threshold=mib * MiB))
            for mib in THRESHOLD_CHOICES_MIB if mib * MiB != settings.fusion_threshold]
    if settings.compression == "none":
        out.append(("compression", "fp16", with_settings(settings, compression="fp16")))
    if multi_host and not settings.hierarchical:
        out.append(("hierarchical", True, with_settings(settings, hierarchical=True)))
    return out


NOTES = {
    "backward_passes_per_step": "global batch x k: rescale the learning rate "
                                "(docs: LR scaling)",
    "compression": "fp16 gradients on the wire: check accuracy",
}


def plan(profile_for: Callable[[int], ComputeProfile], cluster: Cluster, ranks: list[int],
         settings: HorovodSettings = HorovodSettings()) -> list[PlanRow]:
    """Predict each N of ``ranks`` and the single changes of setting that gain >= 2 %.

    Args:
        profile_for: N -> the compute profile of one rank at N ranks (the same profile for
            every N on GPUs; on a CPU host the ranks share the cores).
        cluster: the machines.
        ranks: the N to predict; efficiency is relative to N = 1 with the same settings.
        settings: the baseline Horovod settings.

    Returns:
        one :class:`PlanRow` per N; ``best`` is the best of all single changes and their
        combination (best k with best threshold and compression, if each gains).
    """
    single = predict_step(profile_for(1), 1, cluster, settings)
    rows = []
    for n in ranks:
        profile = profile_for(n)
        base = predict_step(profile, n, cluster, settings)
        row = PlanRow(n, -(-n // cluster.ranks_per_host), base, efficiency(base, single))
        if n > 1:
            chosen: dict[str, tuple[object, HorovodSettings]] = {}
            for name, value, changed in candidates(settings, row.hosts > 1):
                pred = predict_step(profile, n, cluster, changed)
                gain = pred.samples_per_s / base.samples_per_s - 1
                if gain >= MIN_GAIN:
                    best_so_far = next((r for r in row.recommendations if r.setting == name), None)
                    rec = Recommendation(name, value, pred.samples_per_s, gain,
                                         NOTES.get(name, ""))
                    if best_so_far is None:
                        row.recommendations.append(rec)
                    elif rec.gain > best_so_far.gain:
                        row.recommendations[row.recommendations.index(best_so_far)] = rec
                    else:
                        continue
                    chosen[name] = (value, changed)
            if chosen:
                combined = settings
                for name, (_, changed) in chosen.items():
                    combined = with_settings(combined, **{
                        f: getattr(changed, f) for f in ("backward_passes_per_step",
                                                         "fusion_threshold", "compression",
                                                         "hierarchical")
                        if getattr(changed, f) != getattr(settings, f)})
                pred = predict_step(profile, n, cluster, combined)
                label = ", ".join(f"{k}={v}" for k, (v, _) in chosen.items())
                row.best = Recommendation("all of", label, pred.samples_per_s,
                                          pred.samples_per_s / base.samples_per_s - 1)
        rows.append(row)
    return rows


def format_table(rows: list[PlanRow]) -> str:
    """The plan as text: one line per N, then the recommendations."""
    head = (f"{'ranks':>5} {'hosts':>5} {'step ms':>9} {'samples/s':>11} {'eff':>6} "
            f"{'comm ms':>8} {'exposed':>8} {'overlap':>7} {'allreduces':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r.prediction
        lines.append(f"{r.ranks:>5} {r.hosts:>5} {p.step_s * 1e3:>9.2f} {p.samples_per_s:>11.1f} "
                     f"{r.efficiency:>6.1%} {p.comm_s * 1e3:>8.2f} {p.exposed_s * 1e3:>8.2f} "
                     f"{p.overlap:>7.0%} {len(p.buckets):>10}")
    lines.append("")
    lines.append("recommended (one change at a time, predicted gain in samples/s):")
    any_rec = False
    for r in rows:
        for rec in sorted(r.recommendations, key=lambda x: -x.gain):
            any_rec = True
            note = f"  ({rec.note})" if rec.note else ""
            lines.append(f"  N={r.ranks:<4} {rec.setting}={rec.value}: "
                         f"{rec.samples_per_s:,.1f} samples/s, {rec.gain:+.1%}{note}")
        if r.best and len(r.recommendations) > 1:
            lines.append(f"  N={r.ranks:<4} together ({r.best.value}): "
                         f"{r.best.samples_per_s:,.1f} samples/s, {r.best.gain:+.1%}")
    if not any_rec:
        lines.append("  none: no single change gains 2 % or more")
    return "\n".join(lines)
