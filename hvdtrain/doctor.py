"""``hvdtrain doctor``: what is installed and usable, from ``horovodrun --check-build``.

No framework is imported: Horovod's own check tells which frameworks its build supports.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from hvdtrain import runtime

# The frameworks hvdtrain has adapters for; a build needs at least one.
SUPPORTED_FRAMEWORKS = ("PyTorch", "TensorFlow")


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


def mpi_implementation() -> str:
    """First line of ``mpirun --version`` (e.g. ``mpirun (Open MPI) 4.1.4``), or a note that
    ``mpirun`` is missing."""
    if not shutil.which("mpirun"):
        return "not found (install Open MPI: apt-get install openmpi-bin libopenmpi-dev)"
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout or out.stderr).strip().splitlines()[0]


def check_build() -> BuildInfo:
    """Run ``horovodrun --check-build`` and parse it.

    Raises:
        RuntimeError: ``horovodrun`` is missing or failed; the message says how to install it.
    """
    if not shutil.which("horovodrun"):
        raise RuntimeError("horovodrun not found on PATH: run 'make setup' and use .venv/bin, "
                           "or activate the virtualenv")
    out = subprocess.run(["horovodrun", "--check-build"], capture_output=True, text=True,
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


def notes(info: BuildInfo, supported: tuple[str, ...] = SUPPORTED_FRAMEWORKS) -> list[str]:
    """What a usable build cannot do: each supported framework it lacks, with the rebuild that
    adds it."""
    found = info.available("Frameworks")
    flags = {"PyTorch": "torch", "TensorFlow": "keras"}
    return [f"Horovod was built without {name} support, so --framework {flags.get(name, name)} "
            f"will not run: rebuild it with HOROVOD_WITH_{name.upper()}=1 ('make setup' does)"
            for name in supported if name not in found]


def report(info: BuildInfo) -> str:
    """A human-readable summary of ``info`` plus MPI and cores."""
    lines = [f"Horovod:            {info.version}",
             f"frameworks:         {', '.join(info.available('Frameworks')) or 'none'}",
             f"controllers:        {', '.join(info.available('Controllers')) or 'none'}",
             f"tensor operations:  {', '.join(info.available('Tensor Operations')) or 'none'}",
             f"MPI:                {mpi_implementation()}",
             f"cores:              {runtime.available_cores()}"]
    return "\n".join(lines)
