"""Run a command (``hvdtrain train ...``) as Horovod ranks on a Ray Train worker group: the
training function each worker runs, the resource check before Ray starts the group, and the
trainer that ties them together (:func:`run_command`)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from hvdtrain.launch import ranks
from hvdtrain.launch.engine_args import engine_refusal, train_config, with_resume_auto
from hvdtrain.ray.backend import ATTEMPT_VAR, HorovodConfig


class NotEnoughResourcesError(RuntimeError):
    """The Ray cluster has fewer CPUs than the ranks need (the message says how many it has)."""


class RayJobError(RuntimeError):
    """The ranks failed and Ray gave up (after ``max_failures`` restarts of the group)."""


def check_resources(num_workers: int, cpus_per_worker: float = 1.0) -> None:
    """Fail fast where Ray would wait forever: the connected cluster must have
    ``num_workers * cpus_per_worker`` CPUs in all, and its alive nodes room for ``num_workers``
    ranks of ``cpus_per_worker`` CPUs each (a rank's CPUs are on one node).

    Raises:
        NotEnoughResourcesError: it has fewer (the message says how many, on how many nodes).
        ValueError: ``num_workers`` < 1.
    """
    import ray
    if num_workers < 1:
        raise ValueError(f"the number of ranks must be >= 1, not {num_workers}")
    have = ray.cluster_resources().get("CPU", 0.0)
    need = num_workers * cpus_per_worker
    nodes = [n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    if have < need:
        raise NotEnoughResourcesError(
            f"{num_workers} ranks need {need:g} CPUs ({cpus_per_worker:g} each) in the Ray "
            f"cluster at once; it has {have:g} ({len(nodes)} node(s)). Use fewer ranks or add "
            "nodes.")
    # in Ray's own unit of a resource, 1/10000 (exact: 1 // 0.1 is 9.0 in floats)
    units = round(cpus_per_worker * 10_000)
    room = sum(round(cpus * 10_000) // units for cpus in nodes) if units > 0 else num_workers
    if room < num_workers:
        raise NotEnoughResourcesError(
            f"{num_workers} ranks of {cpus_per_worker:g} CPUs each need that many CPUs on one "
            f"node per rank; the Ray cluster's {len(nodes)} node(s) have "
            f"{', '.join(f'{c:g}' for c in nodes)} CPUs: room for {room}. Lower "
            "--cpus-per-rank (cpus_per_worker=), use fewer "
            "ranks, or add larger nodes.")


def restart_argv(command: list[str], attempt: int) -> list[str]:
    """``command`` for start ``attempt`` of the group: from the first restart on, ``hvdtrain
    train`` without a ``--resume`` gets ``--resume auto`` (continue from the last checkpoint in
    its ``--output-dir``)."""
    return with_resume_auto(command) if attempt > 0 else list(command)


def command_loop(config: dict) -> None:
    """The training function of each Ray worker: run ``config["command"]`` as this worker's
    Horovod rank (a child process with the ``HOROVOD_*`` variables :class:`HorovodConfig` set),
    rank 0's output to this worker's stdout (Ray forwards it to the driver); then report to
    Ray Train once, rank 0 with the run's final numbers (``final_test_accuracy``,
    ``final_test_loss``) and its last checkpoint (:func:`checkpoint_files`) as Ray's checkpoint.

    Raises:
        RuntimeError: the rank exited non-zero (Ray then restarts the group or gives up).
    """
    import ray.train
    attempt = int(os.environ.get(ATTEMPT_VAR, "0"))
    rank = int(os.environ["HOROVOD_RANK"])
    argv = restart_argv(config["command"], attempt)
    cwd = config.get("cwd") if config.get("cwd") and os.path.isdir(config["cwd"]) else None

    def sink(chunk: bytes) -> None:
        # To the worker's stdout file itself (Ray forwards it to the driver), past Ray Train's
        # patched sys.stdout, which would log each line a second time.
        os.write(1, chunk)

    proc = ranks.RankProcess(argv, dict(os.environ), sink if rank == 0 else None, cwd=cwd)
    try:
        code = proc.wait()
    finally:
        proc.kill()
    if code != 0:
        raise RuntimeError(f"rank {rank} ({' '.join(argv[:2])}) {ranks.describe_exit(code)} "
                           f"(start {attempt} of the group); its last output:\n"
                           f"{proc.tail_text()[-2000:]}")
    metrics = {"exit_code": 0, "attempt": attempt}
    try:  # as hvdtrain train read it (its default, abbreviations); checked on the driver
        train = train_config(argv)
    except (SystemExit, Exception):  # noqa: BLE001 - another hvdtrain's options: no report
        train = None
    path = Path(cwd or ".", train.output_dir) if train is not None else None
    if rank != 0 or path is None or not (path / "metrics.json").exists():
        ray.train.report(metrics)  # every worker reports: it is a barrier
        return
    m = json.loads((path / "metrics.json").read_text())
    metrics.update({k: m[k] for k in ("final_test_accuracy", "final_test_loss")
                    if isinstance(m.get(k), (int, float))})
    with tempfile.TemporaryDirectory(prefix="hvdtrain-ray-ckpt-") as tmp:
        for f in checkpoint_files(path):
            shutil.copy2(f, tmp)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def checkpoint_files(output_dir: Path) -> list[Path]:
    """What rank 0 reports to Ray Train as the run's checkpoint: the last ``hvdtrain train``
    checkpoint in ``output_dir`` (``checkpoint.*``, not the previous one ``checkpoint.prev.*``)
    and ``metrics.json``."""
    return sorted(f for f in output_dir.iterdir() if f.is_file() and (
        f.name == "metrics.json" or (f.name.startswith("checkpoint.") and ".prev." not in f.name)))


def run_command(command: list[str], num_workers: int, *, max_failures: int = 0,
                storage_path: str | None = None, name: str | None = None,
                env: dict[str, str] | None = None, nics: list[str] | None = None,
                cpus_per_worker: float = 1.0):
    """Run ``command`` as ``num_workers`` Horovod ranks on the connected Ray cluster (call
    ``ray.init`` first), one Ray Train worker each, as ``horovodrun -np N command`` would.

    Args:
        command: argv, e.g. ``["hvdtrain", "train", "--dataset", "digits"]``.
        num_workers: ranks.
        max_failures: restarts of the whole group Ray may make after a failure; a restarted
            ``hvdtrain train`` resumes from the last checkpoint in its ``--output-dir``.
        storage_path: Ray Train's storage for the run (default: Ray's, ``~/ray_results``).
        name: the run's name in that storage (default: Ray's).
        env: extra environment variables for every rank.
        nics: the network interface for Gloo (of several, the first; default: the one of each
            node's address).
        cpus_per_worker: CPUs Ray reserves per rank.

    Returns:
        Ray Train's ``Result`` (``metrics``: rank 0's report; ``checkpoint``: its last
        ``hvdtrain train`` checkpoint and ``metrics.json``, for a ``hvdtrain train`` command).

    Raises:
        NotEnoughResourcesError: the cluster has too few CPUs (before anything starts).
        RayJobError: the ranks failed ``max_failures + 1`` times.
        ValueError: ``command`` is empty, ``num_workers`` < 1, or ``command`` is ``hvdtrain
            train --elastic`` (before anything starts:
            :func:`hvdtrain.launch.engine_args.engine_refusal`).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    if not command:
        raise ValueError("no command to run: give it after --, e.g. -- hvdtrain train")
    problem = engine_refusal(list(command), "Ray")
    if problem:
        raise ValueError(problem)
    check_resources(num_workers, cpus_per_worker)
    trainer = DataParallelTrainer(
        command_loop,
        train_loop_config={"command": list(command), "cwd": os.getcwd()},
        backend_config=HorovodConfig(nics=list(nics) if nics else None, env=dict(env or {})),
        scaling_config=ScalingConfig(num_workers=num_workers,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)))
    try:
        return trainer.fit()
    except Exception as exc:
        if type(exc).__name__ in ("TrainingFailedError", "WorkerGroupError", "ControllerError"):
            raise RayJobError(str(exc)) from exc
        raise
