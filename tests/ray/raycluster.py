"""A local Ray cluster on 127.0.0.1 for the tests: a head node and 1-CPU worker nodes, each a
``ray start --block`` process this module starts in its own session and stops by its process
group (never ``ray stop``, which stops every Ray on the machine).

    python tests/ray/raycluster.py   # start one, print its address, stop it on Enter

Every port Ray opens is chosen here (free on 127.0.0.1 when chosen), so the cluster does not
clash with another Ray on the machine; its session files live under its own ``--temp-dir``.

Nothing comes from the user's home (:func:`ray_env`): every Ray process and driver gets this
process's own HOME, Keras directory and Ray token, and the clusters run with token
authentication on (``RAY_AUTH_MODE=token``, Ray's default for a new local cluster since 2.60).
A user's ``~/.ray/auth_token`` (written by any plain ``ray.init()``) would otherwise turn
authentication on in ``ray start --head`` only, and every driver given the address would be
refused (``InvalidAuthToken``); the tests' HOME holds such a token, so every test runs with one.
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

LOOPBACK = "127.0.0.1"
HEAD_PORT = 26380  # GCS port: outside Ray's default worker port range (10002-19999)
WORKER_PORTS = 26400


# `ray start` on loopback only. Ray binds its servers to 127.0.0.1 only when that is the node's
# address, but `ray start` replaces 127.0.0.1 (in --node-ip-address and --address) by the
# machine's routable address (ray._private.services.resolve_ip_for_localhost) and then listens
# on every interface. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray_env) keeps 127.0.0.1 in every Ray
# process, but then `ray start` refuses to add a worker node; this launcher lets it and keeps
# the addresses as given. Test scaffolding: a real cluster on several hosts needs none of it.
RAY_START = """
import sys
from ray._private import ray_constants, services
from ray.scripts.scripts import main
ray_constants.ENABLE_RAY_CLUSTER = True
services.resolve_ip_for_localhost = lambda host: host
sys.argv[0] = "ray"
sys.exit(main())
"""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


_OWN: Path | None = None


def own_dir() -> Path:
    """This process's directory for what Ray and the ranks would read from the user's home,
    made on first use and removed at exit:

    - ``home/``: the HOME of every Ray process; its ``.ray/auth_token`` is a token no cluster
      uses, as a user's home holds after a plain ``ray.init()``;
    - ``auth_token``: the test clusters' token (``RAY_AUTH_TOKEN_PATH``);
    - ``keras/``: ``KERAS_HOME`` (``keras.json``).
    """
    global _OWN
    if _OWN is None:
        _OWN = Path(tempfile.mkdtemp(prefix="hvdtrain-ray-own-"))
        atexit.register(shutil.rmtree, _OWN, ignore_errors=True)
        (_OWN / "home" / ".ray").mkdir(parents=True)
        (_OWN / "home" / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        (_OWN / "auth_token").write_text(secrets.token_hex(32))
        (_OWN / "keras").mkdir()
    return _OWN


def ray_env() -> dict:
    """The environment of the Ray daemons and of drivers the tests start: token authentication
    with the clusters' own token (a user's ``RAY_AUTH_*`` variables dropped), and HOME and
    ``KERAS_HOME`` under :func:`own_dir`; hvdtrain's dataset cache stays the user's
    (``HVDTRAIN_CACHE``: MNIST is read from it, checked against pinned hashes)."""
    from hvdtrain.datasets.mnist import cache_dir
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    own = own_dir()
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               OMPI_MCA_mpi_yield_when_idle="1", RAY_TRAIN_V2_ENABLED="1",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # 127.0.0.1 stays 127.0.0.1 (RAY_START)
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(own / "auth_token"),
               HOME=str(own / "home"), KERAS_HOME=str(own / "keras"),
               HVDTRAIN_CACHE=str(cache_dir()))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


class LocalRayCluster:
    """A head and ``workers`` worker nodes, 1 CPU each, all on 127.0.0.1.

    Attributes:
        address: ``127.0.0.1:PORT`` (the GCS) once started.
        procs: the ``ray start --block`` Popens, head first.
    """

    def __init__(self, root: Path, workers: int = 1, port: int = HEAD_PORT):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.n_workers, self.port = workers, port
        self.head_ip = LOOPBACK
        self.address = f"{LOOPBACK}:{port}"
        self.procs: list[subprocess.Popen] = []
        # Ray's session files (sockets among them: AF_UNIX paths must stay under 108 bytes,
        # too short for pytest's tmp_path or scripts/test.sh's TMPDIR), removed by stop().
        self.temp_dir = tempfile.mkdtemp(prefix="hvdtrain-ray-", dir="/tmp")

    def _ports(self, index: int) -> list[str]:
        # Worker ports below the kernel's ephemeral range (32768-60999), so that no free_port()
        # lands in them: 26400-26549 for the head, then 200 higher per node.
        base = WORKER_PORTS + 200 * index
        return ["--node-manager-port", str(free_port()),
                "--object-manager-port", str(free_port()),
                "--metrics-export-port", str(free_port()),
                "--dashboard-agent-listen-port", str(free_port()),
                "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()),
                "--min-worker-port", str(base), "--max-worker-port", str(base + 150)]

    def _spawn(self, name: str, *argv: str, index: int | None = None) -> subprocess.Popen:
        """Start ``ray start ARGV --block`` as node ``index`` (default: the next one)."""
        index = len(self.procs) if index is None else index
        log = open(self.root / f"{name}.log", "ab")
        env = ray_env()
        cmd = [sys.executable, "-c", RAY_START, "start", *argv, "--node-ip-address", LOOPBACK,
               "--num-cpus", "1", "--num-gpus", "0",
               "--object-store-memory", str(150 * 1024 * 1024), "--disable-usage-stats",
               "--block", *self._ports(index)]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        if index == len(self.procs):
            self.procs.append(proc)
        return proc

    def start(self, timeout: float = 120.0) -> "LocalRayCluster":
        """Start the head, then the workers; return once all nodes are alive."""
        self._spawn("head", "--head", "--port", str(self.port),
                    "--include-dashboard=false",
                    "--ray-client-server-port", str(free_port()),
                    "--temp-dir", self.temp_dir)
        _wait_port(self.head_ip, self.port, timeout, self.procs[0], self.root / "head.log")
        for i in range(self.n_workers):
            self._spawn(f"worker{i}", "--address", self.address)
        self.wait_nodes(1 + self.n_workers, timeout)
        return self

    def kill_node(self, i: int) -> None:
        """SIGKILL worker node ``i`` (1 = the first worker node; 0 would be the head): its
        ``ray start`` process group and every process below it (raylet, Ray workers, ranks)."""
        proc = self.procs[i]
        try:
            below = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            below = []
        _signal_group(proc, signal.SIGKILL)
        proc.wait(10)
        for child in below:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def restart_node(self, i: int, timeout: float = 120.0) -> None:
        """Start worker node ``i`` again (after :meth:`kill_node`) and wait until it is alive."""
        self.procs[i] = self._spawn(f"worker{i - 1}", "--address", self.address, index=i)
        self.wait_nodes(1 + self.n_workers, timeout)

    def wait_nodes(self, n: int, timeout: float = 120.0) -> None:
        """Wait until ``n`` nodes are alive (asked in a short-lived driver)."""
        code = ("import ray, sys, time\n"
                f"ray.init(address='{self.address}', logging_level='ERROR')\n"
                f"deadline = time.monotonic() + {timeout}\n"
                f"while sum(n['Alive'] for n in ray.nodes()) < {n}:\n"
                "    assert time.monotonic() < deadline, ray.nodes()\n"
                "    time.sleep(0.5)\n")
        proc = subprocess.run([sys.executable, "-c", code], env=ray_env(), capture_output=True,
                              text=True, timeout=timeout + 30)
        if proc.returncode != 0:
            raise RuntimeError(f"{n} Ray nodes not alive in {timeout:.0f} s: "
                               f"{proc.stderr[-2000:]}\nsee {self.root}")

    def listening(self) -> list[str]:
        """``ip:port`` of every TCP socket the cluster's processes listen on."""
        found = []
        for proc in self.descendants():
            try:
                found += [f"{c.laddr.ip}:{c.laddr.port}" for c in proc.net_connections("tcp")
                          if c.status == psutil.CONN_LISTEN]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return found

    def descendants(self) -> list[psutil.Process]:
        """Every live process below the ``ray start`` processes (raylets, GCS, workers)."""
        found = []
        for proc in self.procs:
            try:
                found += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self) -> None:
        """SIGTERM to each process group started here (workers first), SIGKILL after 8 s,
        then SIGKILL to whatever is still below them."""
        below = self.descendants()
        for proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 8
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # it, or leftovers in its group
            proc.wait(10)
        for child in below:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the pid
    except (ProcessLookupError, PermissionError):
        pass


def _wait_port(ip: str, port: int, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Ray head exited with {proc.returncode}; see {log}")
        with socket.socket() as s:
            if s.connect_ex((ip, port)) == 0:
                return
        time.sleep(0.3)
    raise RuntimeError(f"the Ray head did not listen on {port} in {timeout:.0f} s; see {log}")


if __name__ == "__main__":
    cluster = LocalRayCluster(Path(tempfile.mkdtemp(prefix="ray-cluster-"))).start()
    print(cluster.address, "pids", [p.pid for p in cluster.procs], flush=True)
    try:
        input()
    finally:
        cluster.stop()
