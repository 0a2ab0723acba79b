"""The examples the docs quote run as written on 2 real ranks (the session's rank pools run the
file as ``__main__``, as ``horovodrun -np 2 python examples/<name> OUT`` does)."""
import importlib.util
import json
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name,keras_backend", [("pytorch_minimal.py", None),
                                                ("keras_minimal.py", "tensorflow"),
                                                ("keras_minimal.py", "torch"),
                                                ("lightning_minimal.py", None)])
def test_example_trains_to_95_percent(pools, name, keras_backend, tmp_path):
    if name.startswith("lightning") and importlib.util.find_spec("lightning") is None:
        pytest.skip("PyTorch Lightning is not installed (pip install hvdtrain[lightning])")
    out = tmp_path / "result.json"
    pool = pools.keras(keras_backend) if keras_backend else pools.get()
    seen = pool.run(EXAMPLES / name, out)
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["accuracy"] >= 0.95
    assert result.get("backend") == keras_backend
    # What the user reads: one line, from rank 0 only.
    assert f"held-out accuracy {result['accuracy']:.4f} on 2 ranks" in seen.rank(0)
    if keras_backend:
        assert f"({keras_backend} backend)" in seen.rank(0)
    assert "held-out accuracy" not in seen.rank(1)


@pytest.mark.parametrize("name,guide", [("pytorch_minimal.py", "torch.md"),
                                        ("keras_minimal.py", "keras.md"),
                                        ("lightning_minimal.py", "torch.md")])
def test_the_adapter_guide_shows_the_example_code(name, guide):
    # The adapter's guide quotes the example's code (from its first import to the training
    # loop); the README, a front page, shows only the diff from a Horovod script.
    code = (EXAMPLES / name).read_text()
    body = code[code.index("import "):]
    first_lines = [line for line in body.splitlines()[:25] if line.strip()]
    page = (DOCS / "guides" / guide).read_text().splitlines()
    missing = [line for line in first_lines if line not in page]
    assert not missing, missing
