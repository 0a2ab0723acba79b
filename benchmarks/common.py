"""Helpers shared by the benchmark scripts: launching runs, medians, JSON, plots, README tables.

Timings on shared machines are noisy, so every comparison is a ratio of runs made side by side in
one invocation, and each number is the median over ``--repeats`` runs.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
# Where results (JSON, PNG) go; tests point this at a temporary directory.
RESULTS = Path(os.environ.get("HVDTRAIN_BENCH_RESULTS", HERE / "results"))


def machine() -> dict:
    """Facts about the machine the numbers were measured on."""
    import multiprocessing

    import torch
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": multiprocessing.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(), "torch": torch.__version__.split("+")[0],
            "horovod": _version("horovod"), "tensorflow": _version("tensorflow-cpu")}


def _version(dist: str) -> str:
    import importlib.metadata as md
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"


def base_env(yield_when_idle: bool) -> dict:
    """The environment for a run: this venv first on PATH, no ``HOROVOD_*`` settings from the
    caller's shell; Open MPI's yield setting on, or unset (then each rank's hvdtrain ``init()``
    chooses, :func:`hvdtrain.launch.tuning.rank_settings`; a plain Horovod loop gets Open MPI's
    default, off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.pop("OMPI_MCA_mpi_yield_when_idle", None)
    if yield_when_idle:
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return env


def hvdtrain_launch(np_: int, command: list[str]) -> list[str]:
    """argv of ``hvdtrain launch`` on this host with ``np_`` slots (hvdtrain's own defaults)."""
    hostfile = Path(tempfile.gettempdir()) / f"hvdtrain-bench-localhost-{np_}.txt"
    hostfile.write_text(f"localhost slots={np_}\n")
    return [str(BIN / "hvdtrain"), "launch", "--hostfile", str(hostfile), "-np", str(np_), "--",
            *command]


def horovodrun(np_: int, command: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """argv of plain ``horovodrun -np N -H localhost:N`` (Horovod's defaults)."""
    return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", *extra, *command]


def run_json(argv: list[str], env: dict, timeout: int = 900) -> dict:
    """Run a job whose command (the end of ``argv``) accepts ``--json-out PATH``, and return the
    dict its rank 0 wrote there. (Parsing stdout is unreliable: launchers tag and may split long
    lines.)

    Raises:
        RuntimeError: the job failed, wrote nothing, or ran past ``timeout`` seconds; the
            message holds its output tail.
    """
    return run_json_together([argv], env, timeout)[0]


def run_json_together(argvs: list[list[str]], env: dict, timeout: int = 900) -> list[dict]:
    """:func:`run_json` for several jobs started at once (independent processes side by side),
    in the order of ``argvs``. When one fails, the others are killed at once (they may be
    waiting for it at a start barrier); their output goes to files, not pipes, so none blocks
    on a full pipe while the others run.

    Raises:
        RuntimeError: a job failed, wrote nothing, or ran past ``timeout`` seconds; the message
            holds its output tail.
    """
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-together-") as where:
        jsons = [Path(where) / f"{i}.json" for i in range(len(argvs))]
        logs = [open(Path(where) / f"{i}.log", "w") for i in range(len(argvs))]
        procs = []
        try:
            for argv, out, log in zip(argvs, jsons, logs):
                procs.append(subprocess.Popen([*argv, "--json-out", str(out)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    i = failed[0] if failed else next(
                        i for i, p in enumerate(procs) if p.poll() is None)
                    _fail(argvs[i], procs[i].poll(), Path(where) / f"{i}.log")
                time.sleep(0.05)
            for i, (proc, out) in enumerate(zip(procs, jsons)):
                if proc.returncode != 0 or not out.exists() or not out.read_text().strip():
                    _fail(argvs[i], proc.returncode, Path(where) / f"{i}.log")
            return [json.loads(out.read_text()) for out in jsons]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()


def _fail(argv: list[str], code, log: Path):
    tail = log.read_text(errors="replace")[-3000:]
    what = "timed out" if code is None else f"failed ({code})"
    raise RuntimeError(f"{' '.join(argv)} {what}:\n{tail}")


def median(values) -> float:
    return float(statistics.median(values))


def save(name: str, payload: dict) -> Path:
    """Write ``results/<name>.json`` (with the machine description) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1 else (
            f"{v:,.1f}" if isinstance(v, float) else str(v))
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def update_readme(section: str, text: str) -> None:
    """Replace the text between ``<!-- section:start -->`` and ``<!-- section:end -->`` in
    benchmarks/README.md (the markers must exist)."""
    readme = HERE / "README.md"
    content = readme.read_text()
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    if start not in content or end not in content:
        raise ValueError(f"benchmarks/README.md lacks the markers {start} ... {end}")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def plot(path: Path, draw) -> None:
    """Save a matplotlib figure drawn by ``draw(ax)`` as PNG (no display needed)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    draw(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
