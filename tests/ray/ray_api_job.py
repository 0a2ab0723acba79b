"""A driver for tests/ray/test_ray_engine.py: a Ray Train ``DataParallelTrainer`` with
hvdtrain's ``HorovodConfig`` on the test cluster; each worker does a Horovod all-reduce and
writes what it saw to OUT_DIR/rank{R}.json.

    python ray_api_job.py RAY_ADDRESS STORAGE_PATH OUT_DIR
"""
import json
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from hvdtrain.ray import HorovodConfig


def train_fn(config):
    import os
    from pathlib import Path

    import horovod.torch as hvd
    import torch

    import ray.train
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    seen = {"sum": total, "rank": hvd.rank(), "size": hvd.size(),
            "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_size": hvd.cross_size(), "gloo": bool(hvd.gloo_enabled()),
            "ray_world_rank": ray.train.get_context().get_world_rank(),
            "engine": os.environ.get("HVDTRAIN_ENGINE"),
            "rendezvous": os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
            "iface": os.environ.get("HOROVOD_GLOO_IFACE"), "pid": os.getpid(),
            "home": str(Path.home()), "auth_mode": os.environ.get("RAY_AUTH_MODE"),
            "keras_home": os.environ.get("KERAS_HOME")}
    Path(config["out"], f"rank{hvd.rank()}.json").write_text(json.dumps(seen))
    ray.train.report({"sum": total})


if __name__ == "__main__":
    address, storage, out = sys.argv[1:4]
    ray.init(address=address, logging_level="WARNING")
    DataParallelTrainer(train_fn, train_loop_config={"out": out},
                        backend_config=HorovodConfig(),
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="api", storage_path=storage)).fit()
