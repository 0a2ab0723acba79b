"""`hvdtrain worker -- COMMAND` (hvdtrain.launch.pod), the main process of the MPIJob's worker pods:
a SIGTERM to it reaches the ranks below it first, and COMMAND (sshd) ends only after they have
checkpointed and exited. The same in a real pod: scripts/mpijob_contract.py's eviction drill
(tests/container)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

BIN = Path(sys.executable).parent  # the venv's console scripts (hvdtrain)


# A rank: catches SIGTERM, says so, and finishes its last step and stop checkpoint only once
# the test writes OUT/release (so the worker is seen waiting for it, whatever the machine's
# speed); then exits 75.
RANK = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from hvdtrain.files import atomic_open
    out, name = Path(sys.argv[1]), sys.argv[2]
    def put(what):  # written whole (atomic_open): the test reads a file as soon as it exists
        with atomic_open(out / f"{name}.{what}", "w") as f:
            f.write(str(os.getpid()))
    def stop(signum, frame):
        put("stopping")
        deadline = time.monotonic() + 60
        while not (out / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        put("checkpointed")
        sys.exit(75)
    signal.signal(signal.SIGTERM, stop)
    put("ready")
    while True:
        signal.pause()
""")
# sshd: starts rank "a" below it (as mpirun's orted does over ssh) and rank "b" through a process
# that exits at once (b is left to the worker, its subreaper; OUT/starter-exited says the starter
# has been reaped, so b has its new parent); on SIGTERM it records whether both ranks had
# checkpointed by then, and exits as sshd does.
SSHD = textwrap.dedent("""
    import os, signal, subprocess, sys
    from pathlib import Path
    from hvdtrain.files import atomic_open
    out, rank = Path(sys.argv[1]), sys.argv[2]
    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"}
    subprocess.Popen([sys.executable, "-c", rank, str(out), "a"], env=env)
    starter = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], "
               "sys.argv[2], 'b'])")
    subprocess.run([sys.executable, "-c", starter, rank, str(out)], env=env, check=True)
    with atomic_open(out / "starter-exited", "w") as f:
        f.write(str(os.getpid()))
    def stop(signum, frame):
        done = all((out / f"{n}.checkpointed").exists() for n in "ab")
        with atomic_open(out / "sshd-ended", "w") as f:
            f.write("after the ranks" if done else "before the ranks")
        sys.exit(255)
    signal.signal(signal.SIGTERM, stop)
    while True:
        signal.pause()
""")


def wait_for(path: Path, proc: subprocess.Popen, deadline_s: float = 60.0) -> str:
    """The content of ``path`` once it is written (while ``proc`` still runs)."""
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path} in {deadline_s} s"
        time.sleep(0.05)
    return path.read_text()


def test_sigterm_reaches_the_pods_ranks_before_sshd_ends(tmp_path):
    pod, other = tmp_path / "pod", tmp_path / "other"
    pod.mkdir()
    other.mkdir()
    # A rank of another job on this machine, not below the worker: it must not be signalled.
    bystander = subprocess.Popen([sys.executable, "-c", RANK, str(other), "x"],
                                 env={**os.environ, "OMPI_COMM_WORLD_RANK": "0"})
    worker = subprocess.Popen([str(BIN / "hvdtrain"), "worker", "--", sys.executable, "-c", SSHD,
                               str(pod), RANK], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(other / "x.ready", bystander)
        pids = {n: int(wait_for(pod / f"{n}.ready", worker)) for n in "ab"}
        # b's parent has exited (b may be ready before it has: wait for sshd to have reaped it):
        # b was left to the worker (its subreaper), not to init.
        wait_for(pod / "starter-exited", worker)
        assert int(Path(f"/proc/{pids['b']}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
            == worker.pid
        worker.send_signal(signal.SIGTERM)
        # The worker says it waits for the ranks (a line on its stderr: read until it comes),
        # while both hold their checkpoint; only then may they finish it. A worker that ended
        # sshd without waiting would do so while they still hold it.
        said = []
        while not said or "waiting for them" not in said[-1]:
            said.append(worker.stderr.readline())
            assert said[-1], f"hvdtrain worker ended without waiting: {''.join(said)}"
        assert {n: int(wait_for(pod / f"{n}.stopping", worker)) for n in "ab"} == pids
        (pod / "release").touch()
        _, rest = worker.communicate(timeout=60)
        err = "".join(said) + rest
        assert worker.returncode == 0, err
        assert {n: int((pod / f"{n}.checkpointed").read_text()) for n in "ab"} == pids
        assert (pod / "sshd-ended").read_text() == "after the ranks"
        assert "SIGTERM sent to 2 rank(s) in this pod" in err and "ranks exited" in err
        assert bystander.poll() is None and not (other / "x.checkpointed").exists()
    finally:
        for proc in (worker, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_sigterm_without_ranks_ends_the_command(tmp_path):
    worker = subprocess.Popen([str(BIN / "hvdtrain"), "worker", "--", sys.executable, "-c",
                               "import pathlib, signal, sys; pathlib.Path(sys.argv[1]).touch(); "
                               "signal.pause()", str(tmp_path / "up")],
                              stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "up", worker)
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0 and "SIGTERM: no rank runs in this pod" in err


def test_the_commands_own_exit_status_and_bad_commands():
    """COMMAND's status passes through (128 + N for a signal N), as a container's would."""
    run = [str(BIN / "hvdtrain"), "worker"]
    assert subprocess.run([*run, "--", "sh", "-c", "exit 3"]).returncode == 3
    assert subprocess.run([*run, "--", "sh", "-c", "kill -9 $$"]).returncode == 128 + 9
    missing = subprocess.run([*run, "--", "/nonexistent/sshd", "-De"], capture_output=True,
                             text=True)
    assert missing.returncode == 127 and "cannot start '/nonexistent/sshd'" in missing.stderr
    bare = subprocess.run(run, capture_output=True, text=True)
    assert bare.returncode == 2 and "hvdtrain worker -- /usr/sbin/sshd -De" in bare.stderr
