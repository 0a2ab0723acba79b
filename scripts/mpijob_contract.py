"""Run an MPIJob the way Kubeflow's MPI Operator v2 would, with podman instead of Kubernetes.

    python scripts/mpijob_contract.py MANIFEST OUTDIR [--claim NAME=HOSTDIR ...]
        [--evict-worker I --evict-after-file PATH]

No Kubernetes control plane can be installed on the machines this project is tested on, so this
script plays the operator's part for the manifest that ``hvdtrain launch --emit mpijob`` wrote,
and starts, as containers, the pods the operator would start. What it does, and where each rule
comes from (kubeflow/mpi-operator v0.8.2, ``pkg/controller/mpi_job_controller.go``):

- the SSH Secret ``<job>-ssh``: a new ECDSA P-521 key (``newSSHAuthSecret``: PEM "EC PRIVATE
  KEY"), mounted read-only at ``spec.sshAuthMountPath`` on every pod as ``id_rsa``,
  ``id_rsa.pub`` and ``authorized_keys`` (``sshVolumeItems``), mode 0600 when the path is
  ``/root/.ssh`` (``setupSSHOnPod``), in the layout of a Kubernetes Secret volume: a
  world-writable directory (kubernetes/kubernetes#61049) whose files are links into ``..data/``;
- the ConfigMap ``<job>-config`` at ``/etc/mpi`` on the launcher: ``hostfile`` (0444), one
  ``<job>-worker-<i>.<job>.<namespace>.svc slots=<slotsPerWorker>`` line per worker, and
  ``discover_hosts.sh`` (0555), the running workers as ``host:slots``;
- worker pods ``<job>-worker-<i>`` (hostname the pod's name; command ``/usr/sbin/sshd -De`` when the
  template has none), with ``K_MPI_JOB_ROLE=worker``; the headless Service ``<job>`` is played by
  host entries for ``<job>-worker-<i>.<job>.<namespace>.svc`` (and ``...svc.cluster.local``);
- ``launcherCreationPolicy: WaitForWorkersReady``: the launcher starts once every worker runs (a
  pod without a readiness probe is Ready when its containers run; sshd may still be starting,
  which the operator's ``-o ConnectionAttempts=10`` covers);
- the launcher pod ``<job>-launcher`` with the Open MPI variables the operator adds
  (``ompiEnvVars``: ``OMPI_MCA_orte_keep_fqdn_hostnames=true``,
  ``OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile``, ``OMPI_MCA_plm_rsh_args=-o
  ConnectionAttempts=10``; ``OMPI_MCA_orte_set_default_slots``), ``K_MPI_JOB_ROLE=launcher`` and
  ``NVIDIA_VISIBLE_DEVICES`` / ``NVIDIA_DRIVER_CAPABILITIES`` emptied (``nvidiaDisableEnvVars``);
- each container gets its template's ``command`` (as the entrypoint) and ``args``, ``env``,
  ``resources.limits.cpu`` (``--cpus``) and ``terminationGracePeriodSeconds`` (``--stop-timeout``:
  a stop is SIGTERM, then SIGKILL after that many seconds, as the kubelet does);
- a ``persistentVolumeClaim`` volume is the host folder given by ``--claim NAME=HOSTDIR``.

- the launcher Job: with ``restartPolicy: OnFailure`` a failed launcher is started again, up to
  ``runPolicy.backoffLimit`` times; before that the worker pods that are gone are made again
  (the operator re-creates a deleted worker pod), and the launcher waits for them as at first.

``--evict-worker I --evict-after-file PATH``: once PATH exists (e.g. the run's first checkpoint),
worker I is stopped as a node drain stops a pod (``podman stop`` with the grace period: SIGTERM to
its main process, SIGKILL after the grace period); the launcher then fails or not, and is started
again as above.

Writes OUTDIR/contract.json (the containers, the launcher's environment, mounts and command, and
per launcher attempt the workers' addresses, the launcher's exit status and, for an eviction,
the evicted worker's exit status and how long it took to stop), OUTDIR/<container>-<attempt>.log
for every container and launcher attempt, and OUTDIR/<claim>-metrics-<attempt>.json, the
metrics.json on each claim after each attempt. Exit status: the last launcher's; 2 for a manifest
this script cannot run. Every container and the network it makes are removed at the end, also
after a failure or SIGTERM.

Needs podman and PyYAML (the project's venv has it); the image must be in podman's local storage.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The operator's side is written here from its source, not taken from hvdtrain.launch.kubernetes
# (HOSTFILE_PATH, operator_hostfile): the run checks what the project emits against it.
HOSTFILE_DIR = "/etc/mpi"  # mpi-operator configMountPath
OMPI_ENV = {  # mpi-operator ompiEnvVars
    "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
    "OMPI_MCA_orte_default_hostfile": f"{HOSTFILE_DIR}/hostfile",
    "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
}
NVIDIA_DISABLE = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")  # nvidiaDisableEnvVars


class ContractError(Exception):
    """A manifest this script cannot run as the operator would (exit status 2)."""


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    """``podman ARGS``; raises CalledProcessError (with podman's stderr) when ``check``."""
    proc = subprocess.run(["podman", *args], text=True, capture_output=capture)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc


def atomic_volume(root: Path, files: dict[str, tuple[str, int]], dir_mode: int = 0o1777) -> Path:
    """A folder laid out as Kubernetes writes a Secret or ConfigMap volume (its atomic writer):
    the files in a timestamped folder, ``..data`` a link to it, each name a link into ``..data``;
    the volume's root world-writable with the sticky bit (kubernetes/kubernetes#61049).

    Args:
        root: the folder to make (it must not exist).
        files: name -> (content, mode).
        dir_mode: the mode of ``root``.

    Returns:
        ``root``.

    Raises:
        FileExistsError: ``root`` exists.
    """
    root.mkdir(parents=True)
    stamp = root / time.strftime("..%Y_%m_%d_%H_%M_%S.0000")
    stamp.mkdir()
    for name, (content, mode) in files.items():
        (stamp / name).write_text(content)
        (stamp / name).chmod(mode)
        os.symlink(f"..data/{name}", root / name)
    os.symlink(stamp.name, root / "..data")
    stamp.chmod(0o755)
    root.chmod(dir_mode)
    return root


def ssh_secret(work: Path, mount_path: str) -> Path:
    """The operator's SSH Secret as a volume folder: ``id_rsa`` (an ECDSA P-521 key in PEM, as
    ``newSSHAuthSecret`` makes it), ``id_rsa.pub`` and ``authorized_keys`` (the public key)."""
    key = work / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-m", "PEM", "-N", "",
                    "-C", "", "-f", str(key)], check=True)
    private, public = key.read_text(), (work / "key.pub").read_text()
    if "BEGIN EC PRIVATE KEY" not in private:
        raise RuntimeError("ssh-keygen -m PEM did not write an EC PRIVATE KEY")
    mode = 0o600 if mount_path == "/root/.ssh" else 0o644  # setupSSHOnPod's DefaultMode
    return atomic_volume(work / "ssh-secret", {"id_rsa": (private, mode),
                                               "id_rsa.pub": (public, mode),
                                               "authorized_keys": (public, mode)})


def replica(spec: dict, role: str) -> tuple[int, dict, dict]:
    """``(replicas, pod spec, main container)`` of ``mpiReplicaSpecs[role]``."""
    try:
        rs = spec["mpiReplicaSpecs"][role]
        pod = rs["template"]["spec"]
        return int(rs.get("replicas", 1)), pod, pod["containers"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise ContractError(f"spec.mpiReplicaSpecs.{role}: no pod template with a container "
                            f"({exc!r})") from None


def container_args(pod: dict, container: dict, claims: dict[str, str]) -> list[str]:
    """``podman run`` options for a pod template's main container: env, CPU limit, stop timeout,
    PVC mounts; the image, entrypoint and args come after."""
    out = ["--stop-timeout", str(pod.get("terminationGracePeriodSeconds", 30))]
    cpu = container.get("resources", {}).get("limits", {}).get("cpu")
    if cpu is not None:
        out += ["--cpus", str(cpu)]
    for var in container.get("env", []):
        out += ["-e", f"{var['name']}={var.get('value', '')}"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        vol = volumes.get(mount["name"])
        claim = (vol or {}).get("persistentVolumeClaim", {}).get("claimName")
        if claim is None:
            raise ContractError(f"volume {mount['name']!r}: only persistentVolumeClaim volumes "
                                "are played here")
        if claim not in claims:
            raise ContractError(f"the manifest mounts the claim {claim!r}: give --claim "
                                f"{claim}=HOSTDIR")
        out += ["-v", f"{claims[claim]}:{mount['mountPath']}"]
    return out


def entrypoint(container: dict, default: list[str] | None = None) -> list[str]:
    """``--entrypoint`` and the arguments after the image: Kubernetes' ``command`` replaces the
    image's entrypoint, ``args`` its CMD."""
    command = container.get("command") or default
    args = list(container.get("args", []))
    return (["--entrypoint", json.dumps(command)] if command else []), args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifest", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--claim", action="append", default=[], metavar="NAME=HOSTDIR",
                    help="a PersistentVolumeClaim's folder on this host")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--evict-worker", type=int, help="stop this worker as a node drain would")
    ap.add_argument("--evict-after-file", type=Path, help="... once this file exists")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds from the first launcher's start to the last one's end (the "
                         "workers' start, up to 120 s each time, and an eviction's stop, up to "
                         "the grace period, come on top)")
    args = ap.parse_args(argv)
    if (args.evict_worker is None) != (args.evict_after_file is None):
        ap.error("--evict-worker and --evict-after-file go together")
    claims = {}
    for item in args.claim:
        name, sep, path = item.partition("=")
        if not sep:
            ap.error(f"--claim {item!r}: write NAME=HOSTDIR")
        claims[name] = str(Path(path).resolve())

    import yaml
    doc = yaml.safe_load(args.manifest.read_text())
    try:
        if doc.get("apiVersion") != "kubeflow.org/v2beta1" or doc.get("kind") != "MPIJob":
            raise ContractError("not a kubeflow.org/v2beta1 MPIJob")
        spec, job = doc["spec"], doc["metadata"]["name"]
        if spec.get("mpiImplementation", "OpenMPI") != "OpenMPI":
            raise ContractError("only mpiImplementation OpenMPI is played here")
        slots = int(spec.get("slotsPerWorker", 1))
        ssh_path = spec.get("sshAuthMountPath", "/root/.ssh")
        workers, worker_pod, worker_c = replica(spec, "Worker")
        _, launcher_pod, launcher_c = replica(spec, "Launcher")
        worker_opts = container_args(worker_pod, worker_c, claims)
        launcher_opts = container_args(launcher_pod, launcher_c, claims)
    except ContractError as exc:
        print(f"mpijob_contract.py: {exc}", file=sys.stderr)
        return 2

    args.outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mpijob-contract."))
    network = f"{job}-mpijob-net"
    names = [f"{job}-worker-{i}" for i in range(workers)]
    launcher = f"{job}-launcher"
    record: dict = {"job": job, "workers": names, "launcher": launcher, "slots": slots,
                    "grace_period_s": worker_pod.get("terminationGracePeriodSeconds", 30)}

    def remove():
        for name in [launcher, *names]:
            podman("rm", "-f", "-t", "0", name, check=False)
        podman("network", "rm", "-f", network, check=False)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    remove()  # what an interrupted run left
    try:
        secret = ssh_secret(work, ssh_path)
        fqdn = [f"{n}.{job}.{args.namespace}.svc" for n in names]
        hostfile = "".join(f"{h} slots={slots}\n" for h in fqdn)
        discover = "#!/bin/sh\n" + "".join(f"echo {h}:{slots}\n" for h in fqdn)
        config = atomic_volume(work / "config", {"hostfile": (hostfile, 0o444),
                                                 "discover_hosts.sh": (discover, 0o555)})
        podman("network", "create", network)
        ssh_mount = ["-v", f"{secret}:{ssh_path}:ro"]
        worker_cmd, worker_rest = entrypoint(worker_c, ["/usr/sbin/sshd", "-De"])

        def start_worker(name: str) -> None:
            podman("run", "-d", "--name", name, "--hostname", name, "--network", network,
                   "-e", "K_MPI_JOB_ROLE=worker", *worker_opts, *ssh_mount, *worker_cmd,
                   worker_c["image"], *worker_rest)

        def running(name: str) -> dict | None:
            """The container's state while it runs, else None."""
            state = json.loads(podman("inspect", name).stdout)[0]
            return state if state["State"]["Running"] else None

        def ready() -> dict[str, str]:
            """WaitForWorkersReady: every worker's container runs (a pod without a readiness
            probe is Ready then); their addresses."""
            addresses = {}
            deadline = time.monotonic() + 120
            for name in names:
                while (state := running(name)) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"worker {name} is not running after 120 s")
                    time.sleep(0.2)
                addresses[name] = state["NetworkSettings"]["Networks"][network]["IPAddress"]
            return addresses

        def save_log(name: str, as_name: str) -> None:
            with open(args.outdir / f"{as_name}.log", "w") as log:
                subprocess.run(["podman", "logs", name], stdout=log, stderr=subprocess.STDOUT)

        env = {"K_MPI_JOB_ROLE": "launcher", **OMPI_ENV,
               "OMPI_MCA_orte_set_default_slots": str(slots), **{v: "" for v in NVIDIA_DISABLE}}
        record["launcher_env"] = {**{v["name"]: v.get("value", "")
                                     for v in launcher_c.get("env", [])}, **env}
        record["launcher_mounts"] = {HOSTFILE_DIR: sorted(os.listdir(config)),
                                     ssh_path: sorted(os.listdir(secret))}
        launcher_cmd, launcher_rest = entrypoint(launcher_c)
        record["launcher_command"] = launcher_c.get("command", []) + launcher_rest
        # The launcher Job: its pod is started again after a failure (restartPolicy OnFailure),
        # up to runPolicy.backoffLimit times (Kubernetes' default for a Job: 6).
        restarts = spec.get("runPolicy", {}).get("backoffLimit", 6)
        if spec["mpiReplicaSpecs"]["Launcher"].get("restartPolicy", "Never") != "OnFailure":
            restarts = 0
        record["attempts"] = []
        for name in names:
            start_worker(name)
        start = time.monotonic()
        for attempt in range(restarts + 1):
            addresses = ready()
            hosts = []
            for name, host in zip(names, fqdn):  # the headless Service's names
                hosts += ["--add-host", f"{host}:{addresses[name]}",
                          "--add-host", f"{host}.cluster.local:{addresses[name]}"]
            podman("run", "-d", "--name", launcher, "--hostname", launcher, "--network",
                   network, *hosts, *launcher_opts,
                   *[x for k, v in env.items() for x in ("-e", f"{k}={v}")],
                   "-v", f"{config}:{HOSTFILE_DIR}:ro", *ssh_mount, *launcher_cmd,
                   launcher_c["image"], *launcher_rest)
            this = {"addresses": addresses}
            record["attempts"].append(this)
            if args.evict_worker is not None and attempt == 0:
                victim = names[args.evict_worker]
                while not args.evict_after_file.exists():
                    if running(launcher) is None:
                        raise RuntimeError(f"the launcher ended before {args.evict_after_file} "
                                           "appeared: nothing to evict")
                    if time.monotonic() - start > args.timeout:
                        raise RuntimeError(f"no {args.evict_after_file} in {args.timeout} s")
                    time.sleep(0.2)
                t0 = time.monotonic()  # a node drain: SIGTERM, SIGKILL after the grace period
                podman("stop", "-t", str(record["grace_period_s"]), victim)
                state = json.loads(podman("inspect", victim).stdout)[0]["State"]
                this["evicted"] = {"worker": victim, "exit": state["ExitCode"],
                                   "stop_seconds": round(time.monotonic() - t0, 2)}
            try:
                waited = subprocess.run(
                    ["podman", "wait", launcher], capture_output=True, text=True,
                    timeout=max(1.0, args.timeout - (time.monotonic() - start)))
                code = int(waited.stdout.strip() or 1) if waited.returncode == 0 else 1
            except subprocess.TimeoutExpired:
                print(f"mpijob_contract.py: the launcher ran past {args.timeout} s",
                      file=sys.stderr)
                podman("stop", "-t", "10", launcher, check=False)
                code = 124
            this["launcher_exit"] = code
            save_log(launcher, f"{launcher}-{attempt}")
            for claim, folder in claims.items():  # what the run recorded after this attempt
                if (Path(folder) / "metrics.json").exists():
                    shutil.copy(Path(folder) / "metrics.json",
                                args.outdir / f"{claim}-metrics-{attempt}.json")
            for name in names:
                save_log(name, f"{name}-{attempt}")
            if code == 0 or code == 124 or attempt == restarts:
                break
            # The launcher failed: the operator makes the worker pods that are gone again (an
            # evicted pod is deleted), and the launcher Job starts a new launcher pod.
            podman("rm", "-f", "-t", "0", launcher)
            for name in names:
                if running(name) is None:
                    podman("rm", "-f", "-t", "0", name)
                    start_worker(name)
        record["launcher_exit"] = code
        record["worker_exits"] = {}
        for name in names:
            state = json.loads(podman("inspect", name).stdout)[0]["State"]
            record["worker_exits"][name] = None if state["Running"] else state["ExitCode"]
        return code
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM: the clean-up ends
        (args.outdir / "contract.json").write_text(json.dumps(record, indent=2, sort_keys=True))
        remove()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
