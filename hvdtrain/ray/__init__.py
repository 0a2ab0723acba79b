"""Horovod on Ray: a Ray Train backend (:class:`HorovodConfig`) that starts Horovod on a
``DataParallelTrainer``'s workers, and the ``hvdtrain train`` job on a Ray cluster::

    from ray.train import RunConfig, ScalingConfig, FailureConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    from hvdtrain.ray import HorovodConfig

    def train_fn(config):
        import horovod.torch as hvd
        hvd.init()                     # the backend has set horovodrun's HOROVOD_* variables
        ...

    DataParallelTrainer(train_fn, backend_config=HorovodConfig(),
                        scaling_config=ScalingConfig(num_workers=2)).fit()

    python -m hvdtrain.ray -np 2 --address 127.0.0.1:6379 -- hvdtrain train --dataset mnist

Needs ``pip install hvdtrain[ray]`` (Ray Train V2, ray 2.60) on the driver and every node.
``import hvdtrain`` does not import this package, and this package imports ray only when one of
its names is used. docs/engines/ray.md has the set-up, the fault behaviour and the migration
from Horovod's ``RayExecutor`` and Ray's ``HorovodTrainer``.
"""
from __future__ import annotations

__all__ = ["HorovodConfig", "HorovodBackend", "run_command", "check_resources",
           "NotEnoughResourcesError", "RayJobError"]


def __getattr__(name: str):
    if name in ("HorovodConfig", "HorovodBackend"):
        from hvdtrain.ray import backend
        return getattr(backend, name)
    if name in ("run_command", "check_resources", "NotEnoughResourcesError", "RayJobError"):
        from hvdtrain.ray import job
        return getattr(job, name)
    raise AttributeError(f"module 'hvdtrain.ray' has no attribute {name!r}")
