"""Slurm: host-list and tasks-per-node parsing, the allocation as hosts, the srun command line,
rank detection under srun, and `hvdtrain launch` inside an allocation (dry run).

The real cluster runs (srun, sbatch, salloc, preemption) are in tests/slurm/."""
import shlex

import pytest

from hvdtrain import runtime
from hvdtrain.launch import slurm
from hvdtrain.launch.hostfile import HostfileError


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("node-a.example.org", ["node-a.example.org"]),
    ("c[1,3],d5,e[10-11]", ["c1", "c3", "d5", "e10", "e11"]),
    ("node1, node2", ["node1", "node2"]),
    ("a[1-2]-b", ["a1-b", "a2-b"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,message", [
    ("", "empty Slurm node list"),
    ("node[01-03", "unbalanced brackets"),
    ("node[3-1]", "range '3-1' runs backwards"),
    ("node[a-b]", "'a-b' is not a number or a range lo-hi"),
    ("a,,b", "has an empty entry"),
    ("x[1,[2-3]]", "nested brackets"),
])
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(ValueError, match=message):
        slurm.expand_nodelist(nodelist)


@pytest.mark.parametrize("tasks,counts", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2", [1, 2]), ("3(x2)", [3, 3]),
])
def test_expand_tasks_per_node(tasks, counts):
    assert slurm.expand_tasks_per_node(tasks) == counts


@pytest.mark.parametrize("tasks", ["", "2(3)", "0", "x", "2(x0)"])
def test_expand_tasks_per_node_errors(tasks):
    with pytest.raises(ValueError, match="is not N or N\\(xR\\)"):
        slurm.expand_tasks_per_node(tasks)


ALLOC = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[01-03,07]",
         "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7"}


def test_allocation_hosts_and_np():
    hosts = slurm.allocation_hosts(ALLOC)
    assert hosts.as_h() == "node01:2,node02:2,node03:2,node07:1"
    assert hosts.slots == 7 and hosts.virtual and hosts.path == "slurm-job-77"
    assert slurm.allocation_np(ALLOC, hosts) == 7
    no_tasks = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "a1,b[2-3]",
                "SLURM_NTASKS_PER_NODE": "4"}
    hosts = slurm.allocation_hosts(no_tasks)
    assert hosts.as_h() == "a1:4,b2:4,b3:4" and slurm.allocation_np(no_tasks, hosts) == 12


@pytest.mark.parametrize("env,message", [
    ({}, "not inside a Slurm allocation"),
    ({"SLURM_JOB_ID": "9"}, "SLURM_JOB_NODELIST is not set"),
    ({**ALLOC, "SLURM_TASKS_PER_NODE": "2(x3)"}, "4 hosts in SLURM_JOB_NODELIST=node\\[01-03,07\\]"
                                                 " but 3 entries"),
    ({**ALLOC, "SLURM_JOB_NODELIST": "node[1-"}, "Slurm job 77: Slurm node list 'node\\[1-' has "
                                                 "unbalanced brackets; pass --hostfile"),
])
def test_allocation_hosts_errors(env, message):
    with pytest.raises(HostfileError, match=message):
        slurm.allocation_hosts(env)


def test_parse_mpi_list_both_formats():
    slurm_22 = ("MPI plugin types are...\n\tnone\n\tcray_shasta\n\tpmi2\n\tpmix\n"
                "specific pmix plugin versions available: pmix_v4\n")
    assert slurm.parse_mpi_list(slurm_22) == ["none", "cray_shasta", "pmi2", "pmix"]
    assert slurm.parse_mpi_list("srun: MPI types are...\nsrun: none\nsrun: pmi2\n") == \
        ["none", "pmi2"]
    assert slurm.parse_mpi_list("MPI plugin types are...\nnone,pmi2,pmix\n") == \
        ["none", "pmi2", "pmix"]


def test_srun_argv_moves_mca_and_knobs_into_the_environment():
    argv, env = slurm.srun_argv(4, ["hvdtrain", "train"], env={"PATH": "/bin"},
                                mca={"mpi_yield_when_idle": "1"},
                                knobs={"HOROVOD_CYCLE_TIME": "2.0"})
    assert argv == ["srun", "--mpi=pmix", "-n", "4", "--cpu-bind=none", "--kill-on-bad-exit=1",
                    "hvdtrain", "train"]
    assert env == {"PATH": "/bin", "HOROVOD_CYCLE_TIME": "2.0", "OMPI_MCA_pml": "ob1",
                   "OMPI_MCA_btl": "^openib", "OMPI_MCA_mpi_yield_when_idle": "1"}
    with pytest.raises(ValueError, match="no command"):
        slurm.srun_argv(2, [])


SRUN_TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1", "PMIX_RANK": "3"}
LAUNCHER_VARS = [n for names in (runtime._RANK_VARS, runtime._SIZE_VARS, runtime._LOCAL_RANK_VARS,
                                 runtime._LOCAL_SIZE_VARS) for n in names] + \
    ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"]


@pytest.fixture
def clean_launcher_env(monkeypatch):
    for name in LAUNCHER_VARS + ["SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_rank_detection_under_srun(clean_launcher_env):
    for name, value in SRUN_TASK.items():
        clean_launcher_env.setenv(name, value)
    assert (runtime.launcher_rank(), runtime.launcher_size(), runtime.launcher_local_rank(),
            runtime.launcher_local_size()) == (3, 4, 1, 2)
    clean_launcher_env.delenv("PMIX_RANK")
    assert runtime.launcher_rank() == 3  # SLURM_PROCID alone


def test_horovodrun_in_a_batch_script_wins_over_the_batch_shells_slurm_vars(clean_launcher_env):
    # sbatch's shell has SLURM_PROCID=0; horovodrun's ranks inherit it and set their own.
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "HOROVOD_RANK": "2",
                        "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0",
                        "HOROVOD_LOCAL_SIZE": "2"}.items():
        clean_launcher_env.setenv(name, value)
    assert (runtime.launcher_rank(), runtime.launcher_size(), runtime.launcher_local_rank(),
            runtime.launcher_local_size()) == (2, 4, 0, 2)


def test_only_rank_0_prints_input_errors_under_srun(clean_launcher_env, capsys, tmp_path):
    from hvdtrain.cli import main
    for rank in ("0", "1"):
        clean_launcher_env.setenv("SLURM_PROCID", rank)
        assert main(["train", "--epochs", "0", "--output-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert ("--epochs must be a whole number >= 1" in err) == (rank == "0")


def test_mid_epoch_position_needs_the_same_data_order():
    from hvdtrain.run import preempt
    from hvdtrain.config import TrainConfig
    cfg = TrainConfig(batch_size=16, backward_passes_per_step=2)
    saved = cfg.to_dict()
    assert preempt.mid_epoch_mismatch(saved, 2, cfg, 2) is None
    assert preempt.mid_epoch_mismatch(saved, 2, cfg, 4) == \
        "it was made with 2 ranks and this run has 4"
    other = TrainConfig(batch_size=32, backward_passes_per_step=2, seed=7)
    assert preempt.mid_epoch_mismatch(saved, 2, other, 2) == (
        "options that fix the data order changed: --seed 42 -> 7, --batch-size 16 -> 32")


def test_slurm_hosts_warning():
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NUM_NODES": "3"}
    message = runtime.slurm_hosts_warning(1, env)
    assert message.startswith("this job runs on 1 host(s) of Slurm job 12's 3 nodes")
    assert runtime.slurm_hosts_warning(3, env) is None
    assert runtime.slurm_hosts_warning(1, {"SLURM_JOB_NUM_NODES": "3"}) is None


def dry_launch(capsys, *args):
    from hvdtrain.cli import main
    rc = main(["launch", "--dry-run", *args, "--", "hvdtrain", "train"])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def allocation(clean_launcher_env, tmp_path):
    """A CPU host (no nvidia-smi, no srun on PATH) inside a 4-node allocation."""
    clean_launcher_env.setenv("PATH", str(tmp_path))
    clean_launcher_env.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    for name, value in ALLOC.items():
        clean_launcher_env.setenv(name, value)
    return clean_launcher_env


def test_launch_in_an_allocation_needs_no_hostfile_or_np(capsys, allocation):
    rc, out, err = dry_launch(capsys)
    assert rc == 0 and shlex.split(out)[:5] == ["horovodrun", "-np", "7", "-H",
                                                "node01:2,node02:2,node03:2,node07:1"]
    assert "hvdtrain: hosts from slurm-job-77: node01:2,node02:2,node03:2,node07:1" in err
    rc, out, err = dry_launch(capsys, "--launcher", "mpirun", "-np", "3")
    argv = shlex.split(out)
    assert rc == 0 and argv[argv.index("-np") + 1] == "3"
    assert argv[argv.index("-H") + 1] == "node01:2,node02:2,node03:2,node07:1"
    rc, out, err = dry_launch(capsys, "-np", "8")
    assert rc == 2 and "-np 8 is more than the 7 slots in hostfile slurm-job-77" in err


def test_launch_srun_dry_run_prints_the_exact_command_and_what_is_missing(capsys, allocation):
    rc, out, err = dry_launch(capsys, "--launcher", "srun")
    assert rc == 0
    assert shlex.split(out) == ["OMPI_MCA_btl=^openib", "OMPI_MCA_mpi_yield_when_idle=1",
                                "OMPI_MCA_pml=ob1", "srun", "--mpi=pmix", "-n", "7",
                                "--cpu-bind=none", "--kill-on-bad-exit=1", "hvdtrain", "train"]
    assert "hvdtrain: warning: srun not found on PATH" in err
    from hvdtrain.cli import main
    assert main(["launch", "--launcher", "srun", "--", "hvdtrain", "train"]) == 2
    assert "hvdtrain: error: srun not found on PATH" in capsys.readouterr().err


def test_launch_outside_an_allocation_runs_on_this_host(capsys, clean_launcher_env):
    rc, out, err = dry_launch(capsys, "-np", "2")  # as horovodrun -np 2 does
    assert rc == 0 and shlex.split(out)[:5] == ["horovodrun", "-np", "2", "-H", "localhost:2"]
    assert "no --hostfile, -H or Slurm allocation: 2 rank(s) on this host" in err
    rc, out, err = dry_launch(capsys)
    assert rc == 2 and "-np is required without --hostfile or -H" in err
    rc, out, err = dry_launch(capsys, "--launcher", "srun")
    assert rc == 2 and "-np is required with --launcher srun outside an allocation" in err


def test_srun_without_pmix_is_refused_with_what_to_install(tmp_path, allocation):
    srun = tmp_path / "srun"  # an srun whose --mpi=list lacks pmix (a Slurm built without it)
    srun.write_text("#!/bin/sh\necho 'MPI plugin types are...'\necho none\necho pmi2\n")
    srun.chmod(0o755)
    with pytest.raises(HostfileError, match="srun --mpi=list offers none, pmi2 but not pmix"):
        slurm.check_srun({"PATH": str(tmp_path)})
