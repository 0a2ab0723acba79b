"""The checks of tests/gpu that one CUDA process can run one after another, run as ONE job: one
launcher, one import of PyTorch and Horovod, one CUDA context (seconds each), where one job per
check cost the GPU check most of its time (16 tests, more than 290 s on one H100). Each case is
what one ``hvdtrain train`` on digits, or one adapter check of :mod:`gpu_checks`, does; it leaves
its files in its own folder and its output in its own log, and each test of tests/gpu asserts on
its case's files under its own test id (tests/gpu/gpujobs.py launches the job).

Launch (one rank: NCCL refuses two ranks on one GPU; TF32 off, see below)::

    NVIDIA_TF32_OVERRIDE=0 horovodrun -np 1 -H localhost:1 python tests/gpu/rank_cases.py \\
        OUT --status OUT/status.json [--cases fp32_cuda,fp32_cpu] [--parent PID]

``OUT/<case>/`` holds a case's files (``metrics.json``, ``checkpoint.pt``; ``result.json`` of an
adapter check) and ``OUT/<case>.log`` its stdout and stderr (file descriptors 1 and 2, so
Horovod's and NCCL's own lines too). The status file, rewritten at each case's start and end,
says which case runs (``running``) and how each ended (``cases``: ``ok``, wall ``seconds``, the
``error``): a case that raises is recorded and the next one runs; a case that does not end within
``--case-timeout`` seconds (a hung collective) has every thread's stack written to its log, and
the job exits 1 with that case still ``running``, which the test side reports under that case's
tests before it starts a job for the cases left. Between cases the environment, ``sys.argv``, the
signal handlers and Keras's session are put back as they were.

``hvdtrain train`` runs in this process through :func:`hvdtrain.cli.main`, the console script's
own entry point, so each case takes the path a launched ``hvdtrain train`` takes after its
imports; ``hvd.init()`` happens once (at the first case; Horovod's settings then hold for every
case, which only changes how often its idle thread wakes at one rank). Checks that need a process
of their own (no GPU visible; Keras on the CPU while a GPU is visible, since Keras's PyTorch
backend picks its device when imported) are gpujobs.py's side jobs. The Keras case runs last:
importing Keras changes nothing the torch cases use, but nothing is left to chance.

TF32 is off for the whole job (``NVIDIA_TF32_OVERRIDE=0``, read by cuDNN and cuBLAS): the fp32
cases compare CUDA with the CPU, where TF32 (a 10-bit mantissa) would be another precision, not
another summation order; the other cases check accuracy bounds that hold either way.

``--dry-run-on-cpu`` runs every case on the CPU (``cuda`` becomes ``cpu``): a check of this
file's machinery on a machine without a GPU, which proves nothing about GPUs.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CASE_TIMEOUT_S = 120.0  # one case (expected: seconds on a GPU): a hung collective ends here
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@dataclass(frozen=True)
class Train:
    """One ``hvdtrain train --dataset digits --no-progress`` run (1,437 train / 360 test samples,
    batch 16). ``resume_from``: the run starts in a copy of that case's folder (its checkpoint)."""
    options: tuple[str, ...]
    epochs: int = 3
    framework: str = "torch"
    resume_from: str | None = None

    def argv(self, out_dir: Path, dry_run: bool = False) -> list[str]:
        """``hvdtrain``'s arguments (after the program name) writing into ``out_dir``."""
        options = [("cpu" if dry_run and o == "cuda" else o) for o in self.options]
        return ["train", "--framework", self.framework, "--dataset", "digits", "--epochs",
                str(self.epochs), "--output-dir", str(out_dir), "--no-progress", *options]


@dataclass(frozen=True)
class Adapter:
    """One adapter-level check of :mod:`gpu_checks` (``layouts`` or ``batchnorm``), after
    ``hvdtrain.torch.init(seed=1)``, written to ``result.json``."""
    check: str


CUDA = ("--device", "cuda")
# In the order they run. The checkpoint comes first: gpujobs.py's CPU-only side job resumes it.
CASES: dict[str, Train | Adapter] = {
    "checkpoint_cuda": Train(CUDA, epochs=2),
    "fp32_cuda": Train(CUDA),
    "fp32_cpu": Train(("--device", "cpu")),
    "bf16_k2": Train((*CUDA, "--precision", "bf16", "-k", "2")),
    "fp16_k2": Train((*CUDA, "--precision", "fp16", "-k", "2")),
    "fp16_overflow": Train((*CUDA, "--precision", "fp16", "-k", "2", "--init-loss-scale", "1e12")),
    "batchnorm": Train((*CUDA, "--batchnorm")),
    "resume_gpu_visible": Train(("--device", "cpu", "--resume"), epochs=4,
                                resume_from="checkpoint_cuda"),
    "layouts": Adapter("layouts"),
    "sync_batchnorm": Adapter("batchnorm"),
    "keras_cuda": Train((*CUDA, "--keras-backend", "torch"), framework="keras"),
}


def copy_run(src: Path, dst: Path) -> None:
    """A run's folder copied to ``dst`` (replaced), to resume there and leave ``src`` as it was."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


def run_train(name: str, case: Train, out: Path, dry_run: bool) -> None:
    """Raises RuntimeError when ``hvdtrain train`` exits non-zero."""
    from hvdtrain import cli
    if case.resume_from:
        copy_run(out / case.resume_from, out / name)
    code = cli.main(case.argv(out / name, dry_run))
    if code != 0:
        raise RuntimeError(f"hvdtrain {' '.join(case.argv(out / name, dry_run))} exited {code}")


def run_adapter(name: str, case: Adapter, out: Path, dry_run: bool) -> None:
    import torch

    import gpu_checks
    import horovod.torch as hvd
    import hvdtrain.torch as ht
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        info = ht.init(seed=1, device="cpu" if dry_run else "cuda")
        device = torch.device(info.device)
        result = {"size": info.size, "device": info.device, "nccl_built": bool(hvd.nccl_built()),
                  "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  case.check: getattr(gpu_checks, case.check)(device)}
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / "result.json").write_text(json.dumps(result, indent=1))


def run_case(name: str, out: Path, dry_run: bool = False) -> None:
    """Run case ``name`` of :data:`CASES` into ``out / name``; raises what it raised."""
    case = CASES[name]
    (run_train if isinstance(case, Train) else run_adapter)(name, case, out, dry_run)


def write_json(path: Path, data: dict) -> None:
    """Atomically: the test side never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@contextmanager
def isolated(log_path: Path):
    """File descriptors 1 and 2 into ``log_path`` (yielded, open); afterwards the environment,
    ``sys.argv``, the working directory, the signal handlers and Keras's session as before."""
    saved_env, saved_argv, saved_cwd = dict(os.environ), list(sys.argv), os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    sys.stdout.flush(), sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    log = open(log_path, "ab", buffering=0)
    os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
    try:
        yield log
    finally:
        try:
            if "keras" in sys.modules:
                sys.modules["keras"].backend.clear_session()
        except Exception:  # noqa: BLE001 - shown in the case's log; the next case runs
            traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0]), os.close(saved_fds[1])
        log.close()
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv[:] = saved_argv
        os.chdir(saved_cwd)
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)


def serve(out: Path, names: list[str], status_path: Path, run: Callable[[str], None],
          case_timeout_s: float = CASE_TIMEOUT_S, parent: int | None = None) -> int:
    """Run ``run(name)`` for each of ``names`` in order, each isolated (:func:`isolated`) with
    its output in ``out/<name>.log``, recording each in ``status_path``. Stops early (exit
    status 0, ``stopped`` set) when the process ``parent`` is gone (a killed pytest leaves no
    job behind). Returns 0; a case over ``case_timeout_s`` seconds ends the process with exit
    status 1 (:func:`faulthandler.dump_traceback_later`)."""
    status = {"pid": os.getpid(), "running": None, "cases": {}, "stopped": None}
    for name in names:
        if parent is not None and not _alive(parent):
            status["stopped"] = f"the test process {parent} is gone"
            break
        started = time.time()
        status["running"] = name
        status["cases"][name] = {"started": started}
        write_json(status_path, status)
        print(f"[rank_cases] {name} ...", flush=True)
        error = None
        with isolated(out / f"{name}.log") as log:
            faulthandler.dump_traceback_later(case_timeout_s, exit=True, file=log)
            try:
                run(name)
            except BaseException as exc:  # noqa: BLE001 - recorded; the next case runs
                traceback.print_exc()
                error = f"{type(exc).__name__}: {exc}"
            finally:
                faulthandler.cancel_dump_traceback_later()
        seconds = round(time.time() - started, 2)
        status["cases"][name].update(ok=error is None, seconds=seconds, error=error)
        status["running"] = None
        write_json(status_path, status)
        print(f"[rank_cases] {name} {'ok' if error is None else 'FAILED'} ({seconds} s)",
              flush=True)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--status", type=Path, required=True, help="the status file (JSON)")
    p.add_argument("--cases",
                   help=f"comma-separated, in order (default: all of {', '.join(CASES)})")
    p.add_argument("--parent", type=int, help="stop before the next case once this pid is gone")
    p.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S, help="seconds per case")
    p.add_argument("--dry-run-on-cpu", action="store_true")
    args = p.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"--cases: unknown {', '.join(unknown)}; the cases: {', '.join(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    return serve(args.out, names, args.status,
                 lambda name: run_case(name, args.out, args.dry_run_on_cpu),
                 args.case_timeout, args.parent)


if __name__ == "__main__":
    sys.exit(main())
