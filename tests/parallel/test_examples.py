"""The README's complete programs run as written under `horovodrun -np 2`."""
import json
import sys
from pathlib import Path

import pytest

from jobs import Console, horovodrun, keras_env, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("name,keras_backend", [("pytorch_minimal.py", None),
                                                ("keras_minimal.py", "tensorflow"),
                                                ("keras_minimal.py", "torch")])
def test_example_trains_to_95_percent(name, keras_backend, tmp_path):
    out = tmp_path / "result.json"
    proc = run(horovodrun(2, sys.executable, str(EXAMPLES / name), str(out)),
               env=keras_env(keras_backend) if keras_backend else None)
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["accuracy"] >= 0.95
    assert result.get("backend") == keras_backend
    # What the user reads: one line, from rank 0 only.
    seen = Console.of(proc)
    assert f"held-out accuracy {result['accuracy']:.4f} on 2 ranks" in seen.rank(0)
    if keras_backend:
        assert f"({keras_backend} backend)" in seen.rank(0)
    assert "held-out accuracy" not in seen.rank(1)


@pytest.mark.parametrize("name", ["pytorch_minimal.py", "keras_minimal.py"])
def test_readme_shows_the_example_code(name):
    # The README quotes the example's code (from its first import to the training loop).
    code = (EXAMPLES / name).read_text()
    body = code[code.index("import "):]
    first_lines = [line for line in body.splitlines()[:25] if line.strip()]
    readme = README.read_text()
    missing = [line for line in first_lines if line not in readme]
    assert not missing, missing
