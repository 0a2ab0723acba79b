"""``hvdtrain doctor``: what is installed and usable, from ``horovodrun --check-build``, and the
GPUs ``nvidia-smi`` lists.

No framework is imported: Horovod's own check tells which frameworks its build supports, and
torch's CUDA version is read from its ``torch/version.py`` file.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hvdtrain import runtime

# The frameworks hvdtrain has adapters for; a build needs at least one.
SUPPORTED_FRAMEWORKS = ("PyTorch", "TensorFlow")
# The rebuild that gives Horovod NCCL (scripts/setup.sh; README "GPU set-up").
NCCL_REBUILD = "rerun `HVDTRAIN_GPU=1 make setup` to build Horovod with NCCL"
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=name,driver_version,compute_cap",
                    "--format=csv,noheader")


@dataclass
class BuildInfo:
    """What ``horovodrun --check-build`` reported.

    Attributes:
        version: Horovod's version, e.g. ``"0.28.1"``.
        sections: section title (``"Available Frameworks"``, ``"Available Controllers"``,
            ``"Available Tensor Operations"``) -> {name: built?}.
    """
    version: str
    sections: dict[str, dict[str, bool]] = field(default_factory=dict)

    def available(self, section: str) -> list[str]:
        """Names marked ``[X]`` in the section whose title contains ``section``."""
        for title, items in self.sections.items():
            if section.lower() in title.lower():
                return [name for name, ok in items.items() if ok]
        return []


def parse_check_build(text: str) -> BuildInfo:
    """Parse the output of ``horovodrun --check-build``.

    Raises:
        ValueError: the text has no ``Horovod vX.Y.Z`` line (not that command's output).
    """
    match = re.search(r"Horovod v(\S+?):?\s*$", text, re.MULTILINE)
    if not match:
        raise ValueError("not the output of 'horovodrun --check-build' (no 'Horovod vX.Y.Z:' line)")
    info = BuildInfo(version=match.group(1))
    current = None
    for line in text.splitlines():
        item = re.match(r"\s*\[([ Xx])\]\s+(.+?)\s*$", line)
        if item and current is not None:
            info.sections[current][item.group(2)] = item.group(1) in "Xx"
        elif line.strip().endswith(":") and not line.startswith("Horovod"):
            current = line.strip().rstrip(":")
            info.sections[current] = {}
    return info


@dataclass(frozen=True)
class GPU:
    """One GPU as ``nvidia-smi`` lists it: ``name``, ``driver`` version and ``compute_cap``
    (compute capability, e.g. ``"9.0"``)."""
    name: str
    driver: str
    compute_cap: str


@dataclass(frozen=True)
class Machine:
    """What doctor looks at besides Horovod.

    Attributes:
        gpus: the GPUs ``nvidia-smi`` lists (none without it).
        driver_cuda: the newest CUDA version the driver supports (``nvidia-smi``'s "CUDA
            Version"), or None.
        gpu_problem: why there is no GPU list (``"nvidia-smi not found"``, its error), or None.
        torch_cuda: the CUDA version torch was built for (``"13.0"``); ``""`` for a CPU build;
            None when torch is not installed.
    """
    gpus: tuple[GPU, ...] = ()
    driver_cuda: str | None = None
    gpu_problem: str | None = None
    torch_cuda: str | None = None


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader``
    (one ``name, driver, capability`` line per GPU); lines of another shape are skipped."""
    gpus = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.rsplit(",", 2)]
        if len(parts) == 3 and all(parts):
            gpus.append(GPU(*parts))
    return gpus


def parse_driver_cuda(text: str) -> str | None:
    """The ``CUDA Version: X.Y`` of plain ``nvidia-smi``'s header, or None."""
    match = re.search(r"CUDA Version:\s*([0-9][0-9.]*)", text)
    return match.group(1) if match else None


def parse_torch_version_py(text: str) -> str:
    """The ``cuda`` of torch's ``torch/version.py`` (``cuda: Optional[str] = '13.0'``): the
    version, or ``""`` for a CPU build (``= None``)."""
    match = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else ""


def torch_cuda_version() -> str | None:
    """The CUDA version of the installed torch (``""``: a CPU build; None: no torch), read from
    ``torch/version.py`` without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        return parse_torch_version_py((Path(spec.origin).parent / "version.py").read_text())
    except OSError:
        return ""


def _run(argv) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


@functools.lru_cache(maxsize=1)
def machine() -> Machine:
    """This machine's GPUs (``nvidia-smi``) and torch's CUDA version; computed once."""
    torch_cuda = torch_cuda_version()
    if not shutil.which("nvidia-smi"):
        return Machine(gpu_problem="nvidia-smi not found", torch_cuda=torch_cuda)
    try:
        query = _run(NVIDIA_SMI_QUERY)
        header = _run(["nvidia-smi"])
    except (OSError, subprocess.SubprocessError) as exc:
        return Machine(gpu_problem=f"nvidia-smi failed: {exc}", torch_cuda=torch_cuda)
    if query.returncode != 0:
        error = (query.stdout + query.stderr).strip().splitlines() or ["no output"]
        return Machine(gpu_problem=f"nvidia-smi failed: {error[0]}", torch_cuda=torch_cuda)
    return Machine(gpus=tuple(parse_nvidia_smi(query.stdout)),
                   driver_cuda=parse_driver_cuda(header.stdout), torch_cuda=torch_cuda)


def describe_gpus(m: Machine) -> str:
    """``2 x NVIDIA H100 80GB HBM3 (compute capability 9.0, driver 580.159.04)``, one group per
    kind of GPU, or why there are none."""
    if not m.gpus:
        return f"none ({m.gpu_problem or 'nvidia-smi lists none'})"
    kinds: dict[GPU, int] = {}
    for gpu in m.gpus:
        kinds[gpu] = kinds.get(gpu, 0) + 1
    return "; ".join(f"{n} x {g.name} (compute capability {g.compute_cap}, driver {g.driver})"
                     for g, n in kinds.items())


def describe_cuda(m: Machine) -> str:
    """torch's CUDA version and the driver's, e.g. ``torch built for 13.0; driver supports up
    to 13.0``."""
    if m.torch_cuda is None:
        torch = "torch not installed"
    elif m.torch_cuda:
        torch = f"torch built for {m.torch_cuda}"
    else:
        torch = "torch is a CPU build"
    driver = f"driver supports up to {m.driver_cuda}" if m.driver_cuda else "no NVIDIA driver seen"
    return f"{torch}; {driver}"


def has_nccl(info: BuildInfo) -> bool:
    """Whether Horovod's build lists NCCL among its tensor operations (GPU all-reduce)."""
    return "NCCL" in info.available("Tensor Operations")


def gpu_notes(info: BuildInfo, m: Machine) -> list[str]:
    """What the build and the GPUs do not agree on, with what to do: GPUs but no NCCL (rebuild:
    :data:`NCCL_REBUILD`), or NCCL but no GPU visible."""
    if m.gpus and not has_nccl(info):
        note = (f"this machine has {len(m.gpus)} GPU(s) but Horovod was built without NCCL, so "
                f"its all-reduces do not run on the GPUs: {NCCL_REBUILD}")
        if m.torch_cuda == "":
            note += " (torch here is a CPU build: install a CUDA build of torch first)"
        elif m.torch_cuda is not None:
            note += " (it needs nvcc, the CUDA toolkit, on PATH)"
        return [note]
    if has_nccl(info) and not m.gpus:
        why = m.gpu_problem or "nvidia-smi lists none"
        return [f"Horovod was built with NCCL but no GPU is visible ({why}): GPU training needs "
                "the NVIDIA driver and a GPU (in a container: docker run --gpus all)"]
    return []


def mpi_implementation() -> str:
    """First line of ``mpirun --version`` (e.g. ``mpirun (Open MPI) 4.1.4``), or a note that
    ``mpirun`` is missing."""
    if not shutil.which("mpirun"):
        return "not found (install Open MPI: apt-get install openmpi-bin libopenmpi-dev)"
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout or out.stderr).strip().splitlines()[0]


def find_horovodrun() -> str | None:
    """``horovodrun`` on PATH, else the one beside this Python (``.venv/bin/hvdtrain doctor`` run
    without the venv on PATH); None when neither exists."""
    found = shutil.which("horovodrun")
    if found:
        return found
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if os.access(beside, os.X_OK) else None


def check_build() -> BuildInfo:
    """Run ``horovodrun --check-build`` (:func:`find_horovodrun`) and parse it.

    Raises:
        RuntimeError: ``horovodrun`` is missing or failed; the message says how to install it.
    """
    horovodrun = find_horovodrun()
    if not horovodrun:
        raise RuntimeError(f"horovodrun not found on PATH or beside {sys.executable}: run "
                           "'make setup' and use .venv/bin, or activate the virtualenv")
    out = subprocess.run([horovodrun, "--check-build"], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"'horovodrun --check-build' failed: {out.stderr.strip()[-500:]}")
    return parse_check_build(out.stdout)


def problems(info: BuildInfo, supported: tuple[str, ...] = SUPPORTED_FRAMEWORKS) -> list[str]:
    """What makes the build unusable for hvdtrain: none of the ``supported`` frameworks, or no
    controller. (A build with one of the frameworks is usable for that one: see :func:`notes`.)"""
    found = info.available("Frameworks")
    issues = []
    if not any(name in found for name in supported):
        issues.append(f"Horovod was built without {' or '.join(supported)} support: rebuild it "
                      "with " + " and/or ".join(f"HOROVOD_WITH_{n.upper()}=1" for n in supported)
                      + " ('make setup' does)")
    if not info.available("Controllers"):
        issues.append("Horovod has no controller (MPI or Gloo): rebuild with HOROVOD_WITH_MPI=1 "
                      "or HOROVOD_WITH_GLOO=1")
    return issues


def notes(info: BuildInfo, supported: tuple[str, ...] = SUPPORTED_FRAMEWORKS, *,
          on: Machine | None = None) -> list[str]:
    """What a usable build cannot do: each supported framework it lacks, with the rebuild that
    adds it, and :func:`gpu_notes` for machine ``on`` (default: this one, :func:`machine`)."""
    found = info.available("Frameworks")
    flags = {"PyTorch": "torch", "TensorFlow": "keras"}
    gpu_build = "NCCL" in info.available("Tensor Operations")
    lines = []
    for name in (n for n in supported if n not in found):
        if name == "TensorFlow" and gpu_build and "PyTorch" in found:
            lines.append("Horovod was built without TensorFlow support, as scripts/setup.sh builds "
                         "for GPUs (with NCCL, Horovod's TensorFlow ops need an API that recent "
                         "TensorFlow no longer has): --framework keras runs with --keras-backend "
                         "torch (KERAS_BACKEND=torch)")
        else:
            lines.append(f"Horovod was built without {name} support, so --framework "
                         f"{flags.get(name, name)} will not run: rebuild it with "
                         f"HOROVOD_WITH_{name.upper()}=1 ('make setup' does)")
    return lines + gpu_notes(info, on or machine())


def report(info: BuildInfo, on: Machine | None = None) -> str:
    """A human-readable summary of ``info`` plus MPI, cores, and the GPUs, CUDA versions and
    NCCL of machine ``on`` (default: this one, :func:`machine`)."""
    on = on or machine()
    lines = [f"Horovod:            {info.version}",
             f"frameworks:         {', '.join(info.available('Frameworks')) or 'none'}",
             f"controllers:        {', '.join(info.available('Controllers')) or 'none'}",
             f"tensor operations:  {', '.join(info.available('Tensor Operations')) or 'none'}",
             f"NCCL:               {'yes (GPU all-reduce)' if has_nccl(info) else 'no'}",
             f"MPI:                {mpi_implementation()}",
             f"cores:              {runtime.available_cores()}",
             f"GPUs:               {describe_gpus(on)}",
             f"CUDA:               {describe_cuda(on)}"]
    return "\n".join(lines)
