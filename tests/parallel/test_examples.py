"""The README's complete programs run as written under `horovodrun -np 2`."""
import re
from pathlib import Path

import pytest

from jobs import horovodrun, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("name", ["pytorch_minimal.py", "keras_minimal.py"])
def test_example_trains_to_95_percent(name):
    import sys
    proc = run(horovodrun(2, sys.executable, str(EXAMPLES / name)))
    match = re.search(r"held-out accuracy (\d\.\d+) on 2 ranks", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert float(match.group(1)) >= 0.95


@pytest.mark.parametrize("name", ["pytorch_minimal.py", "keras_minimal.py"])
def test_readme_shows_the_example_code(name):
    # The README quotes the example's code (from its first import to the training loop).
    code = (EXAMPLES / name).read_text()
    body = code[code.index("import "):]
    first_lines = [line for line in body.splitlines()[:25] if line.strip()]
    readme = README.read_text()
    missing = [line for line in first_lines if line not in readme]
    assert not missing, missing
