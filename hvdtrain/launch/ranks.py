"""One Horovod rank as a child process, the way ``horovodrun``'s Gloo launcher starts it: the
rank plan, the Gloo rendezvous server, the ``HOROVOD_*`` variables, and a child that dies with
its parent. Used by the engines: on Spark executors (:mod:`hvdtrain.spark.task`), on the Spark
driver (``num_proc < 0``, :mod:`hvdtrain.spark.local`) and in Ray Train's workers
(:mod:`hvdtrain.ray.backend`). Imports no engine and no framework.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

TAIL_BYTES = 6000  # how much of a rank's last output an error message quotes
ENGINE_VAR = "HVDTRAIN_ENGINE"  # read by the run header (hvdtrain.run.report)


def slot_plan(hosts: list[str]) -> list:
    """Horovod's slot for each task, given the host each task runs on.

    Ranks are contiguous per host, as ``horovodrun`` lays them out
    (``horovod.runner.common.util.hosts.get_host_assignments``): task 0's host first, then the
    others in order of first appearance; the k-th task on a host gets that host's local rank k.
    So task 0 is always rank 0.

    Args:
        hosts: the host (address) of task i at index i.

    Returns:
        ``SlotInfo`` per task (``rank``, ``size``, ``local_rank``, ``local_size``,
        ``cross_rank``, ``cross_size``, ``hostname``).
    """
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    order = list(dict.fromkeys(hosts))
    plan = get_host_assignments([HostInfo(h, hosts.count(h)) for h in order], len(hosts))
    by_host: dict[str, list] = {}
    for slot in plan:
        by_host.setdefault(slot.hostname, []).append(slot)
    seen: dict[str, int] = {}
    slots = []
    for host in hosts:
        k = seen.get(host, 0)
        seen[host] = k + 1
        slots.append(by_host[host][k])
    return slots


def shared_visible_devices(plan: list, assigned: list[list[str]]) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each task's rank from the GPUs the engine assigned to each task
    (Spark's ``TaskContext.resources()['gpu'].addresses``), as Ray Train shares them
    (``share_cuda_visible_devices``): every rank on a host sees the GPUs of all that host's tasks,
    listed in local-rank order, so the GPU a rank picks by its local rank (``cuda:<local_rank>``,
    :func:`hvdtrain.runtime.choose_device`) is the first one its own task was given, and NCCL
    sees the peers it may reach directly.

    Args:
        plan: every task's ``SlotInfo`` (:func:`slot_plan`), index = task.
        assigned: the GPU addresses of each task (strings, e.g. ``["3"]``; ``[]`` without GPUs).

    Returns:
        Per task, the value to set, or None (no GPUs assigned on that task's host: the rank keeps
        the executor's environment). A GPU given to two tasks of a host (a fractional
        ``spark.task.resource.gpu.amount``) is listed once, so the rank sees fewer GPUs than
        ranks and ``init`` says so (NCCL refuses two ranks on one GPU).
    """
    by_host: dict[str, list[tuple[int, list[str]]]] = {}
    for slot, gpus in zip(plan, assigned):
        by_host.setdefault(slot.hostname, []).append((slot.local_rank, list(gpus)))
    visible: dict[str, str | None] = {}
    for host, tasks in by_host.items():
        if not all(gpus for _, gpus in tasks):
            visible[host] = None
            continue
        firsts = [gpus[0] for _, gpus in sorted(tasks)]
        visible[host] = ",".join(dict.fromkeys(firsts))
    return [visible[slot.hostname] for slot in plan]


class Rendezvous:
    """Horovod's Gloo rendezvous (the HTTP key-value store ``horovodrun`` runs), bound to
    ``host`` only, on a free port.

    Args:
        host: the address the ranks reach this process by.
        plan: every rank's ``SlotInfo`` (:func:`slot_plan`).
    """

    def __init__(self, host: str, plan: list):
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
        self._httpd = RendezvousHTTPServer((host, 0), RendezvousHandler, 0)
        self._httpd.init(plan)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="hvdtrain-rendezvous")
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)


def iface_of(address: str) -> str:
    """The network interface holding IPv4 ``address`` (a name or dotted quad), for
    ``HOROVOD_GLOO_IFACE``; ``lo`` for loopback addresses.

    Raises:
        ValueError: no local interface has that address (pass ``nics`` explicitly).
    """
    import psutil
    ip = socket.gethostbyname(address)
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    if ip.startswith("127."):
        return "lo"
    raise ValueError(f"no network interface of this host has the address {ip} ({address}); "
                     "name the interface for Gloo with nics=['eth0'] (--nics eth0)")


def rank_env(slot, rendezvous_addr: str, port: int, iface: str, engine: str,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank: this process's, ``extra``, and what ``horovodrun``'s Gloo
    launcher sets (``horovod.runner.gloo_run.create_run_env_vars`` and
    ``create_slot_env_vars``), plus ``HVDTRAIN_ENGINE`` and unbuffered Python output."""
    env = dict(os.environ)
    env.update(extra or {})
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface, "NCCL_SOCKET_IFNAME": iface,
        "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        ENGINE_VAR: engine, "PYTHONUNBUFFERED": "1",
    })
    env["PATH"] = rank_path(extra)
    return env


def rank_path(extra: dict[str, str] | None = None) -> str:
    """The ``PATH`` of a rank: the console scripts (hvdtrain, horovodrun) of this interpreter's
    environment first, then ``extra``'s ``PATH`` if it has one, else this process's."""
    path = (extra or {}).get("PATH", os.environ.get("PATH", ""))
    return f"{Path(sys.executable).parent}{os.pathsep}{path}"


def function_argv(payload: Path, result: Path) -> list[str]:
    """argv of a rank that runs a pickled function (:mod:`hvdtrain.spark.rank_main`)."""
    return [sys.executable, "-m", "hvdtrain.spark.rank_main", str(payload), str(result)]


class RankProcess:
    """A rank's child process: stdout and stderr merged, read in chunks and handed to ``sink``
    (rank 0's go to the driver), the last :data:`TAIL_BYTES` kept for error messages.

    On Linux the command runs under :mod:`hvdtrain.launch.rank_leader`, in a process group of
    its own: when the process that started it dies (a task Spark kills, an executor or Ray
    worker that goes away) the whole group gets SIGKILL (``PR_SET_PDEATHSIG``); :meth:`kill`
    ends the whole group; what the command started and left behind ends with it; signals sent
    with :meth:`send_signal` reach the command. So no rank, and nothing a rank started, outlives
    the job.

    Args:
        argv: the command.
        env: its environment (:func:`rank_env`).
        sink: called with each chunk of output (bytes), from a reader thread.
        cwd: its working directory (default: this process's).

    Raises:
        FileNotFoundError: ``argv[0]`` is not a file and not found on ``env``'s ``PATH``.
        OSError: the process cannot be started.
    """

    def __init__(self, argv: list[str], env: dict[str, str],
                 sink: Callable[[bytes], None] | None = None, cwd: str | None = None):
        self.tail = b""
        self._sink = sink
        program = argv[0]
        if os.sep in program:
            found = os.path.join(cwd or os.getcwd(), program)
            found = found if os.access(found, os.X_OK) and os.path.isfile(found) else None
        else:
            found = shutil.which(program, path=env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        self.grouped = sys.platform == "linux"
        if self.grouped:
            argv = [sys.executable, "-m", "hvdtrain.launch.rank_leader", str(os.getpid()), "--",
                    *argv]
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     process_group=0 if self.grouped else None)
        self._reader = threading.Thread(target=self._pump, daemon=True, name="hvdtrain-rank-out")
        self._reader.start()

    def _pump(self) -> None:
        fd = self.proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self.tail = (self.tail + chunk)[-TAIL_BYTES:]
            if self._sink is not None:
                try:
                    self._sink(chunk)
                except Exception:  # a lost driver connection must not stop the rank
                    self._sink = None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child and its output; its exit status (negative: killed by a signal)."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        # The pipe ends when the rank's process group has (its leader ends the group). A process
        # that left the group (setsid) may hold it longer: then the reader keeps the file open,
        # since closing it under a blocked os.read could hand its number to another file.
        if not self._reader.is_alive():
            self.proc.stdout.close()
        return code

    def kill(self) -> None:
        """SIGKILL to the rank and everything in its process group (nothing when all ended)."""
        if self.grouped:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                return
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()

    def send_signal(self, sig: int) -> None:
        """Hand ``sig`` to the rank's command (its leader passes it on); nothing if it ended."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def tail_text(self) -> str:
        return self.tail.decode("utf-8", "replace")


@contextlib.contextmanager
def signals_to(procs: list[RankProcess]):
    """While inside: SIGINT and SIGTERM sent to this process go on to every rank in ``procs``.

    Each rank runs in a process group of its own (:class:`RankProcess`), so a terminal's Ctrl-C
    reaches only this process; this hands it on, as ``horovodrun`` does, and ``hvdtrain train``
    ranks stop (SIGINT) or write their stop checkpoint (SIGTERM) and exit. A second SIGINT raises
    KeyboardInterrupt at once (the caller then kills the ranks). On leaving, the first signal
    received acts here as it would have: KeyboardInterrupt for SIGINT, the previous handler (by
    default: the end of this process) for SIGTERM. Outside the main thread nothing changes
    (Python takes signals there only).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for proc in procs:
            proc.send_signal(signum)
        if received.count(signal.SIGINT) > 1:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    if received:
        os.kill(os.getpid(), signal.SIGTERM)


# Text of a rank that failed because another one did first: Horovod's shutdown notice and Gloo's
# lost-peer errors (horovod/common/operations.cc, gloo/transport/tcp/pair.cc).
COLLATERAL_MARKERS = ("Horovod has been shut down", "HorovodInternalError",
                      "Connection closed by peer", "Connection reset by peer")


def raised_at(result: Path) -> float | None:
    """When a function rank's exception was raised (seconds since the epoch), from the
    ``RESULT.raised`` file :mod:`hvdtrain.spark.rank_main` writes; None if it did not raise."""
    try:
        return float(Path(str(result) + ".raised").read_text())
    except (OSError, ValueError):
        return None


def cause_first(failures: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """Failed ranks ordered so that the one that caused the failure comes first.

    A rank that failed because a peer did (its last output holds one of
    :data:`COLLATERAL_MARKERS`) comes after those that did not; within each group, the earliest
    failure time first. Horovod's shutdown reaches the other ranks within milliseconds, so the
    times alone can invert, which is why the output decides first.

    Args:
        failures: ``(rank, failed_at, tail)`` per failed rank: ``failed_at`` in seconds since the
            epoch (when the exception was raised, else when the process ended), ``tail`` its last
            output.

    Returns:
        The same tuples, cause first.
    """
    def key(f):
        rank, failed_at, tail = f
        return (any(m in tail for m in COLLATERAL_MARKERS), failed_at, rank)
    return sorted(failures, key=key)


def describe_exit(code: int) -> str:
    """``exited with 3`` or ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with {code}"
