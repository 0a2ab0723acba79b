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
    assert rc == 0 and "mpi_yield_when_idle" not in argv  # each rank's own rule applies
    assert err == ("hvdtrain: GPU ranks busy-poll (Open MPI's default), CPU ranks yield their "
                   "core: 2 GPUs visible on this host: the ranks compute on their GPUs, and "
                   "yielding would only add MPI latency; --yield-when-idle on/off sets it for "
                   "every rank\n")
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
        rc, argv, err = dry_launch(capsys, *flags, *hosts)  # off overrides the environment
        assert rc == 0 and "--mpi-args=--mca mpi_yield_when_idle 0" in argv
        assert err == ("hvdtrain: idle MPI ranks busy-poll (Open MPI's default, "
                       "mpi_yield_when_idle=0): --yield-when-idle off\n")


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


# ---- what --help says (issue 38: grouped, recipe-aware, no test-only options, no RST) ---------
import argparse  # noqa: E402
import re  # noqa: E402

TRAIN_GROUPS = ["data", "model and optimizer", "distribution", "precision", "checkpoints",
                "output", "launch"]


def _subparsers():
    from hvdtrain.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def _help(*argv) -> str:
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.cli", *argv, "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_train_help_is_grouped_and_shows_choices():
    text = _help("train")
    options_part = text.split("\nexamples:\n")[0]  # the epilog's own headings after it
    headings = [line[:-1] for line in options_part.splitlines()
                if re.fullmatch(r"[a-z][a-z ]*:", line)]
    assert headings == ["options", *TRAIN_GROUPS]
    options = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^  (-\S+)", options, re.M) == ["-h,"]  # every option in a group
    for shown in ("--framework {torch,keras}", "--dataset {digits,mnist,synthetic}",
                  "--precision {fp32,bf16,fp16}", "--keras-backend {tensorflow,torch}",
                  "--lr-schedule {constant,cosine,step}", "--device {auto,cpu,cuda}"):
        assert shown in text
    assert "FRAMEWORK" not in text and "DATASET" not in text
    assert text.startswith("usage: hvdtrain train [--framework {torch,keras}] "
                           "[--dataset {digits,mnist,synthetic}] [OPTION ...]\n")


def test_train_help_shows_each_recipes_values_from_recipes_py():
    from hvdtrain.config import TrainConfig, flag_of
    from hvdtrain.datasets.recipes import RECIPES
    _, commands = _subparsers()
    actions = {a.dest: a for a in commands["train"]._actions}
    assert any(RECIPES.values())
    for dataset, recipe in RECIPES.items():
        for name, value in recipe.items():
            assert f"--dataset {dataset}: {value}" in actions[name].help, (dataset, name)
            flag = flag_of(TrainConfig.__dataclass_fields__[name])
            assert f"{flag} {value}" in actions["dataset"].help  # the recipe, on --dataset
    # The defaults shown are TrainConfig's own, not hand-typed: --epochs 15, mnist's 4.
    epochs = TrainConfig.__dataclass_fields__["epochs"].default
    assert f"(default: {epochs}; --dataset mnist: {RECIPES['mnist']['epochs']})" in \
        " ".join(_help("train").split())


def test_fault_drills_are_hidden_from_help_but_accepted(tmp_path):
    text = _help("train")
    assert "--fault-nan-at" not in text and "--fault-slow-from" not in text
    assert "fault drill" not in text
    parser, _ = _subparsers()
    args = parser.parse_args(["train", "--fault-nan-at", "1:5", "--fault-slow-from", "3:0.5"])
    assert (args.fault_nan_at, args.fault_slow_from) == ("1:5", "3:0.5")
    from hvdtrain.config import TrainConfig
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    cfg = TrainConfig.from_options({**fields, "output_dir": str(tmp_path)}).validate()
    assert cfg.fault() == (1, 5) and cfg.slow_fault() == (3, 0.5)
    result, stderr = train(tmp_path, "--fault-nan-at", "one")
    assert result == {"rc": 2, "loaded": []}
    assert "hvdtrain: error: --fault-nan-at must be RANK:STEP, e.g. 1:5; got 'one'" in stderr


@pytest.mark.parametrize("command", [(), ("train",), ("launch",), ("doctor",), ("report",)])
def test_no_empty_defaults_and_no_markup_in_help(command):
    text = _help(*command)
    assert "(default: '')" not in text and "default: ''" not in text
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert "%(" not in text  # argparse's placeholders all filled in


def _sample(action) -> list[str]:
    """A value that ``action`` accepts, as typed on the command line."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [list(action.choices)[0]]
    braces = re.fullmatch(r"\{([^}]*)\}", action.metavar or "")
    if braces:  # choices shown as the metavar, checked by TrainConfig.validate
        return [braces.group(1).split(",")[0]]
    if action.type is int:
        return ["3"]
    if action.type is float:
        return ["0.5"]
    return [{"hosts_spec": "localhost:2", "mca": "btl=self"}.get(action.dest, "x")]


@pytest.mark.parametrize("command", ["train", "launch", "doctor", "report"])
def test_every_option_in_help_parses(command, tmp_path):
    """Each option string that --help shows is an option of the parser, and parses with a
    value of its kind; for train, the choices shown also pass TrainConfig.validate."""
    from hvdtrain.config import TrainConfig
    parser, commands = _subparsers()
    sub = commands[command]
    text = _help(command)
    shown = set()
    for line in text.split("\n\n", 2)[2].splitlines():  # past usage and description
        m = re.match(r"  (-[^-\s].*?|--\w.*?)(?:  |$)", line)
        if m:
            shown |= {s.split()[0] for s in m.group(1).split(", ")}
    assert shown, text
    visible = {s for a in sub._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
    assert shown == visible
    tail = {"launch": ["--", "true"], "report": ["run"]}.get(command, [])
    for flag in sorted(shown - {"-h", "--help"}):
        action = sub._option_string_actions[flag]
        args = parser.parse_args([command, flag, *_sample(action), *tail])
        assert action.dest in vars(args), flag
        if command == "train":
            given = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
            cfg = TrainConfig.from_options({**given, "output_dir": str(tmp_path)})
            if re.fullmatch(r"\{.*\}", action.metavar or "") and action.dest != "keras_backend":
                cfg.validate()


def test_launch_takes_horovodruns_hosts_option():
    parser, _ = _subparsers()
    assert parser.parse_args(["launch", "--", "true"]).hosts_spec is None
    for flag in ("-H", "--hosts"):
        args = parser.parse_args(["launch", flag, "node1:2,node2:2", "-np", "4", "--", "true"])
        assert args.hosts_spec == "node1:2,node2:2" and args.np == 4


def test_launch_help_shows_the_command_it_runs(capsys, launch_env):
    """The example in `hvdtrain launch --help` is what --dry-run prints for it on a host
    without GPUs."""
    import shlex
    text = _help("launch")
    assert "--dry-run" in text and "prints it and stops" in " ".join(text.split())
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  $ hvdtrain launch"))
    typed, printed = shlex.split(lines[at][4:]), lines[at + 1].strip()
    launch_env(0)
    from hvdtrain.cli import main
    monkey_cwd = Path(__file__).resolve().parents[2]
    import os
    old = os.getcwd()
    os.chdir(monkey_cwd)  # the example's hostfile path is relative to the checkout
    try:
        assert main(typed[1:]) == 0
    finally:
        os.chdir(old)
    out, _ = capsys.readouterr()
    assert out.strip() == printed
