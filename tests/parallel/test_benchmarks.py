"""Every benchmark script runs once in a tiny configuration (seconds), so none can silently rot,
and the reference ring all-reduce is checked against MPI_Allreduce."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import Console, horovodrun, job_env, run

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = ["--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"]


def bench(tmp_path, script, *args, name=None):
    """Run benchmarks/``script``; its results ``<name>.json`` (``name``: the script's, unless
    given) and the stdout. Its ``<name>.png`` must exist too."""
    env = job_env()
    env["HVDTRAIN_BENCH_RESULTS"] = str(tmp_path)
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = name or script.removesuffix(".py")
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    return json.loads((tmp_path / f"{name}.json").read_text()), proc.stdout


@pytest.mark.parametrize("np_", [2, 3])
def test_reference_ring_matches_mpi_allreduce(np_, tmp_path):
    out = tmp_path / "ring.json"
    proc = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
                sys.executable, str(BENCH / "ring.py"), "--json-out", str(out)])
    assert json.loads(out.read_text()) == {"size": np_, "cases": 10, "ok": True}
    assert f"OK ring_allreduce matches MPI_Allreduce on {np_} ranks" in Console.of(proc).text


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_synthetic_prints_horovods_format(framework, tmp_path):
    out = tmp_path / "synthetic.json"
    proc = run(horovodrun(2, sys.executable, str(BENCH / "synthetic.py"), "--framework",
                          framework, *TINY, "--json-out", str(out)))
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["total_img_sec"] > 0 and len(result["iters"]) == 2
    # What a person reads, in Horovod's benchmark format, from rank 0 only.
    seen = Console.of(proc)
    printed = seen.rank(0)
    assert "Iter #0:" in printed and "img/sec per worker" in printed
    assert "Img/sec per worker:" in printed and "Total img/sec on 2 worker(s):" in printed
    assert "Iter #" not in seen.rank(1)


def test_synthetic_plain_keras_runs_horovods_keras_layer(tmp_path):
    """--mode plain --framework keras: Horovod's tensorflow2_keras_synthetic_benchmark.py setup
    (horovod.tensorflow.keras's DistributedOptimizer and broadcast callback on Keras 3, patch
    15), what benchmarks/compare.py --framework keras measures hvdtrain.keras against."""
    out = tmp_path / "synthetic.json"
    run(horovodrun(2, sys.executable, str(BENCH / "synthetic.py"), "--framework", "keras",
                   "--mode", "plain", *TINY, "--json-out", str(out)))
    result = json.loads(out.read_text())
    assert result["mode"] == "plain" and result["size"] == 2
    assert result["total_img_sec"] > 0 and len(result["iters"]) == 2


def test_scaling_tiny(tmp_path):
    data, out = bench(tmp_path, "scaling.py", "--frameworks", "torch", "--nps", "1,2",
                      "--repeats", "1", "--warmup", "1", "--batches", "2", "--iters", "1")
    rows = data["results"]
    assert [r["np"] for r in rows] == [1, 2]
    for r in rows:
        assert r["efficiency"] == pytest.approx(r["total_img_sec"] / (r["np"] * r["single_img_sec"]))
        assert r["single_threads"] == max(1, os.cpu_count() // r["np"])
    assert "efficiency" in out


def test_allreduce_tiny(tmp_path):
    data, out = bench(tmp_path, "allreduce.py", "--min-bytes", "4096", "--max-bytes", "16384",
                      "--iters", "3", "--warmup", "1", "--rounds", "1", "--repeats", "1")
    from hvdtrain.launch.tuning import horovod_can_wake
    wake = {"horovod-mpi-wake"} if horovod_can_wake() else set()  # skipped, with a note
    assert set(data["seconds"]) == {"horovod-mpi", "horovod-mpi-cycle0.1", "horovod-gloo",
                                    "mpi4py", "torch-gloo", "ring"} | wake
    for impl, per_size in data["busbw_bytes_per_s"].items():
        for size, busbw in per_size.items():
            t = data["seconds"][impl][size]
            assert busbw == pytest.approx(2 * (2 - 1) / 2 * int(size) / t)
            assert data["spread"][impl][size] == [t, t]  # one job: its median is the median
    assert "alpha (us)" in out and "(jobs' medians)" in out


def test_allreduce_pools_every_call_of_every_job(tmp_path):
    # Two jobs of two sweeps of 3 calls: each size's time is the median of all 12 calls, which
    # lies between the two jobs' own medians (kept as the spread). TensorFlow's all-reduce alone
    # (#47: horovod-mpi-cycle0.1 ran here too; test_allreduce_tiny runs it): the one series of
    # allreduce.py that no other test runs.
    impls = ("horovod-tf-cycle0.1",)
    data, _ = bench(tmp_path, "allreduce.py", "--impls", ",".join(impls), "--min-bytes", "4096",
                    "--max-bytes", "16384", "--iters", "3", "--warmup", "1", "--rounds", "2",
                    "--repeats", "2")
    assert set(data["seconds"]) == set(impls)
    for impl in impls:
        assert data["calls"][impl] == {"4096": 12, "16384": 12}
        for size, t in data["seconds"][impl].items():
            lo, hi = data["spread"][impl][size]
            assert 0 < lo <= t <= hi
    proc = subprocess.run([sys.executable, str(BENCH / "allreduce.py"), "--impls", "nccl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown --impls nccl" in proc.stderr


def test_accumulation_tiny_counts_a_quarter_of_the_allreduces(tmp_path):
    data, _ = bench(tmp_path, "accumulation.py", "--ks", "1,4", "--repeats", "1", "--batches",
                    "2", "--iters", "1", "--warmup", "1")
    k1, k4 = data["results"]
    assert k1["allreduces"] > 0
    assert k4["allreduce_ratio"] == pytest.approx(0.25)


def test_compare_tiny(tmp_path):
    data, out = bench(tmp_path, "compare.py", "--repeats", "1", "--batches", "2", "--iters", "1",
                      "--warmup", "1")
    assert set(data["ratios"]) == {"hvdtrain / DDP", "hvdtrain / plain Horovod (defaults)",
                                   "hvdtrain / plain Horovod (tuned launcher)"}
    assert all(v > 0 for v in data["medians"].values())


def test_compare_keras_tiny(tmp_path):
    """--framework keras: hvdtrain.keras, Horovod's Keras layer (defaults, tuned) and one Keras
    process on all cores, written as compare_keras.json / .png."""
    data, _ = bench(tmp_path, "compare.py", "--framework", "keras", "--repeats", "1",
                    "--batches", "2", "--iters", "1", "--warmup", "1", name="compare_keras")
    assert set(data["ratios"]) == {"hvdtrain / one process", "hvdtrain / plain Horovod (defaults)",
                                   "hvdtrain / plain Horovod (tuned launcher)"}
    assert all(v > 0 for v in data["medians"].values()) and data["args"]["framework"] == "keras"


def test_trainer_tiny(tmp_path):
    env = job_env()
    env["HVDTRAIN_BENCH_RESULTS"] = str(tmp_path)
    proc = subprocess.run([sys.executable, str(BENCH / "trainer.py"), "--repeats", "1",
                           "--epochs", "2", "--samples", "512"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "trainer.json").read_text())
    assert data["ratio"] == pytest.approx(data["trainer_samples_per_sec"]
                                          / data["plain_samples_per_sec"])
    assert data["plain_samples_per_sec"] > 0 and len(data["trainer_runs"]) == 1


def test_scaling_rule_tiny_reads_each_runs_metrics(tmp_path):
    data, out = bench(tmp_path, "scaling_rule.py", "--dataset", "digits", "--global-batches",
                      "32,64", "--epochs", "1")
    rows = {(r["rule"], r["global_batch"]): r for r in data["results"]}
    assert set(rows) == {(rule, gb) for rule in ("linear", "sqrt") for gb in (32, 64)}
    # Scale factor 1 at global batch 32: one run, reported for both rules.
    assert data["trainings"] == 3
    assert rows["linear", 32]["final_test_accuracy"] == rows["sqrt", 32]["final_test_accuracy"]
    assert rows["linear", 32]["scaled_lr"] == rows["sqrt", 32]["scaled_lr"] == pytest.approx(0.01)
    assert rows["linear", 64]["scaled_lr"] == pytest.approx(0.02)
    assert rows["sqrt", 64]["scaled_lr"] == pytest.approx(0.01 * 2 ** 0.5)
    for r in data["results"]:
        assert r["fraction"] == pytest.approx(r["global_batch"] / r["train_samples"])
        assert 0 <= r["final_test_accuracy"] <= 1 and r["would_stop"] is None
    assert "divergence check would stop it" in out


def test_vs_single_tiny(tmp_path):
    # The transformer LM (the newest model) on PyTorch (with DDP): one process and hvdtrain np=2
    # under plain horovodrun (np=1 is left to make bench: time). The Keras paths launch the same
    # synthetic.py with --framework keras (test_synthetic_prints_horovods_format[keras]); they
    # were left out to keep the suite's time (-50 s).
    data, out = bench(tmp_path, "vs_single.py", "--paths", "torch", "--models", "gpt",
                      "--variants", "one process,hvdtrain np=2,DDP np=2,np=2 apart",
                      "--repeats", "1",
                      "--warmup", "1", "--batches", "2", "--iters", "1")
    results = data["results"]
    assert sorted(results) == ["torch/gpt"]
    for key, res in results.items():
        stats, ratios = res["stats"], res["ratios"]
        assert "one process" in stats and "hvdtrain np=2" in stats
        assert ("DDP np=2" in stats) == key.startswith("torch/") == ("np2 / DDP" in ratios)
        assert ratios["np2 / one process"] == pytest.approx(
            stats["hvdtrain np=2"]["median"] / stats["one process"]["median"])
        assert all(len(s["runs"]) == 1 and s["median"] > 0 for s in stats.values())
        # Two processes without the all-reduce, started together: their total against np=2's.
        assert ratios["np2 / apart"] == pytest.approx(
            stats["hvdtrain np=2"]["median"] / stats["np=2 apart"]["median"])
        assert res["round_ratios"]["np2 / one process"] == pytest.approx(
            [stats["hvdtrain np=2"]["runs"][0] / stats["one process"]["runs"][0]])
    assert "np2 / one" in out and "torch/gpt" in out
    # The table renders again from the saved JSON, without measuring.
    proc = subprocess.run([sys.executable, str(BENCH / "vs_single.py"), "--render",
                           str(tmp_path / "vs_single.json")], capture_output=True, text=True,
                          timeout=120, env={**job_env(), "HVDTRAIN_BENCH_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| torch/gpt |" in proc.stdout and "np2 / one, each round" in proc.stdout
    assert "np2 / apart" in proc.stdout


def test_gloo_tiny_runs_each_loop_over_gloo(tmp_path):
    # Horovod patch 13's loop and upstream's (HOROVOD_GLOO_LOOP_YIELD=0), each under plain
    # horovodrun --gloo; the benchmark fails a run whose ranks report another controller. (MPI,
    # the third variant, is the same launch without --gloo, measured by the other benchmarks.)
    data, out = bench(tmp_path, "gloo.py", "--paths", "torch", "--models", "mnist",
                      "--variants", "Gloo,Gloo spin",
                      "--repeats", "1", "--warmup", "1", "--batches", "2", "--iters", "1")
    assert data["note"] == "" and sorted(data["results"]) == ["torch/mnist"]
    res = data["results"]["torch/mnist"]
    stats = res["stats"]
    assert sorted(stats) == ["Gloo", "Gloo spin"]
    assert all(len(s["runs"]) == 1 and s["median"] > 0 for s in stats.values())
    assert res["ratios"] == {"Gloo / Gloo spin": pytest.approx(
        stats["Gloo"]["median"] / stats["Gloo spin"]["median"])}
    assert res["round_ratios"] == {"Gloo / Gloo spin": [pytest.approx(
        stats["Gloo"]["runs"][0] / stats["Gloo spin"]["runs"][0])]}
    # The table renders again from the saved JSON, without measuring: MPI's cells are empty.
    proc = subprocess.run([sys.executable, str(BENCH / "gloo.py"), "--render",
                           str(tmp_path / "gloo.json")], capture_output=True, text=True,
                          timeout=120, env={**job_env(), "HVDTRAIN_BENCH_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| torch/mnist |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "-" and cells[5] == "-" and cells[4].startswith(
        f"{res['ratios']['Gloo / Gloo spin']:.2f} (")
    assert "2 ranks on one host" in proc.stdout and "global batch mnist 64" in proc.stdout


def test_modes_splits_two_speeds_and_keeps_one(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import modes
    finally:
        sys.path.remove(str(BENCH))
    # Issue 49's Keras jobs: two clean modes, about 13-15k and 7.45k samples/s.
    two = modes.distribution([12916, 7478, 7454, 13320, 7423])
    assert two["two_modes"] and (two["below_gap"], two["above_gap"]) == (3, 2)
    assert two["within_15pct_of_fastest"] == pytest.approx(2 / 5)
    assert two["largest_gap"] == pytest.approx(12916 / 7478 - 1)
    one = modes.distribution([13008, 13763, 13400])  # the PyTorch path: stable
    assert not one["two_modes"] and one["within_15pct_of_fastest"] == 1.0
    # A tiny real run: every job measured, the distribution and the ratio written.
    data, out = bench(tmp_path, "modes.py", "--paths", "torch", "--jobs", "2", "--warmup", "1",
                      "--batches", "2", "--iters", "1")
    r = data["results"]["torch"]
    assert len(r["np2"]["sorted"]) == len(r["single"]["sorted"]) == 2
    assert r["np2_over_single"] == pytest.approx(r["np2"]["median"] / r["single"]["median"])
    assert "two modes?" in out and "| torch |" in out
