import pytest

from hvdtrain.config import ConfigError, TrainConfig


def cfg(tmp_path, **kw):
    return TrainConfig(output_dir=str(tmp_path / "out"), **kw)


def test_defaults_validate_and_global_batch(tmp_path):
    c = cfg(tmp_path, batch_size=8, backward_passes_per_step=2).validate()
    assert c.global_batch(2) == 32
    assert (tmp_path / "out").is_dir()


@pytest.mark.parametrize("kw,match", [
    (dict(backward_passes_per_step=0), "--backward-passes-per-step must be a whole number >= 1; got 0"),
    (dict(batch_size=0), "--batch-size must be a whole number >= 1; got 0"),
    (dict(batch_size=-3), "--batch-size must be a whole number >= 1"),
    (dict(epochs=0), "--epochs must be"),
    (dict(framework="jax"), "--framework must be one of torch, keras; got 'jax'"),
    (dict(dataset="imagenet"), "--dataset must be one of digits, mnist, synthetic; got 'imagenet'"),
    (dict(lr=0.0), "--lr must be > 0"),
    (dict(momentum=1.0), r"--momentum must be in \[0, 1\)"),
    (dict(lr_scaling="cubic"), "--lr-scaling must be one of linear, sqrt, none"),
    (dict(warmup_epochs=-1), "--warmup-epochs must be >= 0"),
    (dict(compression="int8"), "--compression must be one of none, fp16"),
    (dict(op="max"), "--op must be one of average, adasum"),
    (dict(op="adasum"), "use --lr-scaling none"),
    (dict(test_fraction=1.0), "--test-fraction"),
    (dict(device="tpu"), "--device must be one of auto, cpu, cuda; got 'tpu'"),
    (dict(precision="fp8"), "--precision must be one of fp32, bf16, fp16; got 'fp8'"),
    (dict(op="adasum", framework="keras", lr_scaling="none"), "Keras optimizer averages"),
    (dict(precision="fp16", compression="fp16", framework="keras"), "use --compression none"),
    (dict(precision="fp16", op="adasum", lr_scaling="none"), "use --precision bf16 or --op average"),
    (dict(init_loss_scale=0.0), "--init-loss-scale must be > 0"),
    (dict(elastic=True, precision="bf16"), "--elastic trains in fp32 on the CPU"),
])
def test_bad_values_name_the_option(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg(tmp_path, **kw).validate()


def test_output_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        TrainConfig(output_dir=str(f)).validate()


def test_output_dir_on_read_only_filesystem():
    # /proc is read-only even for root.
    with pytest.raises(ConfigError, match="--output-dir '/proc/hvdtrain' is not writable"):
        TrainConfig(output_dir="/proc/hvdtrain").validate()


def test_keras_backend_comes_from_the_option_then_the_variable(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    assert TrainConfig(framework="keras", output_dir=out).validate().keras_backend == "tensorflow"
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert TrainConfig(framework="keras", output_dir=out).validate().keras_backend == "torch"
    assert TrainConfig(framework="keras", keras_backend="tensorflow",
                       output_dir=out).validate().keras_backend == "tensorflow"
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    with pytest.raises(ConfigError, match="KERAS_BACKEND=jax .* use tensorflow or torch"):
        TrainConfig(framework="keras", output_dir=out).validate()
    with pytest.raises(ConfigError, match="--keras-backend must be one of"):
        TrainConfig(framework="keras", keras_backend="jax", output_dir=out).validate()
    with pytest.raises(ConfigError, match="--keras-backend is for --framework keras"):
        TrainConfig(framework="torch", keras_backend="torch", output_dir=out).validate()
    assert TrainConfig(output_dir=out).validate().keras_backend == ""  # torch: not used


def test_data_dir_and_log_every_are_checked_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--data-dir is for --dataset mnist"):
        TrainConfig(data_dir=str(tmp_path), output_dir=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match="--data-dir .* does not exist"):
        TrainConfig(dataset="mnist", data_dir=str(tmp_path / "nope"),
                    output_dir=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match="--log-every must be a whole number >= 1; got 0"):
        TrainConfig(log_every=0, output_dir=str(tmp_path)).validate()


@pytest.mark.parametrize("value", ["5", "x:1", "3:-1", "3:61", "3:abc", "-1:0.5", "3:nan"])
def test_fault_slow_from_must_be_step_and_seconds(tmp_path, value):
    with pytest.raises(ConfigError, match=f"--fault-slow-from must be STEP:SECONDS .*{value!r}"):
        cfg(tmp_path, fault_slow_from=value).validate()


def test_fault_slow_from_sleeps_from_its_step_on(tmp_path, monkeypatch):
    from hvdtrain import runtime
    c = cfg(tmp_path, fault_slow_from="75:0.04").validate()
    assert c.slow_fault() == (75, 0.04) and cfg(tmp_path).slow_fault() is None
    slept = []
    monkeypatch.setattr(runtime.time, "sleep", slept.append)
    for step in (0, 74, 75, 200):
        runtime.slow_step(c.slow_fault(), step)
    runtime.slow_step(None, 500)
    assert slept == [0.04, 0.04]


def test_every_option_is_declared_once_with_help_and_reaches_the_parser():
    import argparse

    from hvdtrain.config import cli_fields, flag_of
    from hvdtrain.config_args import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    for f in cli_fields():
        assert f.metadata["help"], f.name
        assert actions[f.name].option_strings[0] == flag_of(f)
        if f.metadata["hidden"]:  # the fault drills: accepted, not in --help
            assert actions[f.name].help == argparse.SUPPRESS
        else:
            assert f.metadata["help"] in actions[f.name].help
    assert {f.name for f in cli_fields() if f.metadata["hidden"]} == {"fault_nan_at",
                                                                      "fault_slow_from"}
    assert "recipe" not in actions  # not an option: what the dataset's recipe filled in


def test_each_visible_option_is_in_one_help_group(monkeypatch):
    import argparse

    from hvdtrain.config import cli_fields
    from hvdtrain.config_args import OPTION_GROUPS, add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert list(groups)[-len(OPTION_GROUPS):] == list(OPTION_GROUPS)
    placed = [d for title in OPTION_GROUPS for d in groups[title]]
    assert sorted(placed) == sorted(f.name for f in cli_fields() if not f.metadata["hidden"])
    import hvdtrain.config_args as config_args
    monkeypatch.setattr(config_args, "OPTION_GROUPS", dict(OPTION_GROUPS, extra=(None, ("dropout",))))
    with pytest.raises(ValueError, match="OPTION_GROUPS must hold each visible option once"):
        add_arguments(argparse.ArgumentParser())


def test_a_datasets_recipe_fills_what_the_command_line_leaves_out(tmp_path):
    from hvdtrain.datasets.recipes import RECIPES
    cfg = TrainConfig.from_options({"dataset": "mnist", "lr": 0.05,
                                    "output_dir": str(tmp_path)}).validate()
    assert cfg.lr == 0.05 and "lr" not in cfg.recipe  # given: wins
    for key, value in RECIPES["mnist"].items():
        if key != "lr":
            assert getattr(cfg, key) == value and cfg.recipe[key] == value
    digits = TrainConfig.from_options({"output_dir": str(tmp_path)}).validate()
    assert digits.recipe == {} and digits == TrainConfig(output_dir=str(tmp_path)).validate()
    # Elastic runs have no warmup: the recipe's is not taken (and so not refused).
    elastic = TrainConfig.from_options({"dataset": "mnist", "elastic": True,
                                        "output_dir": str(tmp_path)}).validate()
    assert "warmup_epochs" not in elastic.recipe


@pytest.mark.parametrize("kw,match", [
    (dict(lr_schedule="linear"), "--lr-schedule must be one of constant, cosine, step"),
    (dict(lr_schedule="step"), "--lr-schedule step needs --lr-steps.*e.g. --lr-steps 8,11$"),
    (dict(lr_steps="30"), "--lr-steps is for --lr-schedule step"),
    (dict(lr_schedule="step", lr_steps="a,b"), "--lr-steps 'a,b'"),
    (dict(lr_schedule="step", lr_steps="20", epochs=15),
     r"must lie in \[2, 15\).*; e.g. --lr-steps 8,11$"),
    (dict(lr_min_ratio=-0.1), "--lr-min-ratio must be in"),
    (dict(lr_schedule="step", lr_steps="3,4,5,6,7,8,9,10,11", epochs=15),
     "at most 8 --lr-steps"),
])
def test_lr_schedule_options_are_checked_before_any_work(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg(tmp_path, **kw).validate()


@pytest.mark.parametrize("epochs,warmup,elastic", [
    (15, 2.0, False), (4, 1.0, False), (90, 5.0, False), (2, 1.5, False), (1, 0.0, False),
    (2, 1.0, False), (2, 1.98, False), (1, 0.995, False), (3, 0.0, True), (1, 2.0, True)])
def test_the_lr_steps_an_error_suggests_are_taken(tmp_path, epochs, warmup, elastic):
    """The --lr-steps a refusal suggests lie after this run's warmup and before its end: given,
    they pass (an example of 30,60,80 was refused at the default 15 epochs)."""
    import re
    options = dict(lr_schedule="step", epochs=epochs, warmup_epochs=warmup, elastic=elastic)
    for bad in ("", str(epochs)):
        with pytest.raises(ConfigError) as refused:
            cfg(tmp_path, lr_steps=bad, **options).validate()
        steps = re.search(r"e\.g\. --lr-steps (\S+)$", str(refused.value)).group(1)
        start = 0.0 if elastic else warmup  # elastic runs have no warmup
        assert all(start < float(e) < epochs for e in steps.split(",")), steps  # not at its end
        cfg(tmp_path, lr_steps=steps, **options).validate()


def test_a_fraction_of_an_epoch_is_suggested_where_no_whole_one_fits(tmp_path):
    with pytest.raises(ConfigError, match=r"must lie in \[1.5, 2\).*e.g. --lr-steps 1.75,1.88$"):
        cfg(tmp_path, lr_schedule="step", lr_steps="1", epochs=2, warmup_epochs=1.5).validate()


@pytest.mark.parametrize("name,value", [
    ("backward_passes_per_step", 2), ("warmup_epochs", 1.0), ("resume", "auto"),
    ("precision", "bf16"), ("batchnorm", True), ("op", "adasum")])
def test_an_option_elastic_runs_cannot_honour_is_refused_naming_it(tmp_path, name, value):
    """Each option declares whether elastic runs honour it; one they cannot is refused before
    any work, never dropped. The declarations and this list agree."""
    from hvdtrain.config import cli_fields, flag_of
    declared = {f.name: flag_of(f) for f in cli_fields() if f.metadata["elastic"]}
    assert set(declared) == {"backward_passes_per_step", "warmup_epochs", "resume", "precision",
                             "batchnorm", "op"}
    extra = {"lr_scaling": "none"} if name == "op" else {}
    with pytest.raises(ConfigError, match=f"--elastic .*; drop {declared[name]}$"):
        cfg(tmp_path, elastic=True, **{name: value}, **extra).validate()
    cfg(tmp_path, elastic=True, warmup_epochs=0.0).validate()  # no warmup: what elastic does
