"""`hvdtrain doctor --hostfile` / `hvdtrain launch --check` against real test hosts (sshd on
127.0.0.2 and 127.0.0.3, testhosts.py), with each multi-host failure made on purpose: a host key
unknown, sshd stopped on one host, another torch version on one host, an all-reduce that does not
finish in time. Each must name the host, the cause and the fix."""
import subprocess

import pytest

from jobs import BIN, job_env
from testhosts import SshTestHosts


def doctor(hosts, tmp_path, *extra, command="doctor"):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hosts.hostfile_text)
    argv = [str(BIN / "hvdtrain"), command, "--hostfile", str(hostfile), "--ssh-port",
            str(hosts.port), "--ssh-identity-file", str(hosts.identity),
            "--network-interfaces", "lo", *extra]
    return subprocess.run(argv, env=job_env(), capture_output=True, text=True, timeout=600)


def known_hosts(hosts, known: bool):
    """Remove the test hosts' keys from root's known_hosts, or add them (the fix the pre-flight
    prints)."""
    for address in hosts.addresses:
        subprocess.run(["ssh-keygen", "-R", f"[{address}]:{hosts.port}"], capture_output=True)
        if known:
            subprocess.run(f"mkdir -p ~/.ssh && ssh-keyscan -p {hosts.port} {address} >> "
                           "~/.ssh/known_hosts",
                           shell=True, capture_output=True, check=True, timeout=60)


def test_an_unknown_host_key_is_named_with_its_fix_and_then_everything_passes(tmp_path):
    with SshTestHosts(count=2, slots=1) as hosts:
        known_hosts(hosts, known=False)
        proc = doctor(hosts, tmp_path)
        assert proc.returncode == 1
        fail = f"FAIL 127.0.0.2        ssh        the host key of [127.0.0.2]:{hosts.port} is " \
               "not in known_hosts"
        assert fail in proc.stdout, proc.stdout
        assert f"fix: verify the host's fingerprint and add it: mkdir -p ~/.ssh && ssh-keyscan " \
               f"-p {hosts.port} 127.0.0.2 >> ~/.ssh/known_hosts" in proc.stdout
        assert "FAIL all              allreduce  not tried" in proc.stdout
        known_hosts(hosts, known=True)
        proc = doctor(hosts, tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for host in hosts.addresses:
            assert f"ok   {host:<16} ssh        batch-mode ssh works" in proc.stdout
            assert f"ok   {host:<16} versions   Python" in proc.stdout
        assert "ok   all              network    lo on every host" in proc.stdout
        assert "ok   all              allreduce  2 ranks on 2 host(s) summed correctly" \
            in proc.stdout
        # The all-reduce under a timeout it cannot meet: the hang is reported, not waited out.
        proc = doctor(hosts, tmp_path, "--timeout", "1")
        assert proc.returncode == 1
        assert "FAIL all              allreduce  no result within 1 s" in proc.stdout
        assert "fix: pass --network-interfaces" in proc.stdout


def test_sshd_stopped_on_one_host_and_launch_check_launches_nothing(tmp_path):
    with SshTestHosts(count=2, slots=1) as hosts:
        known_hosts(hosts, known=True)
        hosts.procs[1].terminate()  # 127.0.0.3's sshd
        hosts.procs[1].wait(timeout=30)
        proc = doctor(hosts, tmp_path)
        assert proc.returncode == 1
        assert "ok   127.0.0.2        ssh" in proc.stdout
        assert f"FAIL 127.0.0.3        ssh        nothing listens for ssh on [127.0.0.3]:" \
               f"{hosts.port}" in proc.stdout
        assert "fix: start sshd on that host, or pass the right --ssh-port" in proc.stdout
        marker = tmp_path / "launched"
        proc = doctor(hosts, tmp_path, "--check", "-np", "2", "--", "python", "-c",
                      f"open({str(marker)!r}, 'w')", command="launch")
        assert proc.returncode == 1 and not marker.exists()
        assert "hvdtrain: error: pre-flight failed: 2 check(s)" in proc.stderr


def test_another_torch_version_on_one_host(tmp_path):
    fake = tmp_path / "site"  # a torch 0.0.1 that host 127.0.0.3 sees first on its sys.path
    (fake / "torch-0.0.1.dist-info").mkdir(parents=True)
    (fake / "torch-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 0.0.1\n")
    with SshTestHosts(count=2, slots=1,
                      session_env={"127.0.0.3": {"PYTHONPATH": str(fake)}}) as hosts:
        known_hosts(hosts, known=True)
        proc = doctor(hosts, tmp_path)
        assert proc.returncode == 1
        import torch
        here = torch.__version__.split("+")[0]
        line = next(x for x in proc.stdout.splitlines() if "127.0.0.3" in x and "versions" in x)
        assert line.startswith("FAIL") and "torch 0.0.1 (here " in line, proc.stdout
        assert here in line
        assert "ok   127.0.0.2        versions" in proc.stdout
        assert "fix: install the same versions on every host" in proc.stdout
