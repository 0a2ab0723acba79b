"""The GPU parts, checked where there is no GPU (the CPU machines and CI): tests/gpu is skipped
with its stated reason (so it cannot vanish silently), and its shared-job machinery
(tests/gpu/gpujobs.py, rank_cases.py) runs a stand-in job: each case's result under its name, a
failing case's error, a hung case named and the cases after it run by a new job, side jobs
started after the case they need; benchmarks/gpu.py refuses to start without CUDA or torchvision
with exit status 2 and what to install, runs end to end on the CPU in a tiny configuration
(Horovod at size 1 needs no launcher), and keeps to its rounds' time budget."""
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "gpu.py"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # torch sees no CUDA device, on any machine
SMOKE = ["--device", "cpu", "--image-size", "32", "--batch-size", "4", "--iters", "2",
         "--warmup", "1", "--batches-per-iter", "1"]


def python(*args, env=None, timeout=600):
    full = dict(os.environ)
    full["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full.get('PATH', '')}"
    full.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


def bench_module():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # definitions only; torch is imported when main() runs
    return module


def torchvision_importable() -> bool:
    return importlib.util.find_spec("torchvision") is not None


@pytest.mark.parametrize("select", [[], ["-m", "gpu"]], ids=["all", "marker-gpu"])
def test_gpu_suite_is_skipped_with_its_reason_without_cuda(select):
    proc = python("-m", "pytest", "tests/gpu", "-rs", "-q", "-p", "no:cacheprovider", *select,
                  env=NO_GPU)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    # Every test skipped (none deselected by -m gpu: the marker is set at collection), none run.
    assert skipped and int(skipped.group(1)) >= 10, summary
    assert not re.search(r"passed|failed|error|deselected", summary), summary
    assert "no CUDA device: torch.cuda.is_available() is False" in out
    assert "tests/gpu needs an NVIDIA GPU, a CUDA build of torch and Horovod built with NCCL" in out


def test_benchmark_without_cuda_exits_2_saying_what_to_do():
    proc = python(str(BENCH), "--model", "tiny", env=NO_GPU)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "benchmarks/gpu.py: error: no CUDA device: torch.cuda.is_available() is False" \
        in proc.stderr
    assert "--device cpu" in proc.stderr and "HVDTRAIN_GPU=1" in proc.stderr
    assert "Iter #" not in proc.stdout  # nothing ran


def test_torchvision_release_paired_with_torch():
    pin = bench_module().torchvision_pin
    assert pin("2.13.0+cpu") == "0.28.*" and pin("2.11.0+cu130") == "0.26.*"


def test_benchmark_rejects_bad_options():
    parse = bench_module().parse_args
    with pytest.raises(SystemExit) as exc:
        parse(["--variants", "fp32,fp64"])
    assert exc.value.code == 2
    assert parse(["--variants", "bf16"]).variants == ["bf16"]


@pytest.mark.parametrize("bad", [["--time-budget", "-1"], ["--min-rounds", "0"],
                                 ["--warmup-later", "-2"]], ids=lambda bad: bad[0])
def test_benchmark_rejects_bad_round_options(bad):
    parse = bench_module().parse_args
    with pytest.raises(SystemExit) as exc:
        parse(bad)
    assert exc.value.code == 2
    args = parse(["--warmup", "7"])
    assert args.warmup_later == 7 and args.time_budget == 0 and args.min_rounds == 2  # defaults


def test_rounds_fit_the_time_budget(monkeypatch):
    """Rounds up to --min-rounds always, never past --rounds, in between only when the next
    (taken to last as long as the last) ends within the budget (seconds since the start)."""
    import argparse
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from gpu_rounds import another_round
    args = argparse.Namespace(rounds=10, min_rounds=2, time_budget=50.0)
    assert another_round(0, args, elapsed=80.0, last_round=0.0)  # over budget: the minimum runs
    assert another_round(1, args, elapsed=80.0, last_round=30.0)
    assert another_round(2, args, elapsed=30.0, last_round=20.0)  # ends at 50 s: fits
    assert not another_round(2, args, elapsed=30.1, last_round=20.0)
    assert not another_round(10, args, elapsed=0.0, last_round=0.0)  # --rounds is the most
    no_budget = argparse.Namespace(rounds=3, min_rounds=2, time_budget=0.0)
    assert [another_round(r, no_budget, 1e6, 1e6) for r in range(4)] == [True] * 3 + [False]
    one = argparse.Namespace(rounds=1, min_rounds=2, time_budget=0.0)
    assert [another_round(r, one, 0.0, 0.0) for r in range(2)] == [True, False]


def run_smoke(tmp_path, *args):
    out = tmp_path / "gpu.json"
    # The keras_* variants run on Keras's PyTorch backend, whatever this shell's KERAS_BACKEND.
    proc = python(str(BENCH), *SMOKE, *args, "--json-out", str(out), env={"KERAS_BACKEND": "torch"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_benchmark_runs_on_the_cpu_in_horovods_format(tmp_path):
    # A time budget no round fits: the two rounds --min-rounds asks for, then it stops.
    result, printed = run_smoke(tmp_path, "--model", "tiny", "--rounds", "5", "--time-budget",
                                "0.001", "--warmup-later", "0")
    assert result["model"] == "tiny" and result["size"] == 1 and result["device"] == "cpu"
    assert result["complete"] is True
    timing = result["timing"]
    assert timing["rounds"] == 2 == len(timing["rounds_s"])
    assert timing["stopped_by"] == "--time-budget"
    assert 0 < timing["startup_s"] < timing["total_s"]
    assert result["settings"]["warmup_later"] == 0 and result["settings"]["time_budget"] == 0.001
    assert result["machine"]["torch"] and result["machine"]["gpu"] is None
    variants = ["fp32", "bf16", "bf16_channels_last", "keras_mnist", "keras_gpt"]
    assert list(result["variants"]) == variants
    assert [(e["model"], e["framework"]) for e in result["variants"].values()] == [
        ("tiny", "torch")] * 3 + [("mnist", "keras (torch backend)"),
                                  ("gpt", "keras (torch backend)")]
    for variant, entry in result["variants"].items():
        for loop in ("plain", "hvdtrain"):
            assert len(entry[loop]["iters"]) == 2 * 2 and len(entry[loop]["rounds"]) == 2
            assert entry[loop]["img_sec_per_device"] > 0
        assert entry["ratio"] == pytest.approx(statistics.median(entry["round_ratios"]))
        assert entry["ratio_min"] == min(entry["round_ratios"])
        assert entry["ratio_max"] == max(entry["round_ratios"])
        assert entry["meets_target"] == (entry["ratio"] >= result["target_ratio"] == 0.98)
    # What a person reads: Horovod's benchmark lines (per CPU here, per GPU on a GPU).
    lines = printed.splitlines()
    for head in ("Model: tiny", "Keras 3 on PyTorch: keras_mnist, keras_gpt", "Batch size: 4",
                 "Number of CPUs: 1"):
        assert head in lines
    # 5 variants x 2 loops x 2 rounds x 2 iterations
    assert sum(bool(re.fullmatch(r"Iter #\d+: \d+\.\d img/sec per CPU", l)) for l in lines) == 40
    assert len([l for l in lines if re.fullmatch(r"Img/sec per CPU: [\d.]+ \+-[\d.]+", l)]) == 10
    assert len([l for l in lines
                if re.fullmatch(r"Total img/sec on 1 CPU\(s\): [\d.]+ \+-[\d.]+", l)]) == 10
    assert "keras_gpt, plain Keras fit:" in lines and "keras_gpt, hvdtrain.keras:" in lines
    for variant in variants:
        assert any(re.fullmatch(rf"Ratio hvdtrain / plain \({variant}\): [\d.]+ \(median of 2 "
                                rf"round\(s\), min [\d.]+, max [\d.]+; target >= 0.98: .*\)", l)
                   for l in lines)
    assert "2 round(s) (stopped by --time-budget) in " in printed


def test_results_are_written_after_each_variants_pair_of_blocks(tmp_path):
    """make gpu-check stops the benchmark at its step's budget, even in its first round: the JSON
    is written after each variant's plain and hvdtrain blocks, so what was timed in both loops
    is kept. Every write the run makes is recorded (the variants in it, each with its number of
    round ratios, and ``complete``) into a file this test reads back."""
    writes, out = tmp_path / "writes.json", tmp_path / "gpu.json"
    driver = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import gpu; calls = []; "
        "real = gpu.write_json\n"
        "def record(path, report):\n"
        "    calls.append([{v: len(e['round_ratios']) for v, e in report['variants'].items()}, "
        "report['complete']]); real(path, report)\n"
        "gpu.write_json = record; gpu.main(sys.argv[3:]); "
        "open(sys.argv[2], 'w').write(json.dumps(calls))")
    proc = python("-c", driver, str(BENCH.parent), str(writes), *SMOKE, "--model", "tiny",
                  "--variants", "fp32,bf16", "--rounds", "2", "--json-out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, both = {"fp32": 1}, {"fp32": 1, "bf16": 1}
    assert json.loads(writes.read_text()) == [
        [one, False], [both, False], [both, False],  # round 1: each pair, then the round's end
        [{"fp32": 2, "bf16": 1}, False], [{"fp32": 2, "bf16": 2}, False],
        [{"fp32": 2, "bf16": 2}, False], [{"fp32": 2, "bf16": 2}, True]]
    assert json.loads(out.read_text())["complete"] is True


def test_keras_variants_need_the_pytorch_backend(tmp_path):
    """The keras_* variants compare Keras's PyTorch-backend loops (a GPU build of Horovod has no
    TensorFlow ops): another KERAS_BACKEND is refused before any work, saying what to set."""
    proc = python(str(BENCH), *SMOKE, "--model", "tiny", "--variants", "fp32,keras_mnist",
                  env={"KERAS_BACKEND": "tensorflow"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("benchmarks/gpu.py: error: the keras_* variants run Keras on its PyTorch backend, "
            "but KERAS_BACKEND is 'tensorflow': unset it or set KERAS_BACKEND=torch") in proc.stderr
    assert "Iter #" not in proc.stdout
    ok = python(str(BENCH), *SMOKE, "--model", "tiny", "--variants", "fp32", "--rounds", "1",
                env={"KERAS_BACKEND": "tensorflow"})  # no Keras variant: no Keras needed
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_benchmark_torchvision_model(tmp_path):
    pin = bench_module().torchvision_pin(importlib.metadata.version("torch"))  # 0.28.* for 2.13
    if python("-c", "import torchvision").returncode == 0:
        result, _ = run_smoke(tmp_path, "--model", "resnet18", "--num-classes", "10",
                              "--rounds", "1", "--variants", "fp32,channels_last")
        assert result["machine"]["torchvision"]
        for entry in result["variants"].values():
            assert entry["plain"]["img_sec_per_device"] > 0
            assert entry["hvdtrain"]["img_sec_per_device"] > 0
        return
    # No usable torchvision here (hvdtrain's CPU stack does not install it): the clear error.
    proc = python(str(BENCH), *SMOKE, "--model", "resnet18")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"benchmarks/gpu.py: error: torchvision (is not installed|.* does not "
                     r"import)", proc.stderr), proc.stderr
    assert f"pip install 'torchvision=={pin}'" in proc.stderr
    assert "--model tiny" in proc.stderr


def test_benchmark_names_a_torchvision_built_for_another_torch(tmp_path):
    # What the registry's torchvision 0.28.0 (a CUDA 13 wheel) does beside the CPU torch 2.13.0:
    # its compiled ops do not load, and importing it raises RuntimeError.
    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    proc = python(str(BENCH), *SMOKE, "--model", "resnet18",
                  env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not import (RuntimeError: operator torchvision::nms does not exist)" \
        in proc.stderr
    assert "built for another torch" in proc.stderr and "--model tiny" in proc.stderr


# A stand-in for tests/gpu/rank_cases.py's job: its own serve() loop, with cases that pass, raise
# or hang (no torch, no launcher).
STAND_IN = '''
import pathlib, sys, time
sys.path.insert(0, {gpu!r})
import rank_cases
out, status, names = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3].split(",")
def run(name):
    if name == "boom":
        raise RuntimeError("boom went the case")
    if name == "hang":
        time.sleep(600)
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / "done.txt").write_text(name)
    print("output of", name)
sys.exit(rank_cases.serve(out, names, status, run, case_timeout_s=1.0))
'''


def test_shared_gpu_job_reports_each_case_and_runs_the_rest_after_a_hang(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    from gpujobs import Side, SharedRuns
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN.format(gpu=str(ROOT / "tests" / "gpu")))
    root = tmp_path / "jobs"

    def copied(out):  # a side job that reads the files of the case it waited for
        return [sys.executable, "-c", f"print(open({str(out / 'done.txt')!r}).read())"]
    sides = {"after_first": Side(copied, after="first"), "after_boom": Side(copied, after="boom"),
             "exits_3": Side(lambda out: [sys.executable, "-c", "import sys; sys.exit(3)"])}
    runs = SharedRuns(root, cases=["first", "boom", "hang", "last"], sides=sides,
                      job=lambda status, names: [sys.executable, str(stand_in), str(root),
                                                 str(status), ",".join(names)],
                      job_env_extra={}).start()
    assert (runs.case("first") / "done.txt").read_text() == "first"
    assert "output of first" in (root / "first.log").read_text()
    with pytest.raises(pytest.fail.Exception) as failed:
        runs.case("boom")
    assert "shared GPU job, case 'boom': RuntimeError: boom went the case" in str(failed.value)
    assert 'raise RuntimeError("boom went the case")' in str(failed.value)  # its traceback
    with pytest.raises(pytest.fail.Exception) as hung:
        runs.case("hang")
    assert "case 'hang': the shared job ended (exit 1) during this case" in str(hung.value)
    assert "Timeout (0:00:01)!" in str(hung.value)  # every thread's stack, in its output
    assert (runs.case("last") / "done.txt").read_text() == "last"  # a new job ran it
    assert [launch["cases"] for launch in runs.launches] == [["first", "boom", "hang", "last"],
                                                              ["last"]]
    assert runs.side("after_first").stdout.strip() == "first"  # a copy of the case's folder
    with pytest.raises(pytest.fail.Exception, match="not run: it needs case 'boom', which failed"):
        runs.side("after_boom")
    assert runs.side("exits_3", check=False).returncode == 3
    with pytest.raises(pytest.fail.Exception, match="side job 'exits_3': exited 3"):
        runs.side("exits_3")
    timings = runs.close()
    assert {n: c["ok"] for n, c in timings["cases"].items()} == {
        "first": True, "boom": False, "hang": False, "last": True}
    assert [launch["exit"] for launch in timings["launches"]] == [1, 0]
    assert json.loads((root / "timings.json").read_text()) == timings


def test_breakdown_runs_on_the_cpu_and_counts_the_copies(tmp_path):
    # benchmarks/gpu_breakdown.py (#50) as a smoke test: every path measured and written back;
    # the counted copies tell the layouts apart (autocast's weight casts are in every path).
    out = tmp_path / "breakdown.json"
    done = python(str(ROOT / "benchmarks" / "gpu_breakdown.py"), "--device", "cpu", "--model",
                  "tiny", "--image-size", "16", "--batch-size", "4", "--rounds", "2", "--steps",
                  "2", "--warmup", "1", "--json-out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    assert list(r["paths"]) == ["plain", "hvdtrain", "hooks", "hooks_copy"]
    assert (r["precision"], r["layout"], r["compile"]) == ("bf16", "channels_last", False)
    paths = r["paths"]
    assert all(len(p["img_sec_rounds"]) == 2 and p["img_sec"]["median"] > 0
               for p in paths.values())
    assert "ratio_to_plain" not in paths["plain"] and "ratio_to_plain" in paths["hooks"]
    plain = paths["plain"]["gradient_sized_copies"]
    assert paths["hvdtrain"]["gradient_sized_copies"] == plain
    assert paths["hooks"]["gradient_sized_copies"] == plain
    # the tiny CNN's two 3x3 convs: a contiguous copy and a copy back each
    assert paths["hooks_copy"]["gradient_sized_copies"] == plain + 4
    assert all(p["host_syncs_seen_by_torch"] == 0 for p in paths.values())
