"""A Ray Train backend that starts Horovod on the worker group, written on Ray's public
``Backend``/``BackendConfig`` API (Ray Train V2, ray 2.60).

When Ray has started (or restarted) the workers, :class:`HorovodBackend` asks each one for its
node, lays the Horovod ranks out contiguously per node as ``horovodrun`` does
(:func:`hvdtrain.launch.ranks.slot_plan`), starts Horovod's Gloo rendezvous in the Ray Train
controller's process, and sets ``horovodrun``'s Gloo ``HOROVOD_*`` variables in every worker, so
``hvd.init()`` in the training function joins the ring. Each (re)start of the group gets a new
rendezvous; ``HVDTRAIN_RAY_ATTEMPT`` tells the workers which start it is (0 first).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ray.train.backend import Backend, BackendConfig

from hvdtrain.launch import ranks

ENGINE = "ray"  # HVDTRAIN_ENGINE of the ranks, shown in the run header
ATTEMPT_VAR = "HVDTRAIN_RAY_ATTEMPT"  # 0 at the group's first start, then 1, 2, ... per restart


@dataclass
class HorovodConfig(BackendConfig):
    """Horovod (Gloo) for a Ray Train ``DataParallelTrainer``: pass it as ``backend_config``.

    Args:
        nics: the network interface for Gloo, e.g. ``["eth0"]`` (of several, the first, as
            Horovod's Gloo launcher takes); default: on each worker, the interface holding its
            Ray node's address (``lo`` for 127.0.0.1).
        env: extra environment variables set in every worker before training starts.
    """

    nics: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def backend_cls(self):
        return HorovodBackend

    def to_dict(self) -> dict:
        return {"nics": self.nics, "env": dict(self.env)}


def worker_node() -> tuple[str, str]:
    """(Ray node id, node IP address) of the calling Ray process: the address its node was
    started with (``ray start --node-ip-address``), as the cluster lists it."""
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node_id, node["NodeManagerAddress"]
    return node_id, ray.util.get_node_ip_address()


def setup_worker(slot, rendezvous_addr: str, port: int, nics: list[str] | None,
                 extra: dict[str, str], attempt: int) -> dict[str, str]:
    """In a Ray worker: set ``horovodrun``'s Gloo variables for ``slot`` (and ``extra``,
    ``HVDTRAIN_ENGINE=ray``, ``HVDTRAIN_RAY_ATTEMPT``) in ``os.environ``; returns them.

    Raises:
        ValueError: no interface holds this node's address and ``nics`` is not given.
    """
    _, ip = worker_node()
    iface = nics[0] if nics else ranks.iface_of(ip)
    env = ranks.rank_env(slot, rendezvous_addr, port, iface, ENGINE,
                         {**extra, ATTEMPT_VAR: str(attempt)})
    os.environ.update(env)
    return {k: v for k, v in env.items() if k.startswith(("HOROVOD_", "HVDTRAIN_"))}


class HorovodBackend(Backend):
    """Starts Horovod on each (re)start of the worker group; see the module's docstring.

    Ray creates it in the Train controller's process and calls ``on_start`` and
    ``on_shutdown`` around each group; the rendezvous lives from one to the other.

    With GPU workers every worker sees all the GPUs its node gives the group
    (``share_cuda_visible_devices``): a rank picks its own by local rank, as under
    ``horovodrun``, and NCCL's ranks of one node see each other's devices.
    """

    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config: HorovodConfig) -> None:
        self._stop_rendezvous()
        attempt = self.__dict__.get("_attempts", 0)
        self._attempts = attempt + 1
        nodes = worker_group.execute(worker_node)
        # Node ids, not addresses: two Ray nodes may share one address (tests on 127.0.0.1).
        plan = ranks.slot_plan([node_id for node_id, _ in nodes])
        host = worker_node()[1]  # the controller's node
        self._server = ranks.Rendezvous(host, plan)
        for i, slot in enumerate(plan):
            worker_group.execute_single(i, setup_worker, slot, host, self._server.port,
                                        backend_config.nics, dict(backend_config.env), attempt)

    def on_shutdown(self, worker_group, backend_config: HorovodConfig) -> None:
        self._stop_rendezvous()

    def _stop_rendezvous(self) -> None:
        server = self.__dict__.pop("_server", None)
        if server is not None:
            server.stop()
