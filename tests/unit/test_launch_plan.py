"""hvdtrain.launch: one plan for every launcher and mode (elastic gets the same Horovod settings,
and options it cannot honour are refused), and the rank processes a signal is handed to."""
import os
import signal
import subprocess
import sys
import time

import pytest

from hvdtrain.launch import signals
from hvdtrain.launch.plan import PlanError, plan


def launch_args(**over):
    """``hvdtrain launch``'s parsed options, defaults as the parser gives them."""
    from hvdtrain.cli import build_parser
    args = build_parser().parse_args(["launch", "--", "hvdtrain", "train"])
    for key, value in over.items():
        setattr(args, key, value)
    return args


@pytest.fixture
def discovery(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.2:1\n")
    script.chmod(0o755)
    return str(script)


def test_elastic_gets_the_horovod_settings_the_static_launch_gets(discovery):
    # Before: the elastic branch returned before --cycle-time-ms and --fusion-threshold-mb were
    # read, and printed a horovodrun command without them.
    knobs = dict(cycle_time_ms=0.1, fusion_threshold_mb=32, autotune=True)
    elastic = plan(launch_args(elastic=True, np=2, min_np=1, max_np=3,
                               host_discovery_script=discovery, **knobs), env={}, gpus=0)
    static = plan(launch_args(np=2, hostfile=None, **knobs),
                  env={"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "localhost",
                       "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS": "2"}, gpus=0)
    for p in (elastic, static):
        argv = p.argv
        assert argv[argv.index("--cycle-time-ms") + 1] == "0.1"
        assert argv[argv.index("--fusion-threshold-mb") + 1] == "32"
        assert "--autotune" in argv
        assert argv[-2:] == ["hvdtrain", "train"]
    assert elastic.elastic and elastic.argv[:3] == ["horovodrun", "-np", "2"]
    assert elastic.host_names() == ["localhost", "127.0.0.2"]  # asked at signal time


@pytest.mark.parametrize("over,message", [
    (dict(launcher="mpirun"), "--elastic needs --launcher horovodrun"),
    (dict(mca=["btl_tcp_if_include=lo"]), "--mca does not apply to --elastic"),
    (dict(check=True), "--check needs --hostfile"),
    (dict(hostfile="hosts"), "--elastic takes its hosts from --host-discovery-script"),
    (dict(np=None), "-np is required with --elastic"),
])
def test_elastic_refuses_what_it_cannot_honour(discovery, over, message):
    args = launch_args(elastic=True, np=2, host_discovery_script=discovery)
    for key, value in over.items():
        setattr(args, key, value)
    with pytest.raises(PlanError, match=message):
        plan(args, env={}, gpus=0)


def test_elastic_only_options_need_elastic(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    with pytest.raises(PlanError, match="need --elastic"):
        plan(launch_args(hostfile=str(hosts), min_np=1), env={}, gpus=0)


def test_every_launch_is_marked_and_mpirun_forwards_the_mark(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    p = plan(launch_args(hostfile=str(hosts), launcher="mpirun"), env={"PATH": "/usr/bin"},
             gpus=0)
    launch_id = p.env[signals.LAUNCH_ID_VAR]
    assert len(launch_id) == 32
    assert p.argv[p.argv.index(signals.LAUNCH_ID_VAR) - 1] == "-x"  # reaches other hosts' ranks
    again = plan(launch_args(hostfile=str(hosts), launcher="mpirun"), env={"PATH": "/usr/bin"},
                 gpus=0)
    assert again.env[signals.LAUNCH_ID_VAR] != launch_id
    assert p.host_names() == ["localhost"]


def _fake_proc(root, pid, comm, ppid, env):
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")


def test_rank_pids_takes_the_ranks_not_their_shells_children_or_launchers(tmp_path):
    mark = {signals.LAUNCH_ID_VAR: "abc"}
    _fake_proc(tmp_path, 10, "horovodrun", 1, mark)  # no rank variable
    _fake_proc(tmp_path, 11, "mpirun", 10, {**mark, "OMPI_COMM_WORLD_RANK": "0"})
    _fake_proc(tmp_path, 12, "sh", 11, {**mark, "HOROVOD_RANK": "0"})  # gloo's shell
    _fake_proc(tmp_path, 13, "hvdtrain", 12, {**mark, "HOROVOD_RANK": "0"})  # rank 0
    _fake_proc(tmp_path, 14, "python", 13, {**mark, "HOROVOD_RANK": "0"})  # its loader worker
    _fake_proc(tmp_path, 15, "python3", 11, {**mark, "OMPI_COMM_WORLD_RANK": "1"})  # rank 1
    _fake_proc(tmp_path, 16, "python", 1, {signals.LAUNCH_ID_VAR: "other", "HOROVOD_RANK": "0"})
    (tmp_path / "self").mkdir()
    assert signals.rank_pids("abc", tmp_path) == [13, 15]
    assert signals.rank_pids("nope", tmp_path) == []


def test_the_module_signals_this_hosts_ranks_of_one_launch(tmp_path):
    got = tmp_path / "got"
    rank = ("import signal, time, pathlib, sys\n"
            f"p = pathlib.Path({str(got)!r})\n"
            "signal.signal(signal.SIGUSR1, lambda *a: p.write_text('usr1'))\n"
            f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('')\n"
            "deadline = time.time() + 30\n"
            "while not p.exists() and time.time() < deadline:\n"
            "    time.sleep(0.02)\n")
    env = {**os.environ, signals.LAUNCH_ID_VAR: "t" * 32, "HOROVOD_RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", rank], env=env)
    try:
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None
            time.sleep(0.02)
        other = subprocess.run([sys.executable, "-m", "hvdtrain.launch.signals", "--signal",
                                "USR1", "--launch-id", "u" * 32], capture_output=True, text=True)
        assert other.stdout.strip() == "0" and not got.exists()
        done = subprocess.run(signals.remote_command(signal.SIGUSR1, "t" * 32),
                              capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "1"
        assert proc.wait(timeout=30) == 0
        assert got.read_text() == "usr1"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ssh_reaches_other_hosts_as_the_launcher_does():
    argv = signals.ssh_argv("node2", ["python", "-m", "x"], ssh_port=2222,
                            ssh_identity_file="/k")
    assert argv[0] == "ssh" and argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/k" and argv[-2:] == ["node2", "python -m x"]
    assert signals.is_local("localhost") and not signals.is_local("127.0.0.2")
