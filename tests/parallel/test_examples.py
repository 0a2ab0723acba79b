"""The examples the docs quote run as written under `horovodrun -np 2`."""
import json
import sys
from pathlib import Path

import pytest

from jobs import Console, horovodrun, keras_env, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DOCS = Path(__file__).resolve().parents[2] / "docs"


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


@pytest.mark.parametrize("name,guide", [("pytorch_minimal.py", "torch.md"),
                                        ("keras_minimal.py", "keras.md")])
def test_the_adapter_guide_shows_the_example_code(name, guide):
    # The adapter's guide quotes the example's code (from its first import to the training
    # loop); the README, a front page, shows only the diff from a Horovod script.
    code = (EXAMPLES / name).read_text()
    body = code[code.index("import "):]
    first_lines = [line for line in body.splitlines()[:25] if line.strip()]
    page = (DOCS / "guides" / guide).read_text().splitlines()
    missing = [line for line in first_lines if line not in page]
    assert not missing, missing
