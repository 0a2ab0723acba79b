"""Both frameworks write metrics.json with the same keys, and `hvdtrain report` compares them."""
import json
import subprocess
import sys
from pathlib import Path

from jobs import job_env

from hvdtrain.run.report import RUN_RESULTS, RunHeader

SCHEMA = set(RunHeader.__dataclass_fields__) | set(RUN_RESULTS)


def keys(obj, prefix=""):
    """All key paths of nested dicts (lists: their first element)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(prefix + k)
            out |= keys(v, prefix + k + ".")
    elif isinstance(obj, list) and obj:
        out |= keys(obj[0], prefix + "[].")
    return out


def test_same_metrics_keys_and_report(train_here, tmp_path):
    dirs = {}
    for framework in ("torch", "keras"):  # hvdtrain train in the session's rank pools
        dirs[framework] = tmp_path / framework
        train_here(dirs[framework], "--epochs", "2", framework=framework)
    metrics = {f: json.loads((d / "metrics.json").read_text()) for f, d in dirs.items()}
    torch_keys = keys(metrics["torch"]) - {k for k in keys(metrics["torch"]) if k.startswith("versions.")}
    keras_keys = keys(metrics["keras"]) - {k for k in keys(metrics["keras"]) if k.startswith("versions.")}
    assert torch_keys == keras_keys
    # The schema is declared once (hvdtrain.run.report.RunHeader + the results) and every
    # trainer writes exactly it.
    for m in metrics.values():
        assert set(m) == SCHEMA
    assert {"epochs.[].test_accuracy", "epochs.[].samples_per_sec", "global_batch", "size"} <= torch_keys

    exe = Path(sys.executable).parent / "hvdtrain"
    rows_file = tmp_path / "report.json"
    proc = subprocess.run([str(exe), "report", str(dirs["torch"]), str(dirs["keras"]),
                           "--json-out", str(rows_file)],
                          capture_output=True, text=True, env=job_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(rows_file.read_text())
    assert [r["framework"] for r in rows] == ["torch", "keras"]
    assert [r["keras_backend"] for r in rows] == [None, "tensorflow"]
    assert "keras/tensorflow" in proc.stdout
    for row in rows:
        m = metrics[row["framework"]]
        assert row["size"] == 2 and row["global_batch"] == 32 and row["epochs"] == 2
        assert row["test_accuracy"] == m["final_test_accuracy"]
        assert row["samples_per_sec"] == m["samples_per_sec"]
    # The table a person reads names the columns and each run.
    assert "framework" in proc.stdout and "test acc" in proc.stdout
    assert str(dirs["torch"]) in proc.stdout and str(dirs["keras"]) in proc.stdout
