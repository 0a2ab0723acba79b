"""Kubernetes manifests for ``hvdtrain launch --emit mpijob|trainjob``: the launch that
:func:`hvdtrain.launch.plan.plan` makes, as a Kubeflow MPI Operator v2 ``MPIJob``
(``kubeflow.org/v2beta1``) or a Kubeflow Trainer v2 ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``)
on an MPI runtime. Nothing here talks to a cluster; the manifests are plain dicts, dumped as YAML.

The operators' contract, and where each rule comes from (kubeflow/mpi-operator at v0.8.2:
``deploy/v2beta1/mpi-operator.yaml`` for the fields, ``pkg/controller/mpi_job_controller.go`` for
what the operator does; kubeflow/trainer: ``trainer.kubeflow.org_trainjobs.yaml`` in
``manifests/base/crds/`` and ``pkg/runtime/framework/plugins/mpi/mpi.go``):

- one launcher pod runs ``mpirun``; the worker pods (``mpiReplicaSpecs.Worker.replicas``, each
  with ``spec.slotsPerWorker`` slots) run ``sshd -De`` and are reached over SSH with a key the
  operator generates and mounts at ``spec.sshAuthMountPath`` (default ``/root/.ssh``);
- the hostfile is mounted at :data:`HOSTFILE_PATH`, one ``<job>-worker-<i>.<job>.<namespace>.svc
  slots=<slotsPerWorker>`` line per worker (:func:`operator_hostfile`);
- ``spec.launcherCreationPolicy: WaitForWorkersReady`` creates the launcher once every worker is
  Ready; ``spec.runPolicy.backoffLimit`` is the launcher Job's (a failed launcher pod, e.g. one
  whose ranks stopped with exit 75 after SIGTERM, is started again, up to that many times);
- a node drain or preemption sends SIGTERM to the pods' main processes and waits
  ``terminationGracePeriodSeconds`` before SIGKILL: the workers run ``sshd -De`` under
  ``hvdtrain worker`` (:data:`WORKER_COMMAND`, :mod:`hvdtrain.launch.pod`), which hands SIGTERM
  to the ranks in the pod and waits for their stop checkpoint before sshd ends.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from hvdtrain.launch.engine_args import output_dir_of, with_resume_auto
from hvdtrain.launch.signals import LAUNCH_ID_VAR

MPIJOB_API = "kubeflow.org/v2beta1"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
EMIT_KINDS = ("mpijob", "trainjob")
# Where both operators mount the hostfile (mpi-operator configMountPath/hostfileName; trainer
# constants.MPIHostfileDir/MPIHostfileName).
HOSTFILE_PATH = "/etc/mpi/hostfile"
# The project's images (docker/Dockerfile.cpu, .gpu) run as root with sshd; the operator's default.
SSH_AUTH_MOUNT_PATH = "/root/.ssh"
IMAGE_ENV = ("PATH", "LD_LIBRARY_PATH")  # the image's own; mpirun forwards them (-x)
OUTPUT_VOLUME = "hvdtrain-output"  # --pvc's volume in the pod templates
# The workers' main process: the operator's sshd, under hvdtrain worker, which hands a pod's
# SIGTERM to the ranks in it and waits for their stop checkpoint (hvdtrain.launch.pod).
WORKER_COMMAND = ("hvdtrain", "worker", "--", "/usr/sbin/sshd", "-De")


class ManifestError(ValueError):
    """A manifest that cannot be written as asked; the message says what to change (exit 2)."""


@dataclass
class KubeOptions:
    """What ``hvdtrain launch --emit`` adds to the plan.

    Attributes:
        kind: ``mpijob`` or ``trainjob``.
        name: the job's name (a DNS label: the operator names pods and the Service after it).
        image: the container image of every pod (the project's docker/Dockerfile.cpu or .gpu).
        slots_per_worker: ranks per worker pod (Open MPI slots).
        cpus_per_worker: CPU cores each worker asks for (requests = limits); threads per rank are
            ``cpus_per_worker // slots_per_worker`` (``OMP_NUM_THREADS``): inside a container a
            rank cannot see its CPU limit (its affinity mask is the node's), so it is set here.
        memory_per_worker: e.g. ``8Gi``; None leaves memory unset.
        gpu: one GPU per rank: each worker asks for ``slots_per_worker`` ``nvidia.com/gpu``.
        pvc: a PersistentVolumeClaim mounted at ``output_dir`` on every worker (rank 0 writes the
            checkpoints there; ``--resume auto`` finds them after a restart).
        output_dir: the training command's ``--output-dir``.
        grace_s: ``terminationGracePeriodSeconds``: time for the stop checkpoint after SIGTERM.
        backoff_limit: launcher restarts (``runPolicy.backoffLimit``).
        runtime: the TrainJob's ``ClusterTrainingRuntime`` (an MPI one).
    """
    kind: str
    name: str
    image: str
    slots_per_worker: int
    cpus_per_worker: int
    memory_per_worker: str | None = None
    gpu: bool = False
    pvc: str | None = None
    output_dir: str = "runs/latest"
    grace_s: int = 300
    backoff_limit: int = 3
    runtime: str = "mpi-distributed"


def check(opts: KubeOptions, np_: int) -> int:
    """Check ``opts`` against ``np_`` ranks before anything is written.

    Returns:
        The number of worker pods, ``np_ // slots_per_worker``.

    Raises:
        ManifestError: an unknown kind, no image, a name that is not a DNS label, slots or CPUs
            below 1, ``np_`` not a multiple of the slots, fewer CPUs than slots, a grace period
            or backoff limit below 0, a relative output dir with --pvc.
    """
    import re
    if opts.kind not in EMIT_KINDS:
        raise ManifestError(f"--emit {opts.kind!r} is not known; write --emit mpijob "
                            "(Kubeflow MPI Operator v2) or --emit trainjob (Kubeflow Trainer v2)")
    if not opts.image:
        raise ManifestError("--emit needs --image: the image every pod runs, built from "
                            "docker/Dockerfile.cpu or docker/Dockerfile.gpu and pushed, e.g. "
                            "--image registry.example.com/hvdtrain:cpu")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", opts.name):
        raise ManifestError(f"--job-name {opts.name!r} is not a DNS label of at most 40 "
                            "characters (lower-case letters, digits, '-'; starting with a "
                            "letter): pods and the Service are named after it, e.g. "
                            "--job-name hvdtrain-mnist")
    if opts.slots_per_worker < 1:
        raise ManifestError(f"--slots-per-worker must be at least 1, got {opts.slots_per_worker}")
    if np_ % opts.slots_per_worker:
        raise ManifestError(f"-np {np_} is not a multiple of {opts.slots_per_worker} slots per "
                            f"worker: every worker pod runs the same number of ranks; write e.g. "
                            f"-np {max(1, np_ // opts.slots_per_worker) * opts.slots_per_worker} "
                            "or change --slots-per-worker")
    if opts.cpus_per_worker < opts.slots_per_worker:
        raise ManifestError(f"--cpus-per-worker {opts.cpus_per_worker} is fewer than the "
                            f"{opts.slots_per_worker} ranks per worker; give each rank a core, "
                            f"e.g. --cpus-per-worker {opts.slots_per_worker}")
    if opts.grace_s < 0 or opts.backoff_limit < 0:
        raise ManifestError("--grace-period-s and --backoff-limit must be >= 0")
    if opts.pvc and not opts.output_dir.startswith("/"):
        raise ManifestError(f"--pvc mounts a volume at the command's --output-dir, which is "
                            f"relative ({opts.output_dir!r}); give the command an absolute one, "
                            "e.g. --output-dir /data/runs/mnist")
    return np_ // opts.slots_per_worker


def job_command(command: list[str]) -> list[str]:
    """``command`` with ``--resume auto`` added when it is ``hvdtrain train`` without
    ``--resume``: a launcher the operator starts again continues from the last checkpoint."""
    return with_resume_auto(command)


def worker_host(name: str, index: int, namespace: str = "default") -> str:
    """Worker ``index``'s host name in the operator's hostfile (mpi-operator ``newConfigMap``)."""
    return f"{name}-worker-{index}.{name}.{namespace}.svc"


def operator_hostfile(name: str, workers: int, slots: int, namespace: str = "default") -> str:
    """The hostfile the MPI Operator mounts at :data:`HOSTFILE_PATH` (Open MPI's form)."""
    return "".join(f"{worker_host(name, i, namespace)} slots={slots}\n" for i in range(workers))


def launcher_argv(plan_argv: list[str], root: bool = True) -> list[str]:
    """The plan's ``mpirun`` command line for the launcher pod: its hosts as the operator's
    hostfile (``--hostfile /etc/mpi/hostfile``, the same hosts and slots) and
    ``--allow-run-as-root`` when the pods run as root (the project's images do), whatever the
    machine that wrote the manifest runs as. The per-launch id of ``hvdtrain launch``'s signal
    forwarding (:data:`~hvdtrain.launch.signals.LAUNCH_ID_VAR`) is left out: mpirun, not
    ``hvdtrain launch``, runs in the launcher pod, and each of its pods is a launch of its own."""
    argv = [a for a in plan_argv if a != "--allow-run-as-root"]
    while LAUNCH_ID_VAR in argv and argv[argv.index(LAUNCH_ID_VAR) - 1] == "-x":
        i = argv.index(LAUNCH_ID_VAR)
        del argv[i - 1:i + 1]
    if "-H" in argv:
        i = argv.index("-H")
        argv[i:i + 2] = ["--hostfile", HOSTFILE_PATH]
    elif "--hostfile" in argv:
        argv[argv.index("--hostfile") + 1] = HOSTFILE_PATH
    return [argv[0], "--allow-run-as-root", *argv[1:]] if root else argv


def rank_env(plan_env: dict[str, str]) -> list[dict[str, str]]:
    """The launcher container's ``env``: what the plan sets for the ranks (Horovod and Open MPI
    settings, ``OMP_NUM_THREADS``, the record of who chose them), sorted; not the image's
    :data:`IMAGE_ENV` nor a per-launch id (each launcher pod is a launch of its own)."""
    return [{"name": k, "value": v} for k, v in sorted(plan_env.items())
            if k not in IMAGE_ENV and k != LAUNCH_ID_VAR]


def _resources(opts: KubeOptions) -> dict:
    """A worker's requests and limits (equal: a Guaranteed pod, whole cores for its ranks)."""
    amounts = {"cpu": str(opts.cpus_per_worker)}
    if opts.memory_per_worker:
        amounts["memory"] = opts.memory_per_worker
    limits = dict(amounts)
    if opts.gpu:  # one GPU per rank (NCCL refuses two ranks on one GPU)
        limits["nvidia.com/gpu"] = str(opts.slots_per_worker)
    return {"requests": amounts, "limits": limits}


def _volumes(opts: KubeOptions) -> tuple[list, list]:
    """The pod's ``volumes`` and the container's ``volumeMounts`` for ``--pvc``."""
    volume = {"name": OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": opts.pvc}}
    return ([volume], [{"name": OUTPUT_VOLUME, "mountPath": opts.output_dir}]) if opts.pvc \
        else ([], [])


def mpijob(opts: KubeOptions, workers: int, argv: list[str], env: list[dict]) -> dict:
    """The ``MPIJob`` (fields: mpi-operator ``deploy/v2beta1/mpi-operator.yaml``)."""
    volumes, mounts = _volumes(opts)
    worker = {"name": "worker", "image": opts.image, "command": list(WORKER_COMMAND),
              "resources": _resources(opts)}
    if mounts:
        worker["volumeMounts"] = mounts
    worker_pod = {"terminationGracePeriodSeconds": opts.grace_s, "containers": [worker]}
    if volumes:
        worker_pod["volumes"] = volumes
    launcher = {"name": "launcher", "image": opts.image, "command": argv, "env": env,
                "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}}
    return {
        "apiVersion": MPIJOB_API, "kind": "MPIJob",
        "metadata": {"name": opts.name, "labels": {"app.kubernetes.io/name": "hvdtrain"}},
        "spec": {
            "slotsPerWorker": opts.slots_per_worker,
            "sshAuthMountPath": SSH_AUTH_MOUNT_PATH,
            "mpiImplementation": "OpenMPI",
            "launcherCreationPolicy": "WaitForWorkersReady",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": opts.backoff_limit},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "OnFailure", "template": {"spec": {
                    "terminationGracePeriodSeconds": opts.grace_s, "containers": [launcher]}}},
                "Worker": {"replicas": workers, "template": {"spec": worker_pod}},
            },
        },
    }


def trainjob(opts: KubeOptions, workers: int, argv: list[str], env: list[dict]) -> dict:
    """The ``TrainJob`` on the MPI ``ClusterTrainingRuntime`` ``opts.runtime`` (fields:
    kubeflow/trainer ``trainer.kubeflow.org_trainjobs.yaml``): ``trainer`` holds the image, the
    launcher's command (``mpirun ...``), its environment, the nodes (workers), the ranks per
    node and each node's resources; ``runtimePatches`` add the grace period and the volume to
    the runtime's ``node`` pods."""
    volumes, mounts = _volumes(opts)
    node = {"terminationGracePeriodSeconds": opts.grace_s}
    if volumes:
        node["volumes"] = volumes
        node["containers"] = [{"name": "node", "volumeMounts": mounts}]
    return {
        "apiVersion": TRAINJOB_API, "kind": "TrainJob",
        "metadata": {"name": opts.name, "labels": {"app.kubernetes.io/name": "hvdtrain"}},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                           "name": opts.runtime},
            "trainer": {"image": opts.image, "command": argv, "env": env,
                        "numNodes": workers, "numProcPerNode": opts.slots_per_worker,
                        "resourcesPerNode": _resources(opts)},
            "runtimePatches": [{"manager": "hvdtrain", "trainingRuntimeSpec": {"template": {
                "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {
                    "template": {"spec": node}}}}]}}}}],
        },
    }


def manifest(opts: KubeOptions, np_: int, plan_argv: list[str], plan_env: dict[str, str]) -> dict:
    """The manifest ``opts.kind`` asks for, for the plan's ``mpirun`` command and environment.

    Raises:
        ManifestError: see :func:`check`.
    """
    workers = check(opts, np_)
    argv = launcher_argv(plan_argv, root=SSH_AUTH_MOUNT_PATH.startswith("/root"))
    build = mpijob if opts.kind == "mpijob" else trainjob
    return build(opts, workers, argv, rank_env(plan_env))


def to_yaml(doc: dict, header: str = "") -> str:
    """``doc`` as YAML (PyYAML, block style, keys in the order written), after ``header``'s
    lines as comments."""
    import yaml
    comments = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    return comments + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)


def add_emit_arguments(parser) -> None:
    """``hvdtrain launch``'s options for ``--emit`` (a group of their own in ``--help``)."""
    group = parser.add_argument_group(
        "Kubernetes (--emit)", "print the launch as a Kubeflow manifest (YAML) instead of "
        "running it: kubectl apply -f the output")
    group.add_argument("--emit", metavar="{mpijob,trainjob}",
                       help="mpijob: an MPI Operator v2 MPIJob (kubeflow.org/v2beta1); trainjob: "
                            "a Kubeflow Trainer v2 TrainJob on an MPI runtime")
    group.add_argument("--image", help="--emit: the image every pod runs (required)")
    group.add_argument("--job-name", default="hvdtrain", help="--emit: the job's name, a DNS "
                       "label (default: hvdtrain)")
    group.add_argument("--slots-per-worker", type=int, help="--emit: ranks per worker pod "
                       "(default: the slots of --hostfile or -H, else 1)")
    group.add_argument("--cpus-per-worker", type=int, help="--emit: CPU cores per worker pod; "
                       "OMP_NUM_THREADS is this over the slots (default: one per slot)")
    group.add_argument("--memory-per-worker", help="--emit: memory per worker pod, e.g. 8Gi")
    group.add_argument("--gpu", action="store_true", help="--emit: one GPU per rank "
                       "(nvidia.com/gpu: slots per worker)")
    group.add_argument("--pvc", help="--emit: a PersistentVolumeClaim mounted on the workers at "
                       "the command's --output-dir (absolute), for checkpoints that outlive a pod")
    group.add_argument("--grace-period-s", type=int, default=300, help="--emit: "
                       "terminationGracePeriodSeconds, time for the stop checkpoint after "
                       "SIGTERM (default: 300)")
    group.add_argument("--backoff-limit", type=int, default=3, help="--emit: times the launcher "
                       "is started again after it failed or was stopped (default: 3)")
    group.add_argument("--trainer-runtime", default="mpi-distributed", help="--emit trainjob: "
                       "the MPI ClusterTrainingRuntime (default: mpi-distributed)")


def _slots(args) -> tuple[int | None, int]:
    """``(slots per host, hosts)`` of --hostfile or -H (``(None, 0)`` when neither); with
    ``--slots-per-worker``, the hosts may have different slots (theirs are not used).

    Raises:
        ManifestError: hosts with different slots and no --slots-per-worker; HostfileError: a
            bad hostfile.
    """
    from hvdtrain.launch import hostfile as hf
    from hvdtrain.launch.plan import hosts_from_h
    if not (args.hostfile or args.hosts_spec):
        return None, 0
    hosts = hf.read_hostfile(args.hostfile) if args.hostfile else hosts_from_h(args.hosts_spec)
    counts = sorted({h.slots for h in hosts.hosts})
    if len(counts) > 1 and args.slots_per_worker is None:
        raise ManifestError(f"{hosts.path} gives its hosts {counts} slots, but every worker pod "
                            "has the same slots: give --slots-per-worker N")
    return counts[0], len(hosts.hosts)


def emit(args) -> tuple[str, list[str]]:
    """``hvdtrain launch --emit KIND``: the manifest, as YAML, of the launch ``args`` ask for,
    planned by :func:`hvdtrain.launch.plan.plan` as ``--launcher mpirun`` on the operator's
    worker hosts, with the training command given ``--resume auto`` (:func:`job_command`).

    Returns:
        ``(yaml_text, notes)``: the manifest, and lines for stderr.

    Raises:
        ManifestError, PlanError, HostfileError: bad input, with what to change; nothing has
            been printed.
    """
    import argparse

    from hvdtrain.launch import hostfile as hf
    from hvdtrain.launch.plan import plan
    if args.emit not in EMIT_KINDS or not args.image:
        check(KubeOptions(args.emit, args.job_name, args.image or "", 1, 1), 1)  # says what
    if args.elastic or args.gloo or args.launcher == "srun":
        raise ManifestError("--emit writes an mpirun launch (the operator's launcher runs "
                            "mpirun): leave out --elastic, --gloo and --launcher srun")
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    try:
        host_slots, n_hosts = _slots(args)
    except hf.HostfileError as exc:
        raise ManifestError(str(exc)) from None
    slots = args.slots_per_worker if args.slots_per_worker is not None else host_slots or 1
    np_ = args.np if args.np is not None or not n_hosts else slots * n_hosts
    if np_ is None or np_ < 1:
        raise ManifestError("--emit needs -np N (the ranks in all), e.g. -np 4 "
                            "--slots-per-worker 2 for two worker pods")
    command = job_command(command)
    opts = KubeOptions(args.emit, args.job_name, args.image or "", slots,
                       args.cpus_per_worker or slots, args.memory_per_worker, args.gpu,
                       args.pvc, output_dir_of(command), args.grace_period_s,
                       args.backoff_limit, args.trainer_runtime)
    workers = check(opts, np_)
    hosts = ",".join(f"{worker_host(opts.name, i)}:{slots}" for i in range(workers))
    # launch_tuning's rule for the workers, not this machine: CPU ranks yield, GPU ranks poll.
    yield_mode = args.yield_when_idle
    if yield_mode == "auto":
        yield_mode = "off" if opts.gpu else "on"
    k_args = argparse.Namespace(**{**vars(args), "launcher": "mpirun", "hostfile": None,
                                   "hosts_spec": hosts, "np": np_, "check": False,
                                   "command": command, "yield_when_idle": yield_mode})
    threads = opts.cpus_per_worker // slots
    env = {"PATH": "", "LD_LIBRARY_PATH": "", "OMP_NUM_THREADS": str(threads)}
    launch = plan(k_args, env=env, gpus=slots if opts.gpu else 0)
    doc = manifest(opts, np_, launch.argv, launch.env)
    argv = launcher_argv(launch.argv)
    header = (f"hvdtrain launch --emit {opts.kind}: {np_} ranks, {workers} worker pod(s) x "
              f"{slots} slot(s), {threads} thread(s) per rank (OMP_NUM_THREADS)\n"
              f"launcher: {shlex.join(argv)}\n"
              f"hostfile the operator mounts at {HOSTFILE_PATH} (namespace default):\n" +
              "".join(f"  {line}\n" for line in
                      operator_hostfile(opts.name, workers, slots).splitlines()))
    notes = list(launch.notes)
    if not opts.pvc:
        notes.append(f"no --pvc: {opts.output_dir} is inside the worker pod, so its checkpoints "
                     "go with it and --resume auto starts over; give --pvc CLAIM and an "
                     "absolute --output-dir")
    return to_yaml(doc, header), notes



def print_manifest(args, fail) -> int:
    """``hvdtrain launch --emit``: the manifest on stdout and the notes on stderr, 0; or, on
    bad input, ``fail(message)`` (exit status 2) with nothing on stdout."""
    import sys
    try:
        text, notes = emit(args)
    except ValueError as exc:  # ManifestError, PlanError, HostfileError
        return fail(str(exc))
    print("".join(f"hvdtrain: {note}\n" for note in notes), end="", file=sys.stderr)
    print(text, end="", flush=True)
    return 0
