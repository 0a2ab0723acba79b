"""``hvdtrain plan``: predict a data-parallel job's speed at N ranks before running it.

:mod:`hvdtrain.scaling.model` is the cost model (pure functions: ring all-reduce, hierarchical
all-reduce, Tensor Fusion, overlap with the backward pass, k micro-batches, fp16 compression),
:mod:`hvdtrain.scaling.clusters` the cluster presets, :mod:`hvdtrain.scaling.measure` the
compute profiles (measured with PyTorch, or from a given step time), :mod:`hvdtrain.scaling.plan`
the table and the recommended settings, :mod:`hvdtrain.scaling.cli` the command. Importing this
package imports no framework.
"""
from hvdtrain.scaling.model import (Bucket, Cluster, ComputeProfile, Gradient, HorovodSettings,
                                    StepPrediction, allreduce_seconds, efficiency, fuse,
                                    predict_step, ring_allreduce_seconds, schedule)

__all__ = ["Bucket", "Cluster", "ComputeProfile", "Gradient", "HorovodSettings",
           "StepPrediction", "allreduce_seconds", "efficiency", "fuse", "predict_step",
           "ring_allreduce_seconds", "schedule"]
