"""Published scaling results that ``benchmarks/plan_check.py`` predicts, held apart from the
inputs: each prediction uses only the published one-GPU throughput, the model's parameter count,
the published machine and network, and the run's Horovod settings, and is printed before the
published figure it is compared with.

Sources (``PUBLISHED_SOURCES``): the Horovod paper and README (2017-18, Pascal GPUs over 25 GbE),
TensorFlow's 2017 K80 benchmarks (parameter servers), and NVIDIA's DeepLearningExamples
(2020-21, Horovod with NCCL in NGC containers: ResNet-50 v1.5 on one DGX, BERT-Large
pre-training on up to 32 DGX A100 with gradient accumulation).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdtrain.scaling import clusters, measure  # noqa: E402
from hvdtrain.scaling.model import (MiB, Cluster, ComputeProfile, HorovodSettings,  # noqa: E402
                                    efficiency, predict_step, with_settings)

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


def predict_eff(prof, n: int, c: Cluster, settings: HorovodSettings = HOROVOD_2017):
    """``(prediction at n ranks, scaling efficiency against one rank)``."""
    pred = predict_step(prof, n, c, settings)
    return pred, efficiency(pred, predict_step(prof, 1, c, settings))


def smallest_fraction(reaches) -> float:
    """The smallest fraction f in [0.001, 1] of the network bandwidth with ``reaches(f)`` true,
    for ``reaches`` that turns true once and stays so as f grows (bisection, 40 halvings)."""
    lo, hi = 1e-3, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


def implied_fraction(prof, n, c, target_eff) -> float | None:
    """The fraction of the cluster's network bandwidth at which the model gives ``target_eff``
    at ``n`` ranks (None when even the full bandwidth gives less)."""
    def eff(f):
        return predict_eff(prof, n, replace(c, inter_bw=c.inter_bw * f))[1]
    if n <= c.ranks_per_host or eff(1.0) < target_eff:
        return None  # one host: no network to blame
    return smallest_fraction(lambda f: eff(f) >= target_eff)


def check_2017() -> list[dict]:
    """The Horovod paper, its README's 512-GPU figures and TensorFlow's K80 benchmarks."""
    rows = []
    for source, model, preset, n, published in PUBLISHED:
        prof = published_profile(model, P100[model], 64)
        c = clusters.PRESETS[preset]
        pred, eff = predict_eff(prof, n, c)
        curve = {m: predict_eff(prof, m, c)[1]
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
            base = clusters.PRESETS["pcie-25gbe"]
            tcp_fraction = smallest_fraction(lambda f: rdma.samples_per_s / predict_step(
                prof, 128, replace(base, inter_bw=base.inter_bw * f),
                HOROVOD_2017).samples_per_s <= 1.30)
        rows.append({"source": "horovod-paper-fig7", "model": model, "ranks": 128,
                     "predicted_ratio": ratio, "published_ratio": published,
                     "implied_tcp_fraction": tcp_fraction})
    # The K80 runs are TensorFlow's parameter-server update, not Horovod: predicted as if it
    # were Horovod, and with nothing overlapped (every gradient sent once the backward pass is
    # over, as when a host first sums its 8 GPUs' gradients and then pushes the sum).
    for model, table in K80_TABLE.items():
        thr, batch = K80[model]
        prof = published_profile(model, thr, batch)
        at_end = measure.all_ready_at_end(prof)
        single = predict_step(prof, 1, P2_8XLARGE, HOROVOD_2017)
        for n, total in table.items():
            eff = efficiency(predict_step(prof, n, P2_8XLARGE, HOROVOD_2017), single)
            eff_serial = efficiency(predict_step(at_end, n, P2_8XLARGE, HOROVOD_2017), single)
            print(f"  predict {model:<10} p2.8xlarge       N={n:<4}: efficiency {eff:6.1%}; "
                  f"nothing overlapped {eff_serial:6.1%}")
            rows.append({"source": "tf-k80-distributed", "model": model, "cluster": "p2.8xlarge",
                         "ranks": n, "predicted": eff, "published": total / (n * thr),
                         "predicted_no_overlap": eff_serial,
                         "implied_net_fraction": implied_fraction(prof, n, P2_8XLARGE,
                                                                  total / (n * thr))})
    return rows


# NVIDIA DeepLearningExamples, read at commit 729963dd47e7c8bd462ad10bfac7a7b0b604e6dd (both
# READMEs last changed in 9de48bc9ca8ce635960620478a39dd332ed74ff6). TensorFlow 1 + Horovod with
# NCCL in the NGC 20.06 containers, whose Horovod (0.19) still had the 2017 defaults above.
DLE = "NVIDIA/DeepLearningExamples (commit 9de48bc9), "
PUBLISHED_SOURCES.update({
    "dle-resnet50-tf1": DLE + "TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "
                        "'Training performance' on DGX A100 (8x A100 40GB), DGX-1 (8x V100 16G), "
                        "DGX-2 (16x V100 32G): 1 GPU vs all GPUs of one machine, images/s "
                        "averaged over an epoch, XLA, hvd.DistributedOptimizer defaults",
    "dle-bert-tf1": DLE + "TensorFlow/LanguageModeling/BERT/README.md, 'Pre-training training "
                    "performance: multi-node on DGX A100 40GB' (seq 128, batch 64 per GPU, "
                    "global batch 65,536 by gradient accumulation, all-reduce after the last "
                    "micro-batch, fp16 compression with AMP) and the single-node table's 1-GPU "
                    "row; BERT-Large 330 M parameters (the README)",
})
# (machine, cluster, GPUs, batch per GPU, precision, 1-GPU img/s, all-GPU img/s)
DGX2 = Cluster("dgx-2", 16, 130e9, 2e-6, clusters.PRESETS["nvlink-ib100"].inter_bw * 8, 3e-6,
               True, "16 V100 on NVSwitch (NVLink 2, ~130 GB/s busbw), 8 x 100 Gb/s InfiniBand")
DLE_RESNET50 = [
    ("DGX A100", "nvlink-ib200x8", 8, 256, "TF32", 909, 7000),
    ("DGX A100", "nvlink-ib200x8", 8, 256, "AMP", 2375, 17400),
    ("DGX-1", "nvlink-ib100", 8, 128, "FP32", 412, 3170),
    ("DGX-1", "nvlink-ib100", 8, 256, "AMP", 1270, 9510),
    ("DGX-2", "dgx-2", 16, 128, "FP32", 432, 6500),
    ("DGX-2", "dgx-2", 16, 256, "AMP", 1300, 17250),
]
# BERT-Large, DGX A100 (8 GPUs per node), seq 128, 64 sequences per GPU per micro-batch:
# GPUs -> (gradient accumulation k, TF32 sequences/s, AMP sequences/s). 1 GPU: the single-node
# table's row; 8-256 GPUs: the multi-node table (1, 4, 16, 32 nodes).
DLE_BERT = {1: (1024, 238.10, 356.845), 8: (128, 1889.71, 2871.89), 32: (32, 7532.00, 11159),
            128: (8, 28605.62, 41144), 256: (4, 53585.82, 77479.87)}
BERT_PARAMS = 330e6
BERT_FIT_AT = 32  # the one multi-node point whose per-step cost is fitted (the rest held out)


def check_dle_resnet50() -> list[dict]:
    """ResNet-50 v1.5 on one DGX: all GPUs against one. The model's communication is under a
    millisecond of a 100-300 ms step there, so ``extra_ms`` (published step time less the
    predicted one) is what one host's ranks lose outside the all-reduce."""
    rows = []
    for machine, preset, n, batch, precision, one, total in DLE_RESNET50:
        c = DGX2 if preset == "dgx-2" else clusters.PRESETS[preset]
        prof = published_profile("resnet50", one, batch)
        pred, eff = predict_eff(prof, n, c)
        model = f"resnet50 {precision}"
        print(f"  predict {model:<14} {machine:<9} N={n:<3}: efficiency {eff:6.1%} (comm "
              f"{pred.comm_s * 1e3:5.2f} ms, exposed {pred.exposed_s * 1e3:5.2f} ms of a "
              f"{pred.step_s * 1e3:6.1f} ms step)")
        published_step = batch * n / total
        rows.append({"source": "dle-resnet50-tf1", "model": model, "cluster": f"{machine} "
                     f"({c.name})", "ranks": n, "batch": batch, "predicted": eff,
                     "published": total / (n * one), "comm_ms": pred.comm_s * 1e3,
                     "step_ms": pred.step_s * 1e3,
                     "extra_ms": (published_step - pred.step_s) * 1e3})
    return rows


def bert_profile(throughput: float, overhead_s: float = 0.0) -> ComputeProfile:
    """BERT-Large at 64 sequences per micro-batch: 24 equal layers, every gradient all-reduced
    after the last micro-batch (TF1 accumulates into variables, then all-reduces), plus a
    per-step cost ``overhead_s`` (the optimizer step and the accumulators' upkeep)."""
    prof = measure.all_ready_at_end(measure.profile_from_step_time(
        64 / throughput, 64, [(measure.even_tensors(int(BERT_PARAMS * 4), 24 * 16), 1.0)],
        source=f"published {throughput:.1f} sequences/s"))
    return replace(prof, optimizer_s=overhead_s)


def bert_settings(n: int, compression: str) -> HorovodSettings:
    """Horovod's settings of the BERT run at ``n`` GPUs: the defaults of then, its k."""
    return with_settings(HOROVOD_2017, compression=compression,
                         backward_passes_per_step=DLE_BERT[n][0])


def check_dle_bert() -> list[dict]:
    """BERT-Large pre-training at a fixed global batch: k falls from 1,024 (1 GPU) to 4 (256
    GPUs), so the per-step costs that do not shrink with k weigh more at scale. Predicted twice:
    with the published inputs alone, and with one per-step cost fitted at ``BERT_FIT_AT`` GPUs
    (the model's ``optimizer_s``) and held fixed for the other N."""
    c = clusters.PRESETS["nvlink-ib200x8"]
    rows = []
    for precision, col, compression in (("TF32", 1, "none"), ("AMP", 2, "fp16")):
        one = DLE_BERT[1][col]

        def eff_at(n, overhead_s):
            prof = bert_profile(one, overhead_s)
            pred = predict_step(prof, n, c, bert_settings(n, compression))
            return pred, efficiency(pred, predict_step(prof, 1, c, bert_settings(1, compression)))
        k_fit, _, _ = DLE_BERT[BERT_FIT_AT]
        pred_fit, _ = eff_at(BERT_FIT_AT, 0.0)
        published_step = k_fit * 64 * BERT_FIT_AT / DLE_BERT[BERT_FIT_AT][col]
        overhead = max(0.0, published_step - pred_fit.step_s)
        print(f"  fitted  bert-large {precision}: a per-step cost of {overhead * 1e3:.0f} ms "
              f"makes N={BERT_FIT_AT} match")
        for n, (k, *thr) in DLE_BERT.items():
            if n == 1:
                continue
            pred, eff = eff_at(n, 0.0)
            _, eff_fitted = eff_at(n, overhead)
            print(f"  predict bert-large {precision:<4} DGX A100  N={n:<3} k={k:<4}: efficiency "
                  f"{eff:6.1%} (comm {pred.comm_s * 1e3:5.1f} ms of a {pred.step_s * 1e3:7.1f} "
                  f"ms step); with the fitted per-step cost {eff_fitted:6.1%}")
            rows.append({"source": "dle-bert-tf1", "model": f"bert-large {precision}",
                         "cluster": "DGX A100 (nvlink-ib200x8)", "ranks": n, "k": k,
                         "predicted": eff, "published": thr[col - 1] / (n * one),
                         "predicted_with_step_cost": None if n == BERT_FIT_AT else eff_fitted,
                         "fitted_step_cost_ms": overhead * 1e3, "comm_ms": pred.comm_s * 1e3,
                         "step_ms": pred.step_s * 1e3})
    return rows


def check_published() -> list[dict]:
    """Every published comparison, in the order printed: 2017 results, then NVIDIA's."""
    return check_2017() + check_dle_resnet50() + check_dle_bert()
