import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdtrain.launch import hostfile as hf
from hvdtrain.launch import tuning

ROOT = Path(__file__).resolve().parents[2]


def read(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return hf.read_hostfile(path)


def test_openmpi_format_with_comments_blank_lines_and_max_slots(tmp_path):
    h = read(tmp_path, "# cluster\n\nnode-1 slots=4 max_slots=8  # big one\n10.1.2.3 slots=2\n"
                       "fe80::1 slots=1\n")
    assert [(x.name, x.slots, x.line) for x in h.hosts] == [
        ("node-1", 4, 3), ("10.1.2.3", 2, 4), ("fe80::1", 1, 5)]
    assert h.slots == 7 and not h.bare and not h.mpich
    assert h.as_h() == "node-1:4,10.1.2.3:2,fe80::1:1"


def test_bare_and_mpich_files(tmp_path):
    assert read(tmp_path, "a slots=1\nb slots=2\n").bare
    m = read(tmp_path, "a:2\nb.example.org:3\n")
    assert m.mpich and [(x.name, x.slots) for x in m.hosts] == [("a", 2), ("b.example.org", 3)]


@pytest.mark.parametrize("text,message", [
    ("node1\n", "line 1: 'node1' has no slots; write 'node1 slots=N'"),
    ("node1 slots=x\n", "line 1: 'slots=x' is not a whole number; write e.g. slots=2"),
    ("node1 slots=0\n", "line 1: 'slots=0' must be at least 1"),
    ("node1 slots=-2\n", "line 1: 'slots=-2' is not a whole number"),
    ("node1:two\n", "line 1: 'slots=two' is not a whole number"),
    ("# c\nnode1 slots=2 gpus=4\n", "line 2: unknown key 'gpus'; the keys are slots, max_slots"),
    ("node1 2\n", "line 1: '2' is not key=value"),
    ("node1 slots=4 max_slots=2\n", "line 1: max_slots=2 is below slots=4"),
    ("node1:2 slots=2\n", "line 1: slots given twice"),
    ("node_1 slots=2\n", "line 1: 'node_1' is not a valid hostname or IP address"),
    ("-node slots=2\n", "'-node' is not a valid hostname"),
    ("10.0.0.300 slots=2\n", "'10.0.0.300' is not a valid hostname"),
    ("a..b slots=1\n", "'a..b' is not a valid hostname"),
    ("a slots=1\nb slots=1\na slots=2\n", "line 3: host 'a' is already on line 1"),
    ("# nothing\n\n", "names no hosts"),
])
def test_errors_name_the_line_and_the_fix(tmp_path, text, message):
    with pytest.raises(hf.HostfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read(tmp_path, text)


def test_unreadable_hostfile(tmp_path):
    with pytest.raises(hf.HostfileError, match="cannot read hostfile .*missing"):
        hf.read_hostfile(tmp_path / "missing")


def test_np_checks(tmp_path):
    h = read(tmp_path, "a slots=2\nb slots=1\n")
    hf.check_np(h, 3)
    with pytest.raises(hf.HostfileError, match=r"-np 4 is more than the 3 slots .*\(a:2,b:1\); "
                                               "lower -np or add slots"):
        hf.check_np(h, 4)
    with pytest.raises(hf.HostfileError, match="-np must be at least 1"):
        hf.check_np(h, 0)


def test_long_hostnames():
    assert hf.valid_hostname("a" * 63 + ".example")
    assert not hf.valid_hostname("a" * 64)
    assert not hf.valid_hostname(".".join(["abc"] * 70))


def test_horovodrun_argv(tmp_path):
    bare = read(tmp_path, "a slots=2\nb slots=2\n")
    argv, env = hf.horovodrun_argv(4, bare, ["hvdtrain", "train"], ssh_port=2222,
                                   ssh_identity_file="/k", network_interfaces="eth0",
                                   env={"X": "1"})
    assert argv == ["horovodrun", "-np", "4", "--hostfile", str(tmp_path / "hosts"),
                    "--ssh-port", "2222", "--ssh-identity-file", "/k",
                    "--network-interfaces", "eth0", "hvdtrain", "train"]
    assert env == {"X": "1"}
    commented = read(tmp_path, "# two nodes\na slots=2\nb slots=1\n")
    argv, _ = hf.horovodrun_argv(3, commented, ["python", "t.py"], gloo=True)
    assert argv == ["horovodrun", "-np", "3", "-H", "a:2,b:1", "--gloo", "python", "t.py"]


def test_mpirun_argv(tmp_path):
    h = read(tmp_path, "a slots=2\nb slots=2\n")
    env = {"PATH": "/bin", "LD_LIBRARY_PATH": "/lib", "HOROVOD_FUSION_THRESHOLD": "1",
           "PYTHONPATH": "/p", "SECRET": "no"}
    argv, out_env = hf.mpirun_argv(4, h, ["python", "t.py"], env=env, allow_run_as_root=True,
                                   mca={"btl_tcp_if_include": "lo"})
    assert argv == ["mpirun", "--allow-run-as-root", "-np", "4", "--hostfile",
                    str(tmp_path / "hosts"), "-bind-to", "none", "-map-by", "slot",
                    "-x", "HOROVOD_FUSION_THRESHOLD", "-x", "LD_LIBRARY_PATH", "-x", "PATH",
                    "-x", "PYTHONPATH", "-mca", "pml", "ob1", "-mca", "btl", "^openib",
                    "-mca", "btl_tcp_if_include", "lo", "python", "t.py"]
    assert out_env == env
    mpich = read(tmp_path, "a:2\nb:2\n")
    argv, _ = hf.mpirun_argv(2, mpich, ["x"])
    assert argv[:5] == ["mpirun", "-np", "2", "-H", "a:2,b:2"]
    with pytest.raises(ValueError, match="no command to launch"):
        hf.mpirun_argv(2, mpich, [])


def test_format_hostfile_round_trips(tmp_path):
    h = read(tmp_path, "a slots=2\nb:3\n")
    for style in ("openmpi", "mpich"):
        assert [(x.name, x.slots) for x in hf.parse_hostfile(hf.format_hostfile(h.hosts, style))] \
            == [("a", 2), ("b", 3)]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "hostfiles").glob("*.txt")))
def test_example_hostfiles_are_valid(name):
    assert hf.read_hostfile(ROOT / "hostfiles" / name).slots >= 1


def test_launch_rejects_bad_input_before_launching(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("a slots=2\nb slots=two\n")
    exe = [sys.executable, "-m", "hvdtrain.cli", "launch"]
    proc = subprocess.run(exe + ["--hostfile", str(bad), "-np", "2", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"hostfile {bad} line 2: 'slots=two' is not a whole number" in proc.stderr
    good = ROOT / "hostfiles" / "localhost.txt"
    proc = subprocess.run(exe + ["--hostfile", str(good), "-np", "3", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "-np 3 is more than the 2 slots" in proc.stderr
    proc = subprocess.run(exe + ["--hostfile", str(good), "-np", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no command to launch" in proc.stderr
    proc = subprocess.run(exe + ["--hostfile", str(good), "-np", "2", "--", "true"],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"})
    assert proc.returncode == 2 and "horovodrun not found on PATH" in proc.stderr


def test_launch_tuning_passes_to_both_launchers(tmp_path):
    h = read(tmp_path, "a slots=2\nb slots=1\n")
    mca, _ = tuning.launch_tuning("on")
    assert mca == {"mpi_yield_when_idle": "1"}
    argv, _ = hf.mpirun_argv(2, h, ["x"], mca=mca)
    assert argv[argv.index("mpi_yield_when_idle") - 1] == "-mca"
    argv, _ = hf.horovodrun_argv(2, h, ["x"], mca=mca)
    assert "--mpi-args=--mca mpi_yield_when_idle 1" in argv
    argv, _ = hf.horovodrun_argv(2, h, ["x"], gloo=True, mca=mca)
    assert not any(a.startswith("--mpi-args") for a in argv)


def test_yield_when_idle_auto_is_on_for_cpu_hosts_and_off_for_gpu_hosts():
    mca, reason = tuning.launch_tuning("auto", gpus=0)
    assert mca == {"mpi_yield_when_idle": "1"}
    assert reason.startswith("idle MPI ranks yield their core (mpi_yield_when_idle=1): no GPU "
                             "visible on this host")
    assert reason.endswith("--yield-when-idle off turns this off")
    mca, reason = tuning.launch_tuning("auto", gpus=4)
    assert mca == {}  # each rank's own rule: a CPU rank on a GPU host still yields
    assert reason.startswith("GPU ranks busy-poll (Open MPI's default), CPU ranks yield their "
                             "core: 4 GPUs visible on this host")
    assert reason.endswith("--yield-when-idle on/off sets it for every rank")
    assert "1 GPU visible" in tuning.launch_tuning("auto", gpus=1)[1]


def test_yield_when_idle_forced_on_or_off_ignores_gpus():
    for gpus in (0, 2):
        assert tuning.launch_tuning("on", gpus) == (
            {"mpi_yield_when_idle": "1"},
            "idle MPI ranks yield their core (mpi_yield_when_idle=1): --yield-when-idle on")
        assert tuning.launch_tuning("off", gpus) == (
            {"mpi_yield_when_idle": "0"}, "idle MPI ranks busy-poll (Open MPI's default, "
            "mpi_yield_when_idle=0): --yield-when-idle off")
    # off overrides the environment's value (before: it still applied, against what was said)
    mca, _ = tuning.launch_tuning("off", env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    assert mca == {"mpi_yield_when_idle": "0"}
    # auto on a GPU host leaves a value from the environment in force, and says so
    mca, reason = tuning.launch_tuning("auto", 2, env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    assert mca == {} and reason.endswith(
        "OMPI_MCA_mpi_yield_when_idle=1 from the environment applies (--yield-when-idle on/off "
        "overrides it)")
    with pytest.raises(ValueError, match="--yield-when-idle must be one of auto, on, off; got 'y"):
        tuning.launch_tuning("yes")
    with pytest.raises(ValueError, match="gpus must be >= 0"):
        tuning.launch_tuning("auto", gpus=-1)


def fake_smi(tmp_path, body):
    """A directory holding an executable ``nvidia-smi`` shell script with ``body``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(0o755)
    return str(bin_dir)


TWO_GPUS = ('echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)"; '
            'echo "  MIG 3g.40gb     Device  0: (UUID: MIG-bbbb)"; '
            'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-cccc)"')


@pytest.mark.parametrize("cuda_visible,expected", [
    (None, 2), ("0,1", 2), ("1", 1), ("0,1,2,3", 2), ("", 0), ("-1", 0), ("NoDevFiles", 0),
    ("0,-1,1", 1), ("5,0", 0), ("GPU-cccc", 1),
])
def test_visible_gpus_counts_nvidia_smi_and_honours_cuda_visible_devices(tmp_path, cuda_visible,
                                                                          expected):
    env = {"PATH": fake_smi(tmp_path, TWO_GPUS)}
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    assert tuning.visible_gpus(env) == expected


def test_visible_gpus_is_zero_without_a_working_nvidia_smi(tmp_path):
    assert tuning.visible_gpus({"PATH": str(tmp_path / "none")}) == 0
    assert tuning.visible_gpus(
        {"PATH": fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed'; exit 9")}) == 0
    hang = f"exec {shutil.which('sleep')} 30"  # PATH holds only the fake nvidia-smi
    started = time.monotonic()
    assert tuning.visible_gpus({"PATH": fake_smi(tmp_path, hang)}, timeout_s=0.5) == 0
    assert 0.5 <= time.monotonic() - started < 10
    assert tuning.visible_gpus({"PATH": fake_smi(tmp_path, "echo 'No devices were found'")}) == 0
    # CUDA_VISIBLE_DEVICES hiding every device means no GPU without running nvidia-smi at all
    started = time.monotonic()
    assert tuning.visible_gpus({"PATH": fake_smi(tmp_path, hang), "CUDA_VISIBLE_DEVICES": "-1"},
                               timeout_s=30) == 0
    assert time.monotonic() - started < 10


def test_mpirun_forwards_gpu_and_open_mpi_variables(tmp_path):
    h = read(tmp_path, "a slots=2\n")
    env = {"PATH": "/bin", "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0",
           "OMPI_MCA_btl_tcp_if_include": "eth0", "CUDA_VISIBLE_DEVICES": "0,1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "HOME": "/root",
           "SSH_AUTH_SOCK": "/tmp/s", "GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": "PASSIVE"}
    argv, out_env = hf.mpirun_argv(2, h, ["x"], env=env)
    forwarded = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    # the user's OpenMP wait reaches remote ranks, where hvdtrain train would set its own
    assert forwarded == ["CUDA_VISIBLE_DEVICES", "GOMP_SPINCOUNT", "NCCL_DEBUG",
                         "NCCL_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include", "OMP_WAIT_POLICY",
                         "PATH", "PYTORCH_CUDA_ALLOC_CONF"]
    assert out_env == env


def test_horovod_knobs_reach_both_launchers(tmp_path):
    h = read(tmp_path, "a slots=2\n")
    knobs = tuning.horovod_knobs(fusion_threshold_mb=32, cycle_time_ms=2.5, autotune=True)
    assert knobs == {"HOROVOD_FUSION_THRESHOLD": str(32 * 2**20), "HOROVOD_CYCLE_TIME": "2.5",
                     "HOROVOD_AUTOTUNE": "1"}
    argv, _ = hf.horovodrun_argv(2, h, ["x"], knobs=knobs)
    assert argv[-6:] == ["--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                         "--autotune", "x"]
    argv, env = hf.mpirun_argv(2, h, ["x"], env={"PATH": "/bin"}, knobs=knobs)
    assert env["HOROVOD_CYCLE_TIME"] == "2.5"
    for name in knobs:
        assert argv[argv.index(name) - 1] == "-x"
    with pytest.raises(ValueError, match="--cycle-time-ms must be > 0"):
        tuning.horovod_knobs(cycle_time_ms=0)


# ---- elastic: the interface horovodrun needs, from the hosts discovered at launch (issue 37.10) --

def discovery_script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def elastic(script, **kw):
    return hf.horovodrun_elastic_argv(2, ["python", "t.py"], min_np=1, max_np=2,
                                      discovery_script=script, **kw)[0]


def test_elastic_argv_adds_the_loopback_interface_when_every_host_is_this_machine(tmp_path):
    # Before: no --network-interfaces, and horovodrun waited silently for a second host.
    script = discovery_script(tmp_path, "echo localhost:2")
    from hvdtrain.launch.discovery import loopback_interface
    lo = loopback_interface()
    assert elastic(script) == ["horovodrun", "-np", "2", "--min-np", "1", "--max-np", "2",
                               "--host-discovery-script", script, "--network-interfaces", lo,
                               "python", "t.py"]
    # Every loopback address and this machine's own name are this machine (test hosts of
    # tests/parallel live on 127.0.0.x).
    import socket
    for hosts in (["localhost", "127.0.0.2", "127.0.0.3"], [socket.gethostname()]):
        argv = elastic(script, discovered=hosts)
        assert argv[argv.index("--network-interfaces") + 1] == lo, hosts


def test_elastic_argv_keeps_the_interfaces_given_and_then_runs_no_script(tmp_path):
    marker = tmp_path / "ran"
    script = discovery_script(tmp_path, f"touch {marker}\nexit 3")
    argv = elastic(script, network_interfaces="eth0")
    assert argv[argv.index("--network-interfaces") + 1] == "eth0"
    assert argv.count("--network-interfaces") == 1 and not marker.exists()


def test_elastic_argv_leaves_two_or_more_remote_hosts_to_horovodrun(tmp_path):
    # Two hosts: horovodrun compares their interfaces itself. (TEST-NET addresses: never local.)
    script = discovery_script(tmp_path, "echo 192.0.2.77:1; echo 198.51.100.7:1")
    assert "--network-interfaces" not in elastic(script)
    assert "--network-interfaces" not in elastic(script, discovered=["localhost", "203.0.113.9"])


@pytest.mark.parametrize("body,message", [
    ("echo 198.51.100.7:2", "printed only 198.51.100.7 now, and Horovod Elastic without "
                            "--network-interfaces waits"),
    ("true", "printed no hosts now"),
    ("echo node1:two", "printed 'node1:two', which is not 'host:slots'"),
    ("echo oops >&2; exit 3", r"exited with status 3 \(oops\)"),
])
def test_elastic_argv_fails_at_once_saying_what_to_add(tmp_path, body, message):
    script = discovery_script(tmp_path, body)
    with pytest.raises(ValueError, match=message) as info:
        elastic(script)
    if "now" in message:
        assert "add --network-interfaces IFACE" in str(info.value)


def test_discovery_script_that_hangs_is_stopped(tmp_path):
    from hvdtrain.launch.discovery import discover_hosts
    script = discovery_script(tmp_path, "sleep 30")
    start = time.monotonic()
    with pytest.raises(ValueError, match="did not finish within 0.5 s"):
        discover_hosts(script, timeout=0.5)
    assert time.monotonic() - start < 10
    assert discover_hosts(discovery_script(tmp_path, "printf 'a:2\\n\\nb\\n'")) == ["a", "b"]


def test_launch_elastic_dry_run_shows_the_interface_or_refuses(tmp_path):
    exe = [sys.executable, "-m", "hvdtrain.cli", "launch", "--dry-run", "--elastic", "-np", "2",
           "--min-np", "1", "--max-np", "2", "--host-discovery-script"]
    local = discovery_script(tmp_path, "echo localhost:2")
    proc = subprocess.run(exe + [local, "--", "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--network-interfaces lo" in proc.stdout
    # The choice is said, with what it rules out (hosts of other machines joining later).
    assert "hosts of other machines it prints later cannot reach lo" in proc.stderr
    assert "launch with --network-interfaces IFACE" in proc.stderr
    remote = tmp_path / "remote"
    remote.mkdir()
    proc = subprocess.run(exe + [discovery_script(remote, "echo 198.51.100.7:2"), "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "add --network-interfaces IFACE" in proc.stderr
