"""Pre-flight for multi-host jobs (``hvdtrain doctor --hostfile F``, ``hvdtrain launch --check``):
find out, before a job hangs in ``hvd.init()``, which host and which cause.

A job that hangs at start on several hosts is Horovod's most reported problem (its issues #39,
#111, #125, #310, #684, #1431, #2196, #4018): ssh stopping at a host-key question or a password
prompt, the ranks picking a network interface the other hosts cannot reach, a firewall, different
versions on two hosts. The checks, in order, each naming the host, the cause and the fix:

1. **ssh** to every host that is not this one, in batch mode (``BatchMode=yes``: no password or
   host-key question; an unknown host key is an error, as it is for mpirun's ssh), with the
   launch's ``--ssh-port`` and ``--ssh-identity-file``;
2. **versions**: on every host, the same Python (at the same path) and the same versions of
   torch, tensorflow, keras, horovod and hvdtrain as here (read from package metadata, nothing
   imported);
3. **network interfaces**: one up interface with an IPv4 address that every host has (the
   loopback only counts when every host is this machine), or the ``--network-interfaces`` given;
4. **all-reduce**: a small all-reduce over all slots, launched with horovodrun as ``hvdtrain
   launch`` would, under a timeout; rank 0 writes the result to a file.

``python -m hvdtrain.launch.preflight probe`` (run on each host over ssh) prints that host's facts as
JSON; ``python -m hvdtrain.launch.preflight allreduce --out F`` is the job of check 4.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hvdtrain.launch.hostfile import Hostfile, HostfileError, horovodrun_argv

PACKAGES = ("torch", "tensorflow", "tensorflow-cpu", "keras", "horovod", "hvdtrain")
SSH_TIMEOUT_S = 20  # ConnectTimeout and the whole command's limit, per host
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Check:
    """One pre-flight result.

    Attributes:
        host: the host it is about (``"all"`` for the job-wide checks).
        name: ``"ssh"``, ``"versions"``, ``"network"`` or ``"allreduce"``.
        ok: passed.
        detail: what was found.
        fix: what to do when it failed (empty when ok).
    """
    host: str
    name: str
    ok: bool
    detail: str
    fix: str = ""


def is_this_host(name: str) -> bool:
    """True for names launchers start ranks on without ssh: localhost, 127.0.0.1, this machine's
    hostname (short or fully qualified)."""
    return name in LOCAL_NAMES or name in {socket.gethostname(), socket.getfqdn(),
                                           socket.gethostname().split(".")[0]}


def ssh_argv(host: str, command: list[str], port: int | None = None,
             identity: str | None = None) -> list[str]:
    """``ssh -o BatchMode=yes -o ConnectTimeout=20 [-p P] [-i K] host -- command`` (no
    ``StrictHostKeyChecking=no``: an unknown host key must show up here, not hang mpirun)."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity:
        argv += ["-i", str(identity)]
    return argv + [host, "--", shlex.join(command)]


def diagnose_ssh(host: str, returncode: int, stderr: str, port: int | None = None) -> Check:
    """Turn an ssh exit status and its stderr into a :class:`Check` with the cause and the fix.

    The causes recognised are OpenSSH's messages: ``Host key verification failed`` (the host's
    key is not in known_hosts, and batch mode will not ask), ``REMOTE HOST IDENTIFICATION HAS
    CHANGED``, ``Permission denied`` (no accepted key; a password would be asked), ``Connection
    refused`` (no sshd on that port), ``Connection timed out`` / ``No route to host`` (network
    or firewall), ``Could not resolve hostname``.
    """
    target = f"[{host}]:{port}" if port else host
    keyscan = (f"mkdir -p ~/.ssh && ssh-keyscan {'-p ' + str(port) + ' ' if port else ''}{host}"
               " >> ~/.ssh/known_hosts")
    if returncode == 0:
        return Check(host, "ssh", True, "batch-mode ssh works")
    text = stderr.strip().splitlines()
    last = next((line for line in reversed(text) if line.strip()), f"exit {returncode}")
    causes = [
        ("REMOTE HOST IDENTIFICATION HAS CHANGED", "the host's key changed since it was stored "
         "in known_hosts", f"check why, then: ssh-keygen -R '{target}' and {keyscan}"),
        ("Host key verification failed", f"the host key of {target} is not in known_hosts "
         "(batch-mode ssh, and mpirun, will not ask)", f"verify the host's fingerprint and add it:"
                                                       f" {keyscan}"),
        ("Permission denied", "no key of yours is accepted (a password would be asked, which "
         "a launcher cannot answer)", "install your public key there (ssh-copy-id "
                                      f"{'-p ' + str(port) + ' ' if port else ''}{host}) or pass"
                                      " --ssh-identity-file with the key it accepts"),
        ("Connection refused", f"nothing listens for ssh on {target}",
         "start sshd on that host, or pass the right --ssh-port"),
        ("Could not resolve hostname", f"{host} is not a known host name",
         "fix the hostfile (or /etc/hosts / DNS)"),
        ("timed out", f"no answer from {target} within {SSH_TIMEOUT_S} s",
         "a firewall or a wrong address: check that this machine reaches the host's ssh port"),
        ("No route to host", f"no route to {host}", "a wrong address or network: check the "
                                                    "hostfile and the routing"),
    ]
    for marker, cause, fix in causes:
        if marker in stderr:
            return Check(host, "ssh", False, f"{cause} ({last.strip()})", fix)
    return Check(host, "ssh", False, f"ssh failed: {last.strip()}",
                 f"run the same ssh by hand: ssh -o BatchMode=yes {host} true")


def probe() -> dict:
    """This host's facts for the comparison: hostname, Python (path, version), the versions
    of :data:`PACKAGES` (None when absent) and the up interfaces with their IPv4 addresses."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"hostname": socket.gethostname(), "python": sys.executable,
            "python_version": platform.python_version(), "versions": versions,
            "interfaces": interfaces()}


def interfaces() -> dict[str, list[str]]:
    """Up network interfaces with IPv4 addresses: ``{name: [address, ...]}`` (psutil, a
    dependency of Horovod)."""
    import psutil
    stats = psutil.net_if_stats()
    found = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4 and stats.get(name) is not None and stats[name].isup:
            found[name] = v4
    return found


def compare_versions(host: str, here: dict, there: dict) -> Check:
    """Python and package versions on ``host`` against this host's."""
    diffs = []
    if there["python_version"] != here["python_version"]:
        diffs.append(f"Python {there['python_version']} (here {here['python_version']})")
    for name in PACKAGES:
        a, b = here["versions"].get(name), there["versions"].get(name)
        if a != b:
            diffs.append(f"{name} {b or 'missing'} (here {a or 'missing'})")
    if diffs:
        return Check(host, "versions", False, "different: " + ", ".join(diffs),
                     "install the same versions on every host (run 'make setup' from the same "
                     "checkout there; the wheel cache makes it quick), or use a container image")
    return Check(host, "versions", True, f"Python {here['python_version']}, " + ", ".join(
        f"{n} {v}" for n, v in here["versions"].items() if v))


def common_interfaces(per_host: dict[str, dict[str, list[str]]], requested: str | None = None,
                      all_local: bool = False) -> Check:
    """The network interface check.

    Args:
        per_host: host -> its :func:`interfaces`.
        requested: ``--network-interfaces`` (comma-separated), or None.
        all_local: every host is this machine (then the loopback ``lo`` is a real choice).

    Returns:
        A passed check naming the shared interfaces, or a failed one naming each host's
        interfaces and the option to pass.
    """
    if all_local and not requested:
        return Check("all", "network", True, "every host is this machine: no network between "
                     "hosts")
    shared = set.intersection(*(set(i) for i in per_host.values())) if per_host else set()
    if not all_local:
        shared.discard("lo")
    listing = "; ".join(f"{h}: {', '.join(sorted(i)) or 'none'}" for h, i in per_host.items())
    if requested:
        wanted = [n.strip() for n in requested.split(",") if n.strip()]
        missing = {h: [n for n in wanted if n not in i] for h, i in per_host.items()}
        missing = {h: m for h, m in missing.items() if m}
        if missing:
            return Check("all", "network", False,
                         "--network-interfaces " + requested + " is missing on " + ", ".join(
                             f"{h} ({', '.join(m)})" for h, m in missing.items()),
                         f"pass interfaces every host has ({listing})")
        return Check("all", "network", True, f"{requested} on every host")
    if not shared:
        return Check("all", "network", False, f"no up IPv4 interface is on every host ({listing})",
                     "connect the hosts on one network, or pass --network-interfaces with the "
                     "interface each host uses to reach the others")
    names = ", ".join(sorted(shared))
    if len(shared) > 1:
        return Check("all", "network", True, f"shared: {names}; horovodrun tries them all, "
                     "pass --network-interfaces to choose one if the job hangs at start")
    return Check("all", "network", True, f"shared: {names}")


def allreduce_job(np_: int, hostfile: Hostfile, out: str, *, ssh_port: int | None = None,
                  ssh_identity_file: str | None = None,
                  network_interfaces: str | None = None) -> tuple[list[str], dict]:
    """The horovodrun command of check 4: ``python -m hvdtrain.launch.preflight allreduce --out F`` on
    ``np_`` slots, with the launch's ssh and network options."""
    return horovodrun_argv(np_, hostfile, [sys.executable, "-m", "hvdtrain.launch.preflight",
                                           "allreduce", "--out", out],
                           ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
                           network_interfaces=network_interfaces, env=dict(os.environ))


def job_failure(output: str) -> str:
    """A failed job's output in one line: its first Open MPI help message (the text between the
    first two lines of dashes, e.g. "ORTE does not know how to route a message to the specified
    daemon located on the indicated node: my node: a target node: b ..."), else its last 3
    lines, joined with " | "."""
    lines = [line.strip() for line in output.splitlines()]
    rules = [i for i, line in enumerate(lines) if len(line) >= 20 and set(line) == {"-"}]
    if len(rules) >= 2 and any(lines[rules[0] + 1:rules[1]]):
        return " ".join(" ".join(lines[rules[0] + 1:rules[1]]).split())[:400]
    return " | ".join([line for line in lines if line][-3:])


def run_allreduce(np_: int, hostfile: Hostfile, *, timeout_s: float = 120.0,
                  ssh_port: int | None = None, ssh_identity_file: str | None = None,
                  network_interfaces: str | None = None) -> Check:
    """Check 4: a 1-float all-reduce of every rank's ``rank + 1`` over ``np_`` slots under
    ``timeout_s`` seconds; passes when rank 0's file says ``np_ (np_ + 1) / 2``."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-preflight-") as tmp:
        out = str(Path(tmp) / "allreduce.json")
        try:
            argv, env = allreduce_job(np_, hostfile, out, ssh_port=ssh_port,
                                      ssh_identity_file=ssh_identity_file,
                                      network_interfaces=network_interfaces)
        except HostfileError as exc:  # an IPv6 address: horovodrun cannot take it
            return Check("all", "allreduce", False, f"not tried: {exc}",
                         "name the host (e.g. in /etc/hosts) and write the name in the hostfile")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # horovodrun and what it started here
            proc.communicate()
            return Check("all", "allreduce", False,
                         f"no result within {timeout_s:.0f} s: the ranks hang at start, the "
                         "classic multi-host hang", "pass --network-interfaces with an interface"
                         " every host shares (see the network check), open the hosts' TCP "
                         "ports to each other (firewall), and check the versions above")
        seconds = time.monotonic() - started
        result = _read_result(out, hostfile, ssh_port, ssh_identity_file)
    expected = np_ * (np_ + 1) / 2
    if result is None or proc.returncode != 0:
        return Check("all", "allreduce", False, f"the job failed (exit {proc.returncode}): "
                     + job_failure(stderr or stdout), "run the command printed by 'hvdtrain "
                     "launch --dry-run' by hand to see the whole error")
    if result["sum"] != expected or result["size"] != np_:
        return Check("all", "allreduce", False, f"wrong result {result} (expected size {np_}, "
                     f"sum {expected})", "the hosts disagree: check the versions")
    return Check("all", "allreduce", True, f"{np_} ranks on {result['hosts']} host(s) summed "
                 f"correctly in {seconds:.1f} s (start included)")


def _read_result(out: str, hostfile: Hostfile, port, identity) -> dict | None:
    """Rank 0's file: here when rank 0 ran here, else read (and removed) on the first host, where
    rank 0 runs, over ssh. None when it cannot be read."""
    try:
        if os.path.exists(out):
            return json.loads(Path(out).read_text())
        first = hostfile.hosts[0].name
        proc = subprocess.run(ssh_argv(first, ["cat", out], port, identity),
                              capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 10,
                              stdin=subprocess.DEVNULL)
        subprocess.run(ssh_argv(first, ["rm", "-rf", str(Path(out).parent)], port, identity),
                       capture_output=True, timeout=SSH_TIMEOUT_S + 10, stdin=subprocess.DEVNULL)
        return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def run_checks(hostfile: Hostfile, np_: int, *, ssh_port: int | None = None,
               ssh_identity_file: str | None = None, network_interfaces: str | None = None,
               timeout_s: float = 120.0) -> list[Check]:
    """All the checks, stopping before the all-reduce when an earlier one failed (it would only
    hang). Never raises for a host's failure: each becomes a failed :class:`Check`."""
    here = probe()
    checks: list[Check] = []
    facts = {}
    for host in hostfile.hosts:
        if is_this_host(host.name):
            checks.append(Check(host.name, "ssh", True, "this machine (no ssh)"))
            facts[host.name] = here
            continue
        probe_cmd = [here["python"], "-m", "hvdtrain.launch.preflight", "probe"]
        try:
            proc = subprocess.run(ssh_argv(host.name, probe_cmd, ssh_port, ssh_identity_file),
                                  capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 30,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            checks.append(Check(host.name, "ssh", False, "ssh did not finish in "
                                f"{SSH_TIMEOUT_S + 30} s", "check the host is up and reachable"))
            continue
        if proc.returncode == 255:  # ssh's own failure (the remote command's codes are others)
            checks.append(diagnose_ssh(host.name, proc.returncode, proc.stderr, ssh_port))
            continue
        checks.append(Check(host.name, "ssh", True, "batch-mode ssh works"))
        if proc.returncode != 0:
            checks.append(Check(host.name, "versions", False,
                                f"{here['python']} -m hvdtrain.launch.preflight failed there: "
                                + (proc.stderr.strip().splitlines() or ["no output"])[-1],
                                "install the project at the same path on every host (the "
                                "launchers start the same command everywhere)"))
            continue
        try:  # the last line: a shell start-up file may print before it
            facts[host.name] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            checks.append(Check(host.name, "versions", False, "the probe's output is not JSON: "
                                f"{proc.stdout.strip()[-200:]!r}", "make the remote shell's "
                                "start-up files print nothing for non-interactive sessions"))
    for host, there in facts.items():
        if there is not here:
            checks.append(compare_versions(host, here, there))
    if len(facts) == len(hostfile.hosts):
        checks.append(common_interfaces({h: f["interfaces"] for h, f in facts.items()},
                                        network_interfaces,
                                        all(f is here for f in facts.values())))
    if all(c.ok for c in checks):
        checks.append(run_allreduce(np_, hostfile, timeout_s=timeout_s, ssh_port=ssh_port,
                                    ssh_identity_file=ssh_identity_file,
                                    network_interfaces=network_interfaces))
    else:
        checks.append(Check("all", "allreduce", False, "not tried: fix the problems above "
                            "first (the job would hang or fail)", "see above"))
    return checks


def format_checks(checks: list[Check]) -> str:
    """One line per check: ``ok``/``FAIL``, host, check, what was found, and the fix."""
    lines = []
    for c in checks:
        line = f"{'ok  ' if c.ok else 'FAIL'} {c.host:<16} {c.name:<10} {c.detail}"
        if not c.ok and c.fix:
            line += f"\n{'':<33}fix: {c.fix}"
        lines.append(line)
    return "\n".join(lines)


def _allreduce_main(out: str) -> int:
    """The all-reduce job: rank 0 writes ``{"size", "sum", "hosts"}`` to ``out``."""
    import horovod.torch as hvd
    import torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0], dtype=torch.float64), op=hvd.Sum,
                          name="hvdtrain.launch.preflight")
    hosts = hvd.allreduce(torch.tensor([float(hvd.local_rank() == 0)]), op=hvd.Sum,
                          name="hvdtrain.launch.preflight.hosts")
    if hvd.rank() == 0:  # on the first host, which may not be the one that launched
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"size": hvd.size(), "sum": float(total[0]),
                                         "hosts": int(hosts[0])}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hvdtrain.launch.preflight probe`` | ``allreduce --out F``."""
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.launch.preflight")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("probe", help="print this host's facts as JSON")
    job = sub.add_parser("allreduce", help="the pre-flight all-reduce (run under horovodrun)")
    job.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.what == "probe":
        print(json.dumps(probe()))
        return 0
    return _allreduce_main(args.out)


if __name__ == "__main__":
    sys.exit(main())
