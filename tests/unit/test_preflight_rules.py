"""The pre-flight's diagnosis of ssh failures, its version comparison and its network interface
rule (the real runs against test hosts are in tests/parallel/test_preflight.py)."""
import pytest

from hvdtrain.launch import preflight


@pytest.mark.parametrize("stderr,cause,fix", [
    ("Host key verification failed.\r\n", "the host key of [n1]:2222 is not in known_hosts",
     "ssh-keyscan -p 2222 n1 >> ~/.ssh/known_hosts"),
    ("root@n1: Permission denied (publickey,password).", "no key of yours is accepted",
     "ssh-copy-id -p 2222 n1"),
    ("ssh: connect to host n1 port 2222: Connection refused", "nothing listens for ssh on "
     "[n1]:2222", "--ssh-port"),
    ("ssh: connect to host n1 port 2222: Connection timed out", "no answer from [n1]:2222",
     "firewall"),
    ("ssh: Could not resolve hostname n1: Name or service not known", "not a known host name",
     "fix the hostfile"),
    ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.",
     "the host's key changed", "ssh-keygen -R '[n1]:2222'"),
])
def test_ssh_failures_are_named_with_their_fix(stderr, cause, fix):
    check = preflight.diagnose_ssh("n1", 255, stderr, port=2222)
    assert not check.ok and check.host == "n1" and check.name == "ssh"
    assert cause in check.detail and fix in check.fix


def test_ssh_success_and_unknown_failure():
    assert preflight.diagnose_ssh("n1", 0, "").ok
    check = preflight.diagnose_ssh("n1", 255, "kex_exchange_identification: read: reset")
    assert not check.ok and "kex_exchange_identification" in check.detail


ORTE_NO_PATH = """[vm:01234] [[31261,0],0] UNABLE TO SEND MESSAGE TO [[31261,0],2] TAG 15
--------------------------------------------------------------------------
ORTE does not know how to route a message to the specified daemon
located on the indicated node:

  my node:   vm
  target node:  127.0.0.3

This is usually an internal programming error that should be
reported to the developers. In the meantime, a workaround may
be to set the MCA param routed=direct on the command line or
in your environment. We apologize for the problem.
--------------------------------------------------------------------------
[vm:01234] 1 more process has sent help message help-errmgr-base.txt / no-path
"""


def test_a_failed_jobs_open_mpi_message_is_kept_whole_in_one_line():
    """The all-reduce check's detail: Open MPI's first help message (it named only the last
    three lines, "be to set the MCA param routed=direct ... We apologize for the problem.", when
    this was seen once on a fresh machine); a plain failure keeps its last three lines."""
    line = preflight.job_failure(ORTE_NO_PATH)
    assert line.startswith("ORTE does not know how to route a message to the specified daemon "
                           "located on the indicated node: my node: vm target node: 127.0.0.3 ")
    assert line.endswith("We apologize for the problem.") and "\n" not in line
    assert preflight.job_failure("a\nb\n\nc\nTraceback: d\n") == "b | c | Traceback: d"


HERE = {"python_version": "3.11.7", "versions": {"torch": "2.13.0", "horovod": "0.28.1"}}


def test_version_comparison_names_every_difference():
    same = preflight.compare_versions("n2", HERE, HERE)
    assert same.ok and "torch 2.13.0" in same.detail
    other = {"python_version": "3.11.2", "versions": {"torch": "2.12.0", "horovod": None}}
    check = preflight.compare_versions("n2", HERE, other)
    assert not check.ok
    assert check.detail == ("different: Python 3.11.2 (here 3.11.7), torch 2.12.0 (here 2.13.0),"
                            " horovod missing (here 0.28.1)")


def test_network_interfaces():
    hosts = {"a": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"], "ib0": ["10.1.0.1"]},
             "b": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}}
    assert preflight.common_interfaces(hosts).detail == "shared: eth0"
    apart = {"a": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"]},
             "b": {"lo": ["127.0.0.1"], "ens5": ["10.0.0.2"]}}
    check = preflight.common_interfaces(apart)  # the loopback does not connect two machines
    assert not check.ok and "a: eth0, lo; b: ens5, lo" in check.detail
    assert "--network-interfaces" in check.fix
    check = preflight.common_interfaces(hosts, requested="ib0")
    assert not check.ok and "missing on b (ib0)" in check.detail
    assert preflight.common_interfaces(hosts, requested="eth0").ok
    assert preflight.common_interfaces({"localhost": {"lo": ["127.0.0.1"]}}, all_local=True).ok
