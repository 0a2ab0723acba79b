"""hvdtrain.launch: one plan for every launcher and mode (elastic gets the same Horovod settings,
and options it cannot honour are refused), and the rank processes a signal is handed to."""
import os
import signal
import subprocess
import sys
import time

import pytest

from hvdtrain.launch import procfs, sigmask, signals
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


def test_session_and_group_members_leave_out_zombies_and_other_sessions(tmp_path):
    for pid, state, pgrp, sid in [(20, "S", 20, 20), (21, "S", 21, 20), (22, "Z", 22, 20),
                                  (23, "R", 23, 23), (24, "S", 20, 20)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b) c) {state} 1 {pgrp} {sid} 0 -1\n")
    (tmp_path / "self").mkdir()
    assert sorted(procfs.session_members(20, tmp_path)) == [20, 21, 24]
    assert sorted(procfs.group_members(20, tmp_path)) == [20, 24]
    assert procfs.session_members(99, tmp_path) == []


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
        wait_for(tmp_path / "ready", proc)
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


def test_an_inherited_rank_variable_marks_no_rank(tmp_path):
    # An sbatch shell's SLURM_PROCID=0 reaches everything the launch starts: horovodrun's
    # per-rank supervisors and the ranks' helpers carried it and were taken for ranks.
    slurm = {"SLURM_PROCID": "0"}
    mark = {signals.LAUNCH_ID_VAR: "abc", **slurm}
    _fake_proc(tmp_path, 20, "python3", 1, mark)  # a supervisor: only the inherited variable
    _fake_proc(tmp_path, 21, "hvdtrain", 20, {**mark, "HOROVOD_RANK": "0"})  # rank 0
    _fake_proc(tmp_path, 22, "python3", 1, mark)
    _fake_proc(tmp_path, 23, "hvdtrain", 22, {**mark, "HOROVOD_RANK": "1"})  # rank 1
    assert signals.rank_pids("abc", tmp_path) == [20, 22]  # what the old rule found
    inherited = signals.inherited_rank_vars({"PATH": "/bin", **slurm})
    assert inherited == slurm
    assert signals.rank_pids("abc", tmp_path, inherited) == [21, 23]


def test_each_launch_gets_its_own_id_never_an_inherited_one(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    inherited = {"PATH": "/usr/bin", signals.LAUNCH_ID_VAR: "f" * 32}
    p = plan(launch_args(hostfile=str(hosts)), env=inherited, gpus=0)
    assert p.env[signals.LAUNCH_ID_VAR] != "f" * 32
    runner = signals.RankSignals(["true"], {"PATH": "/usr/bin", signals.LAUNCH_ID_VAR: "f" * 32},
                                 "horovodrun", inherited_from=inherited)
    assert runner.launch_id != "f" * 32 and runner.env[signals.LAUNCH_ID_VAR] == runner.launch_id


def wait_for(path, proc, timeout=120.0):
    """Until file ``path`` exists (the event a child process writes), while ``proc`` runs.

    Raises:
        AssertionError: ``proc`` exited first, or ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the child exited with {proc.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout:.0f} s"
        time.sleep(0.01)


def _rank_that_catches_late(tmp_path):
    """A rank of launch 'h'*32 that writes ``started`` once running and installs its SIGUSR1
    handler only when ``go`` appears (as hvdtrain train does seconds after Python's start-up);
    the handler writes 'usr1' to ``got``. The rank then lives until ``release`` appears, so
    that its ``SigCgt`` can be read after the signal; it exits 0. Files in ``tmp_path``; each
    wait gives up after 120 s (exit 1)."""
    code = ("import pathlib, signal, sys, time\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "def wait(name):\n"
            "    deadline = time.monotonic() + 120\n"
            "    while not (d / name).exists():\n"
            "        if time.monotonic() > deadline:\n"
            "            sys.exit(f'no {name} within 120 s')\n"
            "        time.sleep(0.01)\n"
            "(d / 'started').write_text('')\n"
            "wait('go')\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (d / 'got').write_text('usr1'))\n"
            "wait('got')\n"
            "wait('release')\n")
    env = {**os.environ, signals.LAUNCH_ID_VAR: "h" * 32, "HOROVOD_RANK": "0"}
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def test_a_signal_is_held_until_the_rank_catches_it(tmp_path, monkeypatch):
    proc = _rank_that_catches_late(tmp_path)
    try:
        wait_for(tmp_path / "started", proc)
        assert signals.catches(proc.pid, signal.SIGUSR1) is False
        # The rank installs its handler only once signal_local_ranks has found it not catching
        # the signal: the order is fixed, whatever the machine's load.
        seen, real = [], signals.catches

        def catches(pid, sig, proc_root="/proc"):
            seen.append(real(pid, sig, proc_root))
            if seen[-1] is False:
                (tmp_path / "go").touch()
            return seen[-1]

        monkeypatch.setattr(signals, "catches", catches)
        assert signals.signal_local_ranks(signal.SIGUSR1, "h" * 32, hold_s=60) == 1
        monkeypatch.undo()
        assert seen[0] is False and seen[-1] is True  # held while the rank did not catch it
        assert signals.catches(proc.pid, signal.SIGUSR1) is True  # alive until 'release'
        wait_for(tmp_path / "got", proc)
        (tmp_path / "release").touch()
        assert proc.wait(timeout=60) == 0 and (tmp_path / "got").read_text() == "usr1"
    finally:
        if proc.poll() is None:
            proc.kill()
    # Without the hold the default action ends the rank and the request is lost.
    again = tmp_path / "again"
    again.mkdir()
    proc = _rank_that_catches_late(again)
    try:
        wait_for(again / "started", proc)
        assert signals.signal_local_ranks(signal.SIGUSR1, "h" * 32) == 1
        assert proc.wait(timeout=60) == -signal.SIGUSR1 and not (again / "got").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_rank_that_never_catches_it_gets_it_after_the_hold(tmp_path):
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", "import pathlib, signal, sys\n"
                             "pathlib.Path(sys.argv[1]).touch()\nsignal.pause()\n",
                             str(started)],
                            env={**os.environ, signals.LAUNCH_ID_VAR: "n" * 32,
                                 "HOROVOD_RANK": "0"})
    try:
        wait_for(started, proc)
        began = time.monotonic()
        assert signals.signal_local_ranks(signal.SIGTERM, "n" * 32, hold_s=1.0) == 1
        # Held 1 s (the behaviour); the bound above only catches a hold that never ends, with
        # room for a loaded machine (each round reads every process's /proc entry).
        assert 0.9 < time.monotonic() - began < 30
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()


def test_without_hostfile_the_launch_runs_on_this_host_and_takes_h(tmp_path):
    p = plan(launch_args(np=2, hostfile=None), env={"PATH": "/usr/bin"}, gpus=0)
    assert p.argv[:5] == ["horovodrun", "-np", "2", "-H", "localhost:2"]
    assert any("on this host" in note for note in p.notes)
    p = plan(launch_args(np=3, hostfile=None, hosts_spec="node1:2,node2", launcher="mpirun"),
             env={"PATH": "/usr/bin"}, gpus=0)
    assert p.argv[p.argv.index("-H") + 1] == "node1:2,node2:1" and p.host_names() == [
        "node1", "node2"]
    with pytest.raises(PlanError, match="-np is required without --hostfile or -H"):
        plan(launch_args(np=None, hostfile=None), env={}, gpus=0)
    # -H's own syntax in the fix, not the hostfile's slots=N
    with pytest.raises(PlanError, match=r"-H 'node1:x' host 1: ':x' is not a whole number of "
                                        r"slots; write e.g. -H node1:2,node2:2$"):
        plan(launch_args(np=1, hostfile=None, hosts_spec="node1:x"), env={}, gpus=0)
    with pytest.raises(PlanError, match=r"-H 'a:1,b:0' host 2: ':0': a host needs at least 1 "
                                        r"slot$"):
        plan(launch_args(np=1, hostfile=None, hosts_spec="a:1,b:0"), env={}, gpus=0)
    with pytest.raises(PlanError, match="-np 4 is more than the 3 slots"):
        plan(launch_args(np=4, hostfile=None, hosts_spec="node1:2,node2"), env={}, gpus=0)
    # -H's words, not the hostfile's ("already on line 1", "write '::1:2 slots=N'")
    with pytest.raises(PlanError, match=r"-H 'a:2,a:1' host 2: host 'a' is already host 1; name "
                                        r"it once with the total slots$"):
        plan(launch_args(np=1, hostfile=None, hosts_spec="a:2,a:1"), env={}, gpus=0)
    for spec, host in (("::1:2", "1: '::1:2'"), ("node1:1,[fe80::1]:2", "2: '\\[fe80::1\\]:2'")):
        with pytest.raises(PlanError, match=f"host {host} looks like an IPv6 address, which -H "
                                            "cannot carry"):
            plan(launch_args(np=1, hostfile=None, hosts_spec=spec), env={}, gpus=0)


def test_an_ipv6_address_in_a_hostfile_is_refused_before_horovodrun_splits_it(tmp_path):
    """horovodrun turns hostfile lines into host:slots and splits at ':' ('::1 slots=2' became
    host '', slots ':1:2'); mpirun gets the hostfile as it is (Open MPI reads it itself)."""
    from hvdtrain.launch import preflight
    from hvdtrain.launch.hostfile import read_hostfile
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=1\nfe80::1 slots=2\n")
    with pytest.raises(PlanError, match=f"^hostfile {hosts} line 2: 'fe80::1' is an IPv6 address, "
                                        "which horovodrun cannot take .*give the host a name"):
        plan(launch_args(np=3, hostfile=str(hosts)), env={}, gpus=0)
    p = plan(launch_args(np=3, hostfile=str(hosts), launcher="mpirun"), env={}, gpus=0)
    assert p.argv[0] == "mpirun" and str(hosts) in p.argv
    check = preflight.run_allreduce(3, read_hostfile(hosts))  # doctor: refused, nothing started
    assert not check.ok and check.detail.startswith(f"not tried: hostfile {hosts} line 2: ")
    assert "/etc/hosts" in check.fix


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun", "srun"])
def test_yield_off_is_what_the_ranks_get_and_their_record_says_who(launcher):
    from hvdtrain.launch import tuning
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2",
             "SLURM_NTASKS": "2"}
    env = {"PATH": "/usr/bin", "OMPI_MCA_mpi_yield_when_idle": "1", **slurm}
    p = plan(launch_args(np=2, hostfile=None, launcher=launcher, yield_when_idle="off"),
             env=env, gpus=0)
    assert p.env["OMPI_MCA_mpi_yield_when_idle"] == "0"
    rank_env = dict(p.env)  # what a rank inherits
    record = tuning.rank_settings(on_gpu=False, size=2, env=rank_env, can_wake=True)
    setting = record["OMPI_MCA_mpi_yield_when_idle"]
    assert setting["value"] == "0" and setting["by"] == "hvdtrain launch"
    assert "--yield-when-idle off" in setting["why"]
    assert rank_env["OMPI_MCA_mpi_yield_when_idle"] == "0"  # the rank did not turn it on
    # A user's own variable, no launch: the rank's rule applies, and says so.
    own = tuning.rank_settings(on_gpu=False, size=2, env={}, can_wake=True)
    assert own["OMPI_MCA_mpi_yield_when_idle"]["by"] == "hvdtrain"


@pytest.mark.parametrize("launch,blocked", [
    (["mpirun", "-np", "2"], True), (["horovodrun", "-np", "2"], True),
    (["horovodrun", "--gloo", "-np", "2"], False), (["srun", "-n", "2"], False)])
def test_mpirun_never_acts_on_sigterm_and_its_ranks_do(tmp_path, launch, blocked):
    # scancel signals every process of the job, mpirun included; mpirun hands SIGTERM to the
    # ranks and SIGKILLs them 1 s later (odls_base_sigkill_timeout; a longer one also delays the
    # end of a job whose rank failed, by twice its value). Started with SIGTERM blocked, mpirun
    # never acts on it; Open MPI unblocks every signal in the ranks it starts.
    runner = signals.RankSignals(launch, {}, launch[0])
    assert runner.blocks_sigterm == blocked


@pytest.mark.parametrize("argv,env,built,mpirun", [
    (["horovodrun", "-np", "2"], {}, True, True),
    (["horovodrun", "-np", "2"], {}, None, True),  # unknown build: as before, MPI
    # #48: a Horovod built without MPI falls back to its Gloo launcher, which hands the blocked
    # mask on to the ranks, where a command other than hvdtrain train never sees SIGTERM.
    (["horovodrun", "-np", "2"], {}, False, False),
    (["horovodrun", "--mpi", "-np", "2"], {}, False, True),
    (["horovodrun", "--jsrun", "-np", "2"], {}, True, False),
    (["horovodrun", "-np", "2", "--host-discovery-script", "d"], {}, True, False),
    (["horovodrun", "-np", "2"], {"LSB_JOBID": "7", "PATH": "JSRUN"}, True, False),  # LSF: jsrun
    (["horovodrun", "-np", "2"], {"LSB_JOBID": "7", "PATH": "/nonexistent"}, True, True)])
def test_sigterm_is_blocked_only_where_horovodrun_runs_mpirun(tmp_path, argv, env, built, mpirun):
    if env.get("PATH") == "JSRUN":
        jsrun = tmp_path / "jsrun"
        jsrun.write_text("#!/bin/sh\n")
        jsrun.chmod(0o755)
        env = {**env, "PATH": str(tmp_path)}
    assert sigmask.horovodrun_runs_mpirun(argv, env, built_with_mpi=built) is mpirun


def test_the_build_is_read_from_horovods_extension_files(tmp_path, monkeypatch):
    """hvdtrain.launch.sigmask.horovod_built_with_mpi reads the extensions' files: this
    environment's Horovod (built with MPI by setup.sh) says yes; a stand-in package whose
    extension links no libmpi says no; none at all is unknown."""
    assert sigmask.horovod_built_with_mpi() is True
    fake = tmp_path / "site" / "horovod"
    (fake / "torch").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so").write_bytes(
        b"\x7fELF" + b"libgloo.so\0libc.so.6\0" * 100)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    assert sigmask.horovod_built_with_mpi() is False
    (fake / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so").unlink()
    assert sigmask.horovod_built_with_mpi() is None


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_a_launcher_with_sigterm_blocked_lets_its_ranks_finish(tmp_path, launcher):
    rank = tmp_path / "rank.py"
    rank.write_text("import signal, sys, time\n"
                    "def term(*_):\n    time.sleep(2)\n    sys.exit(75)\n"
                    "signal.signal(signal.SIGTERM, term)\n"
                    f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
                    "signal.pause()\n")  # until the signal; the handler exits
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\n")
    launch = plan(launch_args(hostfile=str(hosts), launcher=launcher,
                              command=["--", sys.executable, str(rank)]),
                  env={**os.environ}, gpus=0)
    runner = signals.RankSignals(launch.argv, launch.env, launcher)
    proc = runner.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        # mpirun itself, or the one horovodrun runs through /bin/sh -c (which clears a blocked
        # mask it inherits: before #48's fix this mpirun had SIGTERM unblocked).
        import psutil
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        mpirun = [p.pid for p in job if p.name() == "mpirun"]
        assert len(mpirun) == 1, [(p.pid, p.name()) for p in job]
        status = open(f"/proc/{mpirun[0]}/status").read()
        assert int(status.split("SigBlk:")[1].split()[0], 16) >> (signal.SIGTERM - 1) & 1
        ranks = signals.rank_pids(runner.launch_id)
        assert len(ranks) == 1
        for pid in [p.pid for p in job]:  # as scancel does: every process of the job
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 75  # the rank's own status: its 2 s handler finished
    finally:  # the launcher's session: mpirun and a rank left by a failed assertion too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_a_signal_before_the_run_starts_is_kept_for_its_first_step():
    from hvdtrain.run import preempt
    before = signal.getsignal(signal.SIGTERM)
    early = preempt.install_early()
    try:
        assert preempt.install_early() is early
        os.kill(os.getpid(), signal.SIGTERM)  # while the framework imports
        deadline = time.monotonic() + 60  # Python runs the handler in the main thread, soon
        while signal.SIGTERM not in early.seen:
            assert time.monotonic() < deadline, "the early handler never ran"
            time.sleep(0.001)
        signals_ = preempt.taken()
        assert signals_ is early and signals_.flags() == [1.0, 0.0]
        signals_.__exit__()
        assert signal.getsignal(signal.SIGTERM) == before
        fresh = preempt.taken()
        assert fresh is not early and fresh.flags() == [0.0, 0.0]
        fresh.__exit__()
    finally:
        signal.signal(signal.SIGTERM, before)
