"""Horovod's runtime settings that every rank's init() chooses before hvd.init()
(hvdtrain.launch.tuning.rank_settings): the CPU rule (with and without the Horovod patch that
wakes the background thread), the GPU rule, and the user's variables winning; and the OpenMP spin
``hvdtrain train`` sets before its framework loads (tuning.openmp_spin)."""
from hvdtrain.launch import tuning

CYCLE, FUSION, WAKE = "HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_WAKE"
YIELD = "OMPI_MCA_mpi_yield_when_idle"
MIB4 = str(4 * 2**20)


def test_this_horovod_build_can_wake_its_background_thread():
    # scripts/horovod_patches/08-cycle-wake.patch, checked on the Horovod setup.sh installed.
    assert tuning.horovod_can_wake() is True


def test_cpu_ranks_get_the_measured_rule_written_into_the_environment():
    env = {}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert env == {WAKE: "1", YIELD: "1", FUSION: MIB4}
    assert chosen[WAKE]["by"] == chosen[YIELD]["by"] == chosen[FUSION]["by"] == "hvdtrain"
    assert chosen[CYCLE]["value"] == "1" and chosen[CYCLE]["by"] == "default"
    assert "idle rank" in chosen[CYCLE]["why"] and "enqueued" in chosen[WAKE]["why"]
    assert chosen[FUSION]["value"] == "4194304" and "in place" in chosen[FUSION]["why"]
    assert "busy-polls" in chosen[YIELD]["why"]


def test_without_the_wake_patch_cpu_ranks_get_a_short_cycle_instead():
    env = {}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=False)
    assert env == {CYCLE: "0.1", YIELD: "1", FUSION: MIB4}
    assert chosen[CYCLE]["by"] == "hvdtrain" and "1 ms default" in chosen[CYCLE]["why"]
    assert chosen[WAKE] == {"value": "0", "by": "default",
                            "why": "this Horovod cannot wake its thread (no hvdtrain patch 08)"}


def test_gpu_ranks_keep_horovods_defaults():
    for can_wake in (True, False):
        env = {}
        chosen = tuning.rank_settings(on_gpu=True, size=2, env=env, can_wake=can_wake)
        assert env == {}
        assert {name: s["value"] for name, s in chosen.items()} == tuning.RANK_SETTING_DEFAULTS
        assert all(s["by"] == "default" for s in chosen.values())


def test_a_variable_the_user_set_always_wins():
    env = {CYCLE: "5", YIELD: "0", FUSION: "0", WAKE: "0"}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert env == {CYCLE: "5", YIELD: "0", FUSION: "0", WAKE: "0"}  # untouched
    assert [chosen[n]["value"] for n in (CYCLE, YIELD, FUSION, WAKE)] == ["5", "0", "0", "0"]
    assert all(s["by"] == "user" for s in chosen.values())
    # An empty variable counts as unset.
    env = {WAKE: " ", CYCLE: ""}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert chosen[WAKE]["by"] == "hvdtrain" and env[WAKE] == "1"
    env = {CYCLE: " "}
    assert tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=False)[CYCLE]["by"] == (
        "hvdtrain")
    assert env[CYCLE] == "0.1"


def test_the_header_line_names_each_setting_and_who_chose_it():
    line = tuning.describe_settings(tuning.rank_settings(on_gpu=False, size=2, env={CYCLE: "2"},
                                                         can_wake=True))
    assert line == (f"{CYCLE}=2 (user), {WAKE}=1 (hvdtrain), {FUSION}={MIB4} (hvdtrain), "
                    f"{YIELD}=1 (hvdtrain)")


def test_autotune_keeps_horovods_settings_for_its_search():
    env = {"HOROVOD_AUTOTUNE": "1"}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert CYCLE not in env and FUSION not in env and env[YIELD] == env[WAKE] == "1"
    assert chosen[CYCLE]["by"] == chosen[FUSION]["by"] == "autotune"
    assert chosen[WAKE]["by"] == "hvdtrain"  # not something the autotuner searches


def test_under_gloo_the_open_mpi_setting_is_marked_not_used():
    chosen = tuning.rank_settings(on_gpu=False, size=2, env={}, can_wake=True)
    assert tuning.settings_in_effect(chosen, mpi=True) == chosen
    gloo = tuning.settings_in_effect(chosen, mpi=False)
    assert gloo[YIELD]["by"] == "n/a" and "Gloo" in gloo[YIELD]["why"]
    assert gloo[CYCLE] == chosen[CYCLE] and gloo[WAKE] == chosen[WAKE]


def test_one_rank_keeps_the_default_cycle_and_the_size_comes_from_the_launcher(monkeypatch):
    env = {}
    chosen = tuning.rank_settings(on_gpu=False, size=1, env=env, can_wake=False)
    assert env == {YIELD: "1", FUSION: MIB4} and chosen[CYCLE]["by"] == "default"
    assert "one rank" in chosen[CYCLE]["why"]
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert tuning.rank_settings(on_gpu=False, env={}, can_wake=False)[CYCLE]["value"] == "0.1"
    # With the wake patch the cycle stays Horovod's with peers to negotiate with ...
    assert tuning.rank_settings(on_gpu=False, env={}, can_wake=True)[CYCLE]["value"] == "1"


def test_one_woken_rank_wakes_its_idle_thread_every_10_ms_unless_elastic_or_on_a_gpu():
    env = {}
    chosen = tuning.rank_settings(on_gpu=False, size=1, env=env, can_wake=True)
    assert env == {WAKE: "1", CYCLE: "10", YIELD: "1", FUSION: MIB4}
    assert chosen[CYCLE]["by"] == "hvdtrain" and "one rank" in chosen[CYCLE]["why"]
    # An elastic job may grow (its peers would wait up to a cycle), a GPU rank keeps the
    # defaults, and the user's cycle wins.
    elastic = {"HOROVOD_ELASTIC": "1"}
    assert tuning.rank_settings(on_gpu=False, size=1, env=elastic, can_wake=True)[CYCLE][
        "value"] == "1" and CYCLE not in elastic
    assert tuning.rank_settings(on_gpu=True, size=1, env={}, can_wake=True)[CYCLE]["value"] == "1"
    users = {CYCLE: "2"}
    assert tuning.rank_settings(on_gpu=False, size=1, env=users, can_wake=True)[CYCLE][
        "by"] == "user" and users[CYCLE] == "2"


def test_a_user_who_turns_the_wake_off_gets_the_short_cycle_and_a_true_record():
    env = {WAKE: "0"}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert env == {WAKE: "0", CYCLE: "0.1", YIELD: "1", FUSION: MIB4}
    assert chosen[CYCLE]["by"] == "hvdtrain" and chosen[WAKE]["by"] == "user"
    # Horovod reads its flags with strtol: "true" is 0, off; the record says so.
    env = {WAKE: "true"}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert env[CYCLE] == "0.1" and "reads 'true' as 0 (off)" in chosen[WAKE]["why"]
    env = {WAKE: "1"}
    chosen = tuning.rank_settings(on_gpu=False, size=2, env=env, can_wake=True)
    assert CYCLE not in env and chosen[WAKE] == {"value": "1", "by": "user",
                                                 "why": "set in the environment"}


def test_horovod_flags_read_as_horovod_reads_them():
    assert [tuning.horovod_flag(v) for v in ("1", " 2", "+1x", "0", "true", "on", "", "-0")] == [
        True, True, True, False, False, False, False, False]


def test_the_one_rank_cycle_leaves_the_environment_after_init_and_a_wrong_size_is_said(caplog):
    env = {}
    chosen = tuning.rank_settings(on_gpu=False, size=1, env=env, can_wake=True)
    assert env[CYCLE] == "10"
    # Read by hvd.init() already: a job this process launches must not take it for the user's.
    assert tuning.settings_in_effect(chosen, mpi=True, size=1, env=env) == chosen
    assert CYCLE not in env and env[WAKE] == "1"
    # A launcher whose size variable hvdtrain does not read: one rank assumed, two found.
    env = {}
    chosen = tuning.rank_settings(on_gpu=False, size=1, env=env, can_wake=True)
    with caplog.at_level("WARNING"):
        record = tuning.settings_in_effect(chosen, mpi=True, size=2, env=env)
    assert "the job has 2 ranks" in record[CYCLE]["why"] and "HOROVOD_CYCLE_TIME=1" in caplog.text
    # The user's cycle is the user's: left in place, no warning.
    env, caplog_before = {CYCLE: "10"}, len(caplog.records)
    chosen = tuning.rank_settings(on_gpu=False, size=1, env=env, can_wake=True)
    tuning.settings_in_effect(chosen, mpi=True, size=2, env=env)
    assert env[CYCLE] == "10" and len(caplog.records) == caplog_before


def test_openmp_threads_spin_briefly_unless_the_user_chose():
    env = {}
    chosen = tuning.openmp_spin(env)
    assert env == {"GOMP_SPINCOUNT": "1000"}
    assert chosen["value"] == "GOMP_SPINCOUNT=1000" and chosen["by"] == "hvdtrain"
    for users in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(users)
        chosen = tuning.openmp_spin(env)
        assert env == users and chosen["by"] == "user"  # untouched: libgomp reads theirs
        assert chosen["value"] == "{}={}".format(*users.popitem())
    env = {"GOMP_SPINCOUNT": " "}  # empty counts as unset
    assert tuning.openmp_spin(env)["by"] == "hvdtrain" and env["GOMP_SPINCOUNT"] == "1000"


def test_hvdtrain_train_sets_the_spin_before_the_framework_loads_openmp(tmp_path):
    """libgomp reads GOMP_SPINCOUNT once, when it loads (at ``import torch``): ``hvdtrain train``
    must set it before it imports the trainer. The stand-in import records, into a file, the
    variable and whether torch or libgomp were loaded at that moment, then ends the run."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "seen.json"
    code = (
        "import json, os, sys\n"
        "from hvdtrain import cli, runtime\n"
        "def stand_in(*modules):\n"
        "    gomp = any('libgomp' in line for line in open('/proc/self/maps'))\n"
        "    json.dump({'spin': os.environ.get('GOMP_SPINCOUNT'), 'modules': list(modules),\n"
        "               'torch': 'torch' in sys.modules, 'gomp': gomp}, open(sys.argv[1], 'w'))\n"
        "    raise SystemExit(0)\n"
        "runtime.import_frozen = stand_in\n"
        "cli.main(['train', '--framework', 'torch', '--dataset', 'digits', '--epochs', '1'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen == {"spin": "1000", "modules": ["hvdtrain.torch.trainer", "torch._dynamo"],
                    "torch": False, "gomp": False}
