"""Real multi-host runs: two test hosts on this machine (sshd on 127.0.0.2 and 127.0.0.3, see
testhosts.py), a hostfile naming them, and `hvdtrain launch` driving horovodrun and mpirun."""
import json
import shlex
import subprocess

import pytest

from jobs import BIN, Console, job_env, run, script, train_in
from testhosts import SHARED_CORES_ENV, SshTestHosts

EPOCHS = "3"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with SshTestHosts(count=2, slots=1) as h:
        path = tmp_path_factory.mktemp("hosts") / "hostfile"
        path.write_text(h.hostfile_text)
        h.path = path
        yield h


def launch(hosts, launcher, *command, extra=()):
    argv = [str(BIN / "hvdtrain"), "launch", "--hostfile", str(hosts.path), "-np", "2",
            "--launcher", launcher]
    if launcher == "horovodrun":
        argv += ["--ssh-port", str(hosts.port), "--ssh-identity-file", str(hosts.identity),
                 "--network-interfaces", "lo"]
    else:
        argv += ["--mca", f"plm_rsh_args={shlex.join(hosts.ssh_options)}",
                 "--mca", "btl_tcp_if_include=lo", "--mca", "oob_tcp_if_include=lo"]
    return argv + [*extra, "--", *command]


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_ranks_run_on_different_hosts(hosts, launcher, tmp_path):
    out = tmp_path / "where.json"
    proc = run(launch(hosts, launcher, *script("whereami.py"), "--out", str(out)))
    # hvdtrain launch prints the launcher's command line first; a bare hostfile goes as is.
    assert f"--hostfile {hosts.path}" in Console.of(proc).launcher
    ranks = json.loads(out.read_text())
    assert sorted(r["host"] for r in ranks) == hosts.addresses
    assert all(r["local_size"] == 1 and r["cross_size"] == 2 for r in ranks)


def test_hosts_are_counted_right_with_unequal_slots(hosts, tmp_path):
    # 2 slots on the first host, 1 on the second (hostfiles/mixed-slots.txt's shape): Horovod's
    # cross_size is 2 for the ranks with local rank 0 but 1 for the first host's local rank 1.
    first, second = hosts.addresses
    hostfile = tmp_path / "mixed"
    hostfile.write_text(f"{first} slots=2\n{second} slots=1\n")
    out = tmp_path / "where.json"
    argv = [str(BIN / "hvdtrain"), "launch", "--hostfile", str(hostfile), "-np", "3",
            "--ssh-port", str(hosts.port), "--ssh-identity-file", str(hosts.identity),
            "--network-interfaces", "lo", "--", *script("whereami.py"), "--out", str(out)]
    run(argv)
    ranks = json.loads(out.read_text())
    assert sorted(r["host"] for r in ranks) == [first, first, second]
    assert sorted(r["cross_size"] for r in ranks) == [1, 2, 2]  # why cross_size cannot count hosts
    assert all(r["hosts"] == 2 and r["rank_info_hosts"] == 2 for r in ranks)


@pytest.fixture(scope="module")
def single_host(tmp_path_factory, pools):
    """The same training on one host (2 ranks on localhost: the session's rank pools, whose
    ranks train with the thread counts of a launched rank), per framework."""
    results = {}
    for framework in ("torch", "keras"):
        out = tmp_path_factory.mktemp(f"single-{framework}")
        train_in(pools, out, "--epochs", EPOCHS, "--no-progress", framework=framework)
        results[framework] = json.loads((out / "metrics.json").read_text())
    return results


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_training_across_hosts_matches_single_host(hosts, single_host, framework, launcher,
                                                   tmp_path):
    run(launch(hosts, launcher, "hvdtrain", "train", "--framework", framework, "--epochs",
               EPOCHS, "--output-dir", str(tmp_path), "--no-progress"), env=SHARED_CORES_ENV)
    multi = json.loads((tmp_path / "metrics.json").read_text())
    # OMP_NUM_THREADS reached the ranks over ssh (horovodrun passes the environment on, hvdtrain
    # launch adds -x OMP_NUM_THREADS for mpirun); rank 0 records its threads.
    assert multi["threads_per_rank"] == 1
    single = single_host[framework]
    assert multi["size"] == 2 and multi["hosts"] == 2 and single["hosts"] == 1
    for a, b in zip(multi["epochs"], single["epochs"]):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["epoch"], key)


def test_launch_dry_run_prints_exactly_what_runs(hosts, tmp_path):
    # A stand-in mpirun first on PATH records the argv it is started with.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    record = tmp_path / "argv.json"
    fake = fake_bin / "mpirun"
    fake.write_text(f"#!{BIN / 'python'}\nimport json, sys\n"
                    f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    env = job_env()
    env["PATH"] = f"{fake_bin}:{env['PATH']}"
    argv = launch(hosts, "mpirun", "python", "train.py", "--epochs", "2")
    dry = subprocess.run(argv[:2] + ["--dry-run"] + argv[2:], env=env, capture_output=True,
                         text=True, timeout=60)
    real = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and real.returncode == 0, dry.stderr + real.stderr
    printed = shlex.split(dry.stdout.strip())
    assert printed[0] == "mpirun" and printed[1:] == json.loads(record.read_text())
    assert real.stdout.strip() == dry.stdout.strip()
