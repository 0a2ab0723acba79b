"""Horovod Elastic under real failures, for both trainers: three workers on three test hosts, one is
killed, training goes on with two; a host added through the discovery script joins."""
import json
import os
import signal
import subprocess
import time

import pytest

from jobs import BIN, job_env
from testhosts import SshTestHosts


def epochs_done(out):
    try:
        return json.loads((out / "metrics.json").read_text())["epochs"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def worker_pid(host):
    """PID of the training process started on test host ``host`` (its ssh session's address)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
            env = open(f"/proc/{d}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "hvdtrain\0train\0--elastic" in cmd and any(
                e.startswith("SSH_CONNECTION=") and e.split()[2] == host for e in env):
            return int(d)
    return None


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_elastic_survives_a_lost_worker_and_takes_a_new_one(tmp_path, framework):
    with SshTestHosts(count=4, slots=1) as hosts:
        first, spare = hosts.addresses[:3], hosts.addresses[3]
        available = tmp_path / "available"
        available.write_text("".join(f"{h}:1\n" for h in first))
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {available}\n")
        discover.chmod(0o755)
        out = tmp_path / "run"
        argv = [str(BIN / "hvdtrain"), "launch", "--elastic", "--min-np", "1", "--max-np", "3",
                "-np", "3", "--host-discovery-script", str(discover), "--ssh-port",
                str(hosts.port), "--ssh-identity-file", str(hosts.identity),
                "--network-interfaces", "lo", "--", "hvdtrain", "train", "--elastic",
                "--framework", framework, "--epochs", "12", "--dataset", "digits", "--commit-every", "5",
                "--output-dir", str(out), "--no-progress"]
        proc = subprocess.Popen(argv, env=job_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not epochs_done(out) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stdout.read()[-12000:]
                time.sleep(0.2)
            victim = worker_pid(first[2])
            assert victim, "no worker found on the third host"
            os.kill(victim, signal.SIGKILL)  # the rest runs on without it
            while len(epochs_done(out)) < 4 and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stdout.read()[-12000:]
                time.sleep(0.2)
            available.write_text("".join(f"{h}:1\n" for h in first + [spare]))
            output, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, output[-4000:]
        epochs = epochs_done(out)
        sizes = [e["sizes"] for e in epochs]
        assert len(epochs) == 12
        assert 3 in sizes[0] and any(2 in s for s in sizes[1:4]), sizes
        assert any(3 in s for s in sizes[4:]), sizes  # the added host joined
        # Committed work is neither lost nor repeated: each epoch trained on every sample once
        # (plus the sampler's padding: at most one local batch per worker).
        train_samples = json.loads((out / "metrics.json").read_text())["train_samples"]
        for e in epochs:
            assert train_samples <= e["samples"] <= train_samples + 16 * 3, e
        assert epochs[-1]["test_accuracy"] >= 0.95, epochs[-1]
