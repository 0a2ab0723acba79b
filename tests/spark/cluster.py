"""A Spark standalone cluster on 127.0.0.1 for the tests: one master and 1-core workers, each a
process this module starts and stops by its process id (nothing else is touched).

    python tests/spark/cluster.py      # start one, print its URL, stop it on Enter

Every service binds to 127.0.0.1 (``SPARK_LOCAL_IP`` and ``--host``); the pip package has no
``start-*.sh`` scripts, so the daemons are started with ``spark-class`` as the scripts would.

Nothing comes from the user's home or Spark set-up (:func:`spark_env`): the daemons and drivers
get this process's own Spark configuration directory (``spark-defaults.conf`` with its own
``spark.jars.ivy``, where Spark would use ``~/.ivy2``), pyspark's own ``SPARK_HOME``, and
their Python processes (drivers, workers, ranks) their own HOME and ``KERAS_HOME``.
"""
from __future__ import annotations

import atexit
import os
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def spark_class() -> str:
    """Path of pyspark's ``bin/spark-class`` (raises ImportError without pyspark)."""
    import pyspark
    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


_OWN: Path | None = None
# The JVMs of the tests' Spark (daemons, drivers, executors) live seconds to minutes and do next to
# no work of their own; most of a short-lived JVM's CPU goes to the C2 JIT compiler and the
# parallel GC's threads. C1 only and the serial GC: a local-mode driver's start, one small job and
# its stop took 5.0 CPU-seconds instead of 8.8 on this 2-core machine (and 5.0 s instead of 6.2 s of
# wall time), while the ranks the tests time do not run in a JVM (#47).
JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def own_dir() -> Path:
    """This process's directory for what Spark and the ranks would read from the user's home
    or Spark set-up, made on first use and removed at exit: ``home/`` (HOME), ``conf/``
    (``SPARK_CONF_DIR``: ``spark-defaults.conf`` setting ``spark.jars.ivy`` to ``ivy/``, and
    :data:`JAVA_OPTIONS` for drivers and executors), ``keras/`` (``KERAS_HOME``) and ``local/``
    (``SPARK_LOCAL_DIRS``: the daemons' and executors' scratch space, which a killed worker would
    otherwise leave in the JVM's /tmp)."""
    global _OWN
    if _OWN is None:
        _OWN = Path(tempfile.mkdtemp(prefix="hvdtrain-spark-own-"))
        atexit.register(shutil.rmtree, _OWN, ignore_errors=True)
        for name in ("home", "conf", "ivy", "keras", "local"):
            (_OWN / name).mkdir()
        (_OWN / "conf" / "spark-defaults.conf").write_text(
            f"spark.jars.ivy {_OWN / 'ivy'}\n"
            f"spark.driver.extraJavaOptions {JAVA_OPTIONS}\n"
            f"spark.executor.extraJavaOptions {JAVA_OPTIONS}\n")
    return _OWN


def spark_env() -> dict:
    """The environment of the daemons: loopback only, this interpreter for Python workers, and
    nothing from the user's home or Spark set-up (a user's ``SPARK_*`` and ``PYSPARK_*``
    variables dropped; :func:`own_dir`; the daemons' JVMs get :data:`JAVA_OPTIONS` through
    ``SPARK_DAEMON_JAVA_OPTS``). hvdtrain's dataset cache stays the user's (``HVDTRAIN_CACHE``:
    MNIST is read from it, checked against pinned hashes)."""
    import pyspark

    from hvdtrain.datasets.mnist import cache_dir
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    own = own_dir()
    env.update(SPARK_LOCAL_IP=LOOPBACK, SPARK_LOCAL_HOSTNAME="localhost",
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_HOME=str(Path(pyspark.__file__).parent), SPARK_CONF_DIR=str(own / "conf"),
               SPARK_LOCAL_DIRS=str(own / "local"), SPARK_DAEMON_JAVA_OPTS=JAVA_OPTIONS,
               HOME=str(own / "home"), KERAS_HOME=str(own / "keras"),
               HVDTRAIN_CACHE=str(cache_dir()))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def spark_job_env() -> dict:
    """The environment of a driver the tests start: loopback only, this interpreter."""
    env = spark_env()
    env.update(PYTHONUNBUFFERED="1", OMPI_MCA_mpi_yield_when_idle="1")
    return env


class StandaloneCluster:
    """A master and ``workers`` 1-core workers on 127.0.0.1, logs and work dirs under ``root``.

    With ``gpus``, worker i also offers one GPU at address ``gpus[i]`` to Spark's resource
    scheduling (``spark.worker.resource.gpu.*``, its discovery script printing that address): an
    application that asks for none (``spark.executor.resource.gpu.amount``) never sees it, and
    nothing here needs a real GPU.

    Attributes:
        url: ``spark://127.0.0.1:PORT`` once started.
        master: the master's Popen; workers: the workers' Popens (index = worker number).
    """

    def __init__(self, root: Path, workers: int = 2, memory: str = "1500m",
                 gpus: list[str] | None = None):
        self.root, self.n_workers, self.memory = Path(root), workers, memory
        self.gpus = gpus
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"spark://{LOOPBACK}:{self.port}"
        self.master: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = []

    def _spawn(self, name: str, *argv: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        # spark-class execs java, so the pid is the daemon's JVM.
        return subprocess.Popen([spark_class(), *argv], env=env or spark_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def start(self, timeout: float = 90.0) -> "StandaloneCluster":
        """Start the master, then the workers; return once every worker has registered."""
        self.master = self._spawn("master", "org.apache.spark.deploy.master.Master",
                                  "--host", LOOPBACK, "--port", str(self.port),
                                  "--webui-port", str(free_port()))
        _wait_port(self.port, timeout, self.master, self.root / "master.log")
        for i in range(self.n_workers):
            self.start_worker(i)
        self.wait_workers(self.n_workers, timeout)
        return self

    def start_worker(self, i: int) -> subprocess.Popen:
        """Start (or restart) worker ``i``: 1 core, its own work dir."""
        work = self.root / f"worker{i}"
        work.mkdir(exist_ok=True)
        env = spark_env()
        if self.gpus:
            script = self.root / f"worker{i}-gpus.sh"
            script.write_text("#!/bin/sh\necho '{\"name\": \"gpu\", \"addresses\": [\"%s\"]}'\n"
                              % self.gpus[i])
            script.chmod(0o755)
            env["SPARK_WORKER_OPTS"] = ("-Dspark.worker.resource.gpu.amount=1 "
                                        f"-Dspark.worker.resource.gpu.discoveryScript={script}")
        proc = self._spawn(f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.url,
                           "--host", LOOPBACK, "--cores", "1", "--memory", self.memory,
                           "--webui-port", str(free_port()), "--work-dir", str(work), env=env)
        while len(self.workers) <= i:
            self.workers.append(None)
        self.workers[i] = proc
        return proc

    def wait_workers(self, n: int, timeout: float = 90.0) -> None:
        """Wait until ``n`` workers have registered with the master (its log says so)."""
        deadline = time.monotonic() + timeout
        log = self.root / "master.log"
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace") if log.exists() else ""
            if text.count("Registering worker") - text.count("Removing worker") >= n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{n} Spark workers did not register in {timeout:.0f} s; see {log}")

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``i``'s JVM (its executors notice and exit)."""
        proc = self.workers[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)

    def descendants(self) -> list[psutil.Process]:
        """Every live process below the daemons this cluster started (executors, Python
        workers, rank processes)."""
        found = []
        for proc in [self.master, *self.workers]:
            if proc is None:
                continue
            try:
                found += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self) -> None:
        """Stop the workers, then the master, by pid (SIGTERM, then SIGKILL after 20 s), and
        every process still below them."""
        below = self.descendants()
        for proc in [*self.workers, self.master]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.workers, self.master]:
            if proc is None:
                continue
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for child in below:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def _wait_port(port: int, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Spark master exited with {proc.returncode}; see {log}")
        with socket.socket() as s:
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.3)
    raise RuntimeError(f"the Spark master did not listen on {port} in {timeout:.0f} s; see {log}")


if __name__ == "__main__":
    import tempfile
    cluster = StandaloneCluster(Path(tempfile.mkdtemp(prefix="spark-cluster-"))).start()
    print(cluster.url, "pids", cluster.master.pid, [w.pid for w in cluster.workers], flush=True)
    try:
        input()
    finally:
        cluster.stop()
