"""The test side of tests/gpu: :class:`SharedRuns` starts, once per pytest session, the ONE job
that runs every check one CUDA process can run (:mod:`rank_cases`, under ``horovodrun -np 1``),
and beside it, at the same time, the few checks that need a process of their own (:data:`SIDES`:
another environment, or a probe script); a side job that needs a case's files starts as soon as
that case is done. Each test then waits for the case or side job it asserts on, and fails with
that case's own error and output when it failed. Numbers come from the files the jobs write
(metrics.json, checkpoint.pt, JSON), never from their console.

Time: one launcher, one import of PyTorch and Horovod and one CUDA context for 11 cases, the
side jobs overlapping them, where each of 16 tests used to start its own job (more than 290 s on
one H100). With ``HVDTRAIN_GPU_TIMINGS=FILE`` (scripts/gpu_check.sh sets it) the seconds of each
launch, case and side job are written to FILE at the end of the session.

Nothing here waits for a time: every wait is for an event (a status file, a process's end) with a
deadline that only a hang reaches: :data:`rank_cases.CASE_TIMEOUT_S` per case,
:data:`JOB_DEADLINE_S` for the shared job with its relaunches, :data:`SIDE_TIMEOUT_S` per side
job.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import rank_cases
from rank_cases import Train

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
JOB_DEADLINE_S = 600.0  # the shared job, relaunches included (expected: about a minute)
SIDE_TIMEOUT_S = 300.0  # one side job (expected: 10-30 s)
POLL_S = 0.05  # how often a wait looks at the status file and the processes (seconds)
TIMINGS_ENV = "HVDTRAIN_GPU_TIMINGS"


def job_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment for a job, with this interpreter's scripts first on PATH,
    idle MPI ranks yielding their core, unbuffered Python, and ``extra`` (None: removed)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def horovodrun(np_: int, *command: str) -> list[str]:
    """argv of ``horovodrun -np N -H localhost:N <command>``."""
    return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", *command]


def hvdtrain(case: Train, out_dir: Path) -> list[str]:
    """``horovodrun -np 1 hvdtrain train ...`` of ``case`` (a launched CLI run)."""
    return horovodrun(1, str(BIN / "hvdtrain"), *case.argv(out_dir))


@dataclass
class Side:
    """A check that needs a process of its own. ``argv(out_dir)`` builds its command; ``after``:
    a case it needs (its folder is copied into ``out_dir`` first); ``env``: variables set (a
    value of None removes one)."""
    argv: object
    env: dict = field(default_factory=dict)
    after: str | None = None


# The CPU runs beside the GPU job get a few cores each (hvdtrain gives a lone rank all of them).
FEW_CORES = {"OMP_NUM_THREADS": "4"}
SIDES: dict[str, Side] = {
    # A checkpoint written on the GPU, resumed where no GPU is visible (as on a CPU machine).
    "resume_cpu_only": Side(lambda out: hvdtrain(Train(("--device", "cpu", "--resume"), epochs=4),
                                                  out),
                            {"CUDA_VISIBLE_DEVICES": "", **FEW_CORES}, after="checkpoint_cuda"),
    # Keras's PyTorch backend chooses its device when imported: a CPU rank on a GPU host.
    "keras_cpu_rank": Side(lambda out: hvdtrain(Train(("--device", "cpu", "--keras-backend",
                                                       "torch"), framework="keras"), out),
                           FEW_CORES),
    # ... and without hvdtrain train's KERAS_TORCH_DEVICE, Keras takes the GPU: init refuses.
    "keras_refuses_gpu": Side(lambda out: [sys.executable, "-c", "import hvdtrain.keras as hk; "
                                           "hk.init(device='cpu')"],
                              {"KERAS_BACKEND": "torch", "KERAS_TORCH_DEVICE": None}),
    # Host synchronisations of a Keras step on the GPU (torch.cuda.set_sync_debug_mode).
    "keras_syncs": Side(lambda out: [sys.executable,
                                     str(HERE.parent / "unit" / "keras_step_syncs.py"),
                                     str(out / "counts.json"), "--cuda"],
                        {"KERAS_BACKEND": "torch"}),
}


@dataclass
class Ran:
    """How a case or side job ended: ``ok``, ``why`` (when not), ``out`` (its folder), its
    output, wall ``seconds``; side jobs also ``returncode``, ``stdout``, ``stderr``."""
    ok: bool
    out: Path
    why: str = ""
    output: str = ""
    seconds: float | None = None
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class SharedRuns:
    """The shared job and the side jobs of one pytest session, under ``root``.

    Args:
        root: where every case's and side job's folder, log and the status files go.
        cases: the cases of :data:`rank_cases.CASES` to run, in order.
        sides: the side jobs (default :data:`SIDES`).
        job: ``job(status_path, names) -> argv`` of the shared job (default: ``rank_cases.py``
            under ``horovodrun -np 1``; the unit tests give a stand-in).
        job_env_extra: variables for the shared job (default: TF32 off, ``NVIDIA_TF32_OVERRIDE=0``).
        deadline_s, side_timeout_s: the deadlines above.
    """

    def __init__(self, root: Path, cases: list[str] | None = None,
                 sides: dict[str, Side] | None = None, job=None,
                 job_env_extra: dict | None = None, deadline_s: float = JOB_DEADLINE_S,
                 side_timeout_s: float = SIDE_TIMEOUT_S):
        self.root = Path(root)
        self.cases = list(rank_cases.CASES) if cases is None else list(cases)
        self.sides = dict(SIDES if sides is None else sides)
        self.job = job or self._rank_cases_job
        self.job_env = job_env(job_env_extra if job_env_extra is not None
                               else {"NVIDIA_TF32_OVERRIDE": "0"})
        self.deadline_s, self.side_timeout_s = deadline_s, side_timeout_s
        self.results: dict[str, Ran] = {}
        self.side_results: dict[str, Ran] = {}
        self.launches: list[dict] = []
        self._proc = self._status = self._console = None
        self._sides: dict[str, tuple] = {}  # running: name -> (Popen, start, files)
        self._t0 = time.monotonic()

    def _rank_cases_job(self, status: Path, names: list[str]) -> list[str]:
        return horovodrun(1, sys.executable, str(HERE / "rank_cases.py"), str(self.root),
                          "--status", str(status), "--cases", ",".join(names),
                          "--parent", str(os.getpid()))

    # -- starting ----------------------------------------------------------------------------
    def start(self) -> "SharedRuns":
        """Start the shared job, and every side job that waits for no case."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._launch(self.cases)
        self._poll()
        return self

    def _launch(self, names: list[str]) -> None:
        n = len(self.launches) + 1
        self._status = self.root / f"status-{n}.json"
        self._console = self.root / f"job-{n}.out"
        with open(self._console, "wb") as console:
            self._proc = subprocess.Popen(self.job(self._status, names), env=self.job_env,
                                          stdout=console, stderr=subprocess.STDOUT)
        self.launches.append({"cases": names, "started_s": self._since(), "exit": None})

    def _since(self) -> float:
        return round(time.monotonic() - self._t0, 2)

    # -- following ---------------------------------------------------------------------------
    def _poll(self) -> None:
        if self._proc is not None:
            self._follow_job()
        for name, side in self.sides.items():
            if name in self.side_results or name in self._sides:
                continue
            if side.after is None or (side.after in self.results and self.results[side.after].ok):
                self._start_side(name, side)
            elif side.after in self.results:
                self.side_results[name] = Ran(False, self.root / name, why=(
                    f"not run: it needs case {side.after!r}, which failed"))
        for name in list(self._sides):
            self._follow_side(name)

    def _status_now(self) -> dict:
        try:
            return json.loads(self._status.read_text())
        except (OSError, ValueError):
            return {}

    def _finish_case(self, name: str, entry: dict) -> None:
        log = self.root / f"{name}.log"
        self.results[name] = Ran(bool(entry.get("ok")), self.root / name,
                                 why=entry.get("error") or "", output=_read(log),
                                 seconds=entry.get("seconds"))

    def _follow_job(self) -> None:
        status = self._status_now()
        for name, entry in status.get("cases", {}).items():
            if "ok" in entry and name not in self.results:
                self._finish_case(name, entry)
        code = self._proc.poll()
        over = time.monotonic() - self._t0 > self.deadline_s
        if code is None and not over:
            return
        if code is None:
            self._proc.kill()
            code = self._proc.wait()
        status = self._status_now()  # what it wrote before it ended
        for name, entry in status.get("cases", {}).items():
            if "ok" in entry and name not in self.results:
                self._finish_case(name, entry)
        launch = self.launches[-1]
        launch.update(exit=code, seconds=round(self._since() - launch["started_s"], 2))
        console = _read(self._console)
        self._proc = None
        running = status.get("running")
        pending = [n for n in launch["cases"] if n not in self.results]
        if running in pending:
            why = (f"did not finish within the shared job's deadline ({self.deadline_s:.0f} s)"
                   if over else f"the shared job ended (exit {code}) during this case "
                   f"(a case over {rank_cases.CASE_TIMEOUT_S:.0f} s has every thread's stack "
                   "in its output)")
            self.results[running] = Ran(False, self.root / running, why=why,
                                        output=_read(self.root / f"{running}.log") + "\n"
                                        + _tail(console))
            pending.remove(running)
        if not pending:
            return
        if over or running is None:  # nothing ran (start-up failed), or no time left
            when = "between cases" if status.get("cases") else "before its first case"
            why = ("not run: the shared job's deadline passed" if over else
                   f"not run: the shared job ended (exit {code}) {when}")
            for name in pending:
                self.results[name] = Ran(False, self.root / name, why=why, output=_tail(console))
            return
        self._launch(pending)  # a new job for the cases left

    def _start_side(self, name: str, side: Side) -> None:
        out = self.root / name
        if side.after:
            rank_cases.copy_run(self.root / side.after, out)
        out.mkdir(parents=True, exist_ok=True)
        files = (open(self.root / f"{name}.stdout", "wb"), open(self.root / f"{name}.stderr", "wb"))
        proc = subprocess.Popen(side.argv(out), env=job_env(side.env), stdout=files[0],
                                stderr=files[1])
        self._sides[name] = (proc, time.monotonic(), files)

    def _follow_side(self, name: str) -> None:
        proc, started, files = self._sides[name]
        code = proc.poll()
        late = time.monotonic() - started > self.side_timeout_s
        if code is None and not late:
            return
        if code is None:
            proc.kill()
            code = proc.wait()
        for f in files:
            f.close()
        del self._sides[name]
        stdout, stderr = _read(Path(files[0].name)), _read(Path(files[1].name))
        why = (f"did not end within {self.side_timeout_s:.0f} s" if late else
               f"exited {code}" if code else "")
        self.side_results[name] = Ran(not why, self.root / name, why=why,
                                      output=_tail(stdout) + "\n" + _tail(stderr),
                                      seconds=round(time.monotonic() - started, 2),
                                      returncode=code, stdout=stdout, stderr=stderr)

    def _wait(self, done) -> None:
        while not done():
            self._poll()
            if not done():
                time.sleep(POLL_S)

    # -- what the tests use ------------------------------------------------------------------
    def case(self, name: str) -> Path:
        """The folder of case ``name`` once it ran; fails the calling test with the case's
        error and output when it failed or could not run."""
        if name not in self.cases:
            raise KeyError(f"{name!r} is not among this session's cases: {', '.join(self.cases)}")
        self._wait(lambda: name in self.results)
        ran = self.results[name]
        if not ran.ok:
            pytest.fail(f"shared GPU job, case {name!r}: {ran.why}\n--- its output "
                        f"({self.root / (name + '.log')}), last part:\n{_tail(ran.output)}",
                        pytrace=False)
        return ran.out

    def side(self, name: str, check: bool = True) -> Ran:
        """Side job ``name`` once it ended; with ``check``, fails the calling test with its
        output when it did not end with exit status 0."""
        self._wait(lambda: name in self.side_results)
        ran = self.side_results[name]
        if check and not ran.ok:
            pytest.fail(f"side job {name!r}: {ran.why}\n--- its output:\n{_tail(ran.output)}",
                        pytrace=False)
        return ran

    def close(self) -> dict:
        """End whatever still runs, and write the timings (``timings.json`` in ``root``, and
        ``$HVDTRAIN_GPU_TIMINGS`` when set); returns them."""
        if self._proc is not None:
            launch = self.launches[-1]
            try:  # a job whose cases are all done is ending by itself: let it
                if any(n not in self.results for n in launch["cases"]):
                    raise subprocess.TimeoutExpired(launch["cases"], 0)
                code = self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            launch.update(exit=code, seconds=round(self._since() - launch["started_s"], 2))
            self._proc = None
        for proc, _, files in self._sides.values():
            proc.kill()
            proc.wait()
            for f in files:
                f.close()
        timings = {
            "total_s": self._since(),
            "launches": self.launches,
            "cases": {n: {"ok": r.ok, "seconds": r.seconds} for n, r in self.results.items()},
            "sides": {n: {"ok": r.ok, "exit": r.returncode, "why": r.why, "seconds": r.seconds,
                          "after": self.sides[n].after}
                      for n, r in self.side_results.items()}}
        text = json.dumps(timings, indent=1) + "\n"
        (self.root / "timings.json").write_text(text)
        if os.environ.get(TIMINGS_ENV):
            Path(os.environ[TIMINGS_ENV]).write_text(text)
        return timings


def metrics(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "metrics.json").read_text())
