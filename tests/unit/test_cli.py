"""Bad input to `hvdtrain train` fails before any framework or Horovod is loaded."""
import json
import subprocess
import sys

import pytest

# argv[1]: where the probe writes its answer (a file, not stdout); the rest is the CLI's argv.
PROBE = ("import json, sys; from hvdtrain.cli import main; rc = main(sys.argv[2:]); "
         "open(sys.argv[1], 'w').write(json.dumps({'rc': rc, 'loaded': sorted(m for m in "
         "('torch', 'tensorflow', 'horovod') if m in sys.modules)}))")


def train(tmp_path, *args):
    answer = tmp_path / "probe.json"
    argv = [sys.executable, "-c", PROBE, str(answer), "train", "--output-dir", str(tmp_path / "out"),
            *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert answer.exists(), proc.stderr
    return json.loads(answer.read_text()), proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--backward-passes-per-step", "0"], "--backward-passes-per-step must be a whole number >= 1; got 0"),
    (["--batch-size", "0"], "--batch-size must be a whole number >= 1; got 0"),
    (["--framework", "mxnet"], "--framework must be one of torch, keras; got 'mxnet'"),
    (["--dataset", "cifar"], "--dataset must be one of digits, mnist, synthetic; got 'cifar'"),
    (["--output-dir", "/proc/nope"], "--output-dir '/proc/nope' is not writable"),
])
def test_bad_input_fails_before_any_work(tmp_path, args, message):
    result, stderr = train(tmp_path, *args)
    assert result == {"rc": 2, "loaded": []}
    assert f"hvdtrain: error: {message}" in stderr


def test_a_bad_omp_num_threads_fails_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    result, stderr = train(tmp_path)
    assert result == {"rc": 2, "loaded": []}
    assert ("hvdtrain: error: OMP_NUM_THREADS must be a whole number >= 1 (threads per rank); "
            "got 'two'") in stderr


def test_non_integer_option_is_rejected_by_the_parser(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.cli", "train", "--epochs", "two"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--epochs: invalid int value: 'two'" in proc.stderr


# `hvdtrain launch --dry-run`: the yield-when-idle choice on stderr, the command line on stdout.
from pathlib import Path  # noqa: E402

HOSTFILES = Path(__file__).resolve().parents[2] / "hostfiles"


def dry_launch(capsys, *args):
    """Run ``hvdtrain launch --dry-run ARGS -- hvdtrain train``; (rc, argv printed, stderr)."""
    import shlex

    from hvdtrain.cli import main
    rc = main(["launch", "--dry-run", *args, "--", "hvdtrain", "train"])
    out, err = capsys.readouterr()
    return rc, shlex.split(out), err


@pytest.fixture
def launch_env(monkeypatch, tmp_path):
    """A launch environment with NCCL/Open MPI settings; returns a function that puts a fake
    ``nvidia-smi`` listing ``gpus`` GPUs first on PATH (and clears CUDA_VISIBLE_DEVICES)."""
    for name in ("OMPI_MCA_mpi_yield_when_idle", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "eth0")

    def gpus(count):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H100 (UUID: GPU-{i})"\n'
                                               for i in range(count)))
        smi.chmod(0o755)
        import os
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return gpus


def test_launch_dry_run_cpu_host_yields_and_forwards_nccl_and_mca(capsys, launch_env):
    launch_env(0)  # nvidia-smi lists no GPU
    rc, argv, err = dry_launch(capsys, "--launcher", "mpirun", "--hostfile",
                               str(HOSTFILES / "two-hosts.txt"), "-np", "4")
    assert rc == 0
    assert err == ("hvdtrain: idle MPI ranks yield their core (mpi_yield_when_idle=1): no GPU "
                   "visible on this host (nvidia-smi -L, CUDA_VISIBLE_DEVICES): the ranks "
                   "compute on the CPU cores they share, and a busy-polling rank would steal "
                   "them; --yield-when-idle off turns this off\n")
    assert argv[0] == "mpirun" and argv[-2:] == ["hvdtrain", "train"]
    forwarded = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    for name in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include", "PATH"):
        assert name in forwarded
    at = argv.index("mpi_yield_when_idle")
    assert argv[at - 1:at + 2] == ["-mca", "mpi_yield_when_idle", "1"]


def test_launch_dry_run_gpu_host_does_not_yield(capsys, launch_env):
    launch_env(2)
    rc, argv, err = dry_launch(capsys, "--launcher", "mpirun", "--hostfile",
                               str(HOSTFILES / "mixed-slots.txt"), "-np", "7")
    assert rc == 0 and "mpi_yield_when_idle" not in argv
    assert err == ("hvdtrain: idle MPI ranks busy-poll (Open MPI's default, no "
                   "mpi_yield_when_idle): 2 GPUs visible on this host: the ranks compute on "
                   "their GPUs, and yielding would only add MPI latency; --yield-when-idle on "
                   "forces yielding\n")
    assert argv[argv.index("--hostfile") + 1] == str(HOSTFILES / "mixed-slots.txt")


def test_launch_dry_run_forced_choices_and_no_tuning_alias(capsys, launch_env, monkeypatch):
    launch_env(1)
    hosts = ["--hostfile", str(HOSTFILES / "two-hosts.txt"), "-np", "4"]
    rc, argv, err = dry_launch(capsys, "--yield-when-idle", "on", *hosts)
    assert rc == 0 and argv[:5] == ["horovodrun", "-np", "4", "--hostfile",
                                    str(HOSTFILES / "two-hosts.txt")]
    assert "--mpi-args=--mca mpi_yield_when_idle 1" in argv
    assert err == ("hvdtrain: idle MPI ranks yield their core (mpi_yield_when_idle=1): "
                   "--yield-when-idle on\n")
    launch_env(0)
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "1")
    for flags in (["--no-tuning"], ["--yield-when-idle", "off"]):
        rc, argv, err = dry_launch(capsys, *flags, *hosts)
        assert rc == 0 and not any(a.startswith("--mpi-args") for a in argv)
        assert err == ("hvdtrain: idle MPI ranks busy-poll (Open MPI's default, no "
                       "mpi_yield_when_idle): --yield-when-idle off; "
                       "OMPI_MCA_mpi_yield_when_idle=1 from the environment still applies\n")


def test_launch_dry_run_mpich_hostfile_gloo_and_bad_mca(capsys, launch_env):
    launch_env(0)
    hosts = ["--hostfile", str(HOSTFILES / "mpich.txt"), "-np", "4"]
    rc, argv, err = dry_launch(capsys, "--gloo", *hosts)
    assert rc == 0 and argv[:6] == ["horovodrun", "-np", "4", "-H", "node1:2,node2:2", "--gloo"]
    assert err == "hvdtrain: --gloo: no MPI, so no mpi_yield_when_idle\n"
    rc, argv, err = dry_launch(capsys, "--launcher", "mpirun", "--mca",
                               "mpi_yield_when_idle=0", *hosts)
    assert rc == 0 and argv[argv.index("mpi_yield_when_idle") + 1] == "0"
    assert err.endswith("; --mca mpi_yield_when_idle=0 overrides this\n")
    rc, argv, err = dry_launch(capsys, "--launcher", "mpirun", "--mca", "btl", *hosts)
    assert rc == 2 and argv == []
    assert err == ("hvdtrain: error: --mca 'btl' is not KEY=VALUE; write e.g. "
                   "--mca btl_tcp_if_include=eth0\n")


def test_report_shows_a_run_stopped_before_its_first_epoch(tmp_path):
    """A run stopped by a non-finite loss (or preempted) in epoch 1 has no accuracy or rate yet:
    `hvdtrain report` prints "-" for them, and the numbers of a finished run beside it."""
    from hvdtrain.cli import main
    header = {"framework": "torch", "size": 2, "global_batch": 32, "versions": {}}
    runs = {"stopped": {**header, "epochs": [], "final_test_accuracy": None,
                        "samples_per_sec": None, "nonfinite_stop": "non-finite loss ..."},
            "done": {**header, "epochs": [{}], "final_test_accuracy": 0.9712,
                     "samples_per_sec": 1234.4}}
    for name, m in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(m))
    rows = tmp_path / "rows.json"
    assert main(["report", str(tmp_path / "stopped"), str(tmp_path / "done"),
                 "--json-out", str(rows)]) == 0
    stopped, done = json.loads(rows.read_text())
    assert stopped["test_accuracy"] is None and stopped["epochs"] == 0
    assert done["test_accuracy"] == 0.9712


def test_launch_refuses_a_bad_omp_num_threads_before_starting(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    rc, argv, err = dry_launch(capsys, "-np", "2")
    assert rc == 2 and argv == []
    assert "hvdtrain: error: OMP_NUM_THREADS must be a whole number >= 1" in err
