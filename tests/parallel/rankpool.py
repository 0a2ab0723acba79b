"""Ranks that live across many tests: one ``horovodrun -np N`` job whose ranks run, one after
another, the rank code that each test asks for (a script of this folder, or a function such as
``hvdtrain.cli:main``), so a test pays for its own steps, not for a launcher and N imports of
PyTorch/TensorFlow/Horovod. Horovod's CI runs whole modules inside one job for the same reason
(``horovodrun -np 2 pytest test/parallel/test_torch.py``); DeepSpeed's ``DistributedTest`` keeps
a pool of rank processes across tests (``reuse_dist_env``).

The test side (:class:`RankPool`) writes request ``NNNNNN.req.json`` into the pool's folder;
every rank (:func:`serve`, this file run as a script) waits for it, runs it with its stdout and
stderr (file descriptors 1 and 2) going to ``NNNNNN.rankR.out``, and writes
``NNNNNN.rankR.json`` (``{"code": exit status, "seconds": wall time}``). A request holds the
``argv`` of the rank code and the environment variables to set for it; the process's
environment, ``sys.argv``, signal handlers, working directory and Keras's global state (session,
dtype policy) are restored after each request.

A test fails with both ranks' output when a rank's code exits non-zero; a request that does not
end within its timeout (a hung collective) or a pool that dies ends the pool with a message that
names the test, and the next request starts a new pool.

    horovodrun -np 2 -H localhost:2 python tests/parallel/rankpool.py FOLDER PARENT_PID
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hvdtrain.launch import procfs

POLL_S = 0.02  # how often a rank or the test looks for the next file (seconds)
STOP = "stop"  # the file that ends every rank's loop
# Variables every pool's ranks start with. Not HOROVOD_TIMELINE=DYNAMIC (what hvd.start_timeline
# needs, read once at hvd.init()): its writer thread polls a core while the pool is idle; the
# scripts that count all-reduces on the timeline get a pool of their own with it.
POOL_ENV = {"PYTHONUNBUFFERED": "1"}
TIMELINE_ENV = {"HOROVOD_TIMELINE": "DYNAMIC"}
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


# ---------------------------------------------------------------------------- rank side


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise SystemExit("rankpool.py runs under horovodrun or mpirun (no rank variable is set)")


def _call(target: str, args: list[str]) -> int:
    """Run ``path/to/script.py`` as ``__main__`` or ``package.module:function(args)``; its exit
    status (0, the SystemExit code, or 1 with the traceback printed for an exception)."""
    import runpy
    try:
        if ":" in target:
            module, name = target.split(":")
            sys.argv = [module, *args]
            code = getattr(__import__(module, fromlist=[name]), name)(list(args))
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
            code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as the request's failure, the rank goes on
        traceback.print_exc()
        code = 1
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def _reset_frameworks() -> None:
    """Undo what a request may leave in Keras's process-wide state."""
    if "keras" in sys.modules:
        keras = sys.modules["keras"]
        keras.backend.clear_session()
        keras.config.set_dtype_policy("float32")


def _run_request(req: dict, out_path: Path) -> int:
    saved_env, saved_argv, saved_cwd = dict(os.environ), list(sys.argv), os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    sys.stdout.flush(), sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(out_path, "wb", buffering=0) as out:
        os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
    try:
        os.environ.update(req.get("env", {}))
        return _call(req["target"], req.get("args", []))
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        try:
            _reset_frameworks()
        except Exception:  # noqa: BLE001 - shown in the request's output, the pool goes on
            traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0]), os.close(saved_fds[1])
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv[:] = saved_argv
        os.chdir(saved_cwd)
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _end_with(parent: int) -> None:
    """End this rank (exit 3) once the test process ``parent`` is gone, from a thread of its
    own: between requests and inside one too, e.g. a rank stuck in a collective its peer never
    joins when pytest was killed (seen: such pools left running for an hour). The launcher
    (mpirun, or Horovod's Gloo driver) then ends the job."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:  # the id reused by another user's process: cannot tell
                pass

    threading.Thread(target=watch, name="rankpool-parent", daemon=True).start()


def serve(folder: Path, parent: int) -> int:
    """Each rank's loop: run request 1, 2, ... as they appear; 0 when the ``stop`` file appears;
    exit 3 once the test process ``parent`` is gone (:func:`_end_with`: a killed pytest leaves
    no pool behind)."""
    _end_with(parent)
    rank, n = _rank(), 1
    while True:
        req_path = folder / f"{n:06d}.req.json"
        while not req_path.exists():
            if (folder / STOP).exists():
                return 0
            time.sleep(POLL_S)
        req = json.loads(req_path.read_text())
        result = {"code": None, "seconds": 0.0}
        loaded = len(sys.modules)
        if req.get("ranks") is None or rank in req["ranks"]:
            started = time.monotonic()
            result["code"] = _run_request(req, folder / f"{n:06d}.rank{rank}.out")
            result["seconds"] = round(time.monotonic() - started, 3)
        _write_json(folder / f"{n:06d}.rank{rank}.json", result)
        if len(sys.modules) > loaded:
            # The request imported modules (the first ones: PyTorch, TensorFlow, Horovod): its
            # garbage collected once, what is left frozen, so that the collections of the
            # requests after it skip the frameworks' objects (hvdtrain.runtime.import_frozen).
            gc.collect()
            gc.freeze()
        n += 1


# ---------------------------------------------------------------------------- test side


class RankPoolError(Exception):
    """A request failed, hung or found the pool dead; the message names the test and holds
    every rank's output."""


@dataclass
class Done:
    """What the ranks of one request left.

    Attributes:
        codes: ``{rank: exit status}`` of the ranks that ran it.
        outputs: ``{rank: stdout and stderr}`` as each rank printed them.
        seconds: ``{rank: wall seconds}``.
    """
    codes: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    @property
    def returncode(self) -> int:
        """The first non-zero exit status of the ranks (rank order), else 0."""
        return next((c for _, c in sorted(self.codes.items()) if c), 0)

    @property
    def text(self) -> str:
        """Every rank's output, rank by rank (words a person would read, never numbers)."""
        return "\n".join(self.outputs[r] for r in sorted(self.outputs))

    def rank(self, rank: int) -> str:
        return self.outputs.get(rank, "")


def _tail(text: str, limit: int = 4000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


class RankPool:
    """One long-lived ``horovodrun -np np_`` job on this host whose ranks run test requests.

    Args:
        folder: where requests, results, outputs and the launcher's log go (created).
        argv: ``argv`` of the launcher up to (not including) ``python rankpool.py``
            (e.g. ``jobs.horovodrun(2)``).
        env: the whole environment of the launcher and its ranks.
        name: shown in messages (which pool: its variables).
    """

    def __init__(self, folder: Path, argv: list[str], env: dict, name: str = ""):
        self.folder, self.argv, self.env, self.name = Path(folder), list(argv), dict(env), name
        self.np = int(argv[argv.index("-np") + 1])
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._n = 0
        self._log = None

    # The folder of the pool started now: every start gets its own (numbers start at 1).
    @property
    def _dir(self) -> Path:
        return self.folder / f"start{self.starts}"

    def _start(self) -> None:
        self.starts += 1
        self._dir.mkdir(parents=True)
        self._n = 0
        self._log = open(self._dir / "launcher.log", "wb")
        cmd = [*self.argv, sys.executable, str(Path(__file__).resolve()), str(self._dir),
               str(os.getpid())]
        self.proc = subprocess.Popen(cmd, env={**self.env, **POOL_ENV}, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, target: str, *args: str, env: dict | None = None, ranks=None,
            timeout: float = 600, check: bool = True) -> Done:
        """Run ``target`` (a script path, run as ``__main__``, or ``module:function`` called with
        the argument list) with ``args`` on the ranks ``ranks`` (default: all) and wait for it.

        Args:
            env: variables set for this request only.
            timeout: seconds; past it the pool is ended (a hung collective) and this fails.
            check: raise when a rank exits non-zero.

        Raises:
            RankPoolError: a rank exited non-zero (``check``), the request hung, or the pool
                died; the message names the test and quotes every rank's output.
        """
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        if not self.alive:
            self._start()
        self._n += 1
        n, folder = self._n, self._dir
        want = list(range(self.np)) if ranks is None else list(ranks)
        _write_json(folder / f"{n:06d}.req.json", {
            "target": str(target), "args": [str(a) for a in args], "env": env or {},
            "ranks": None if ranks is None else want, "test": test})
        deadline = time.monotonic() + timeout
        grace_end = None  # a rank failed: the others get this long to end too
        done = Done()
        while True:
            for r in want:
                path = folder / f"{n:06d}.rank{r}.json"
                if r not in done.codes and path.exists():
                    res = json.loads(path.read_text())
                    done.codes[r], done.seconds[r] = res["code"], res["seconds"]
            if len(done.codes) == len(want):
                break
            problem = None
            if not self.alive:
                problem = f"the pool ended (exit {self.proc.returncode})"
            elif time.monotonic() > deadline:
                problem = f"no end within {timeout:.0f} s (a hung collective?)"
            elif any(done.codes.values()):
                grace_end = grace_end or time.monotonic() + 60
                if time.monotonic() > grace_end:
                    problem = "a rank failed and the others did not end within 60 s"
            if problem:
                self.kill()
                raise RankPoolError(self._report(test, n, folder, want, done,
                                                 f"{self.name}: {problem}; pool ended"))
            time.sleep(POLL_S)
        for r in want:
            out = folder / f"{n:06d}.rank{r}.out"
            done.outputs[r] = out.read_text(errors="replace") if out.exists() else ""
        if check and done.returncode:
            raise RankPoolError(self._report(test, n, folder, want, done,
                                             f"{self.name}: exit codes {done.codes}"))
        return done

    def _report(self, test, n, folder, want, done, what) -> str:
        lines = [f"{test}: {what}"]
        for r in want:
            out = folder / f"{n:06d}.rank{r}.out"
            text = out.read_text(errors="replace") if out.exists() else "(no output)"
            lines.append(f"--- rank {r} (exit {done.codes.get(r, 'none: still running')})\n"
                         f"{_tail(text)}")
        log = folder / "launcher.log"
        if log.exists():
            lines.append(f"--- launcher\n{_tail(log.read_text(errors='replace'), 2000)}")
        return "\n".join(lines)

    def stop(self) -> None:
        """Ask every rank to stop, without waiting (:meth:`close` waits)."""
        if self.alive:
            (self._dir / STOP).touch()

    def close(self, timeout: float = 60) -> None:
        """Ask every rank to stop and wait for the launcher (killed after ``timeout`` s)."""
        self.stop()
        if self.alive:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """End the launcher and every rank now: every process of the launcher's session (which
        mpirun and the ranks keep: Open MPI gives each rank a process group of its own, not a
        session), and every descendant of those that left it (Horovod's Gloo launch and a
        request's own ``start_new_session`` children start sessions of their own)."""
        if self.proc is not None:
            import psutil
            pids = set(procfs.session_members(self.proc.pid))
            for pid in list(pids):
                pids |= procfs.descendants(pid)
            procs = []
            for pid in pids:
                try:
                    procs.append(psutil.Process(pid))
                    procs[-1].kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait()
            psutil.wait_procs(procs, timeout=30)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1]), int(sys.argv[2])))
