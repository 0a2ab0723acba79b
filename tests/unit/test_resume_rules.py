"""What a resumed run takes from the checkpoint and what from its own options, in one process
(issue #37, items 6 and 7): PyTorch's optimizer settings vs state, Keras's optimizer variables by
key, the options logged as changed, an elastic run's epochs read back. The same under
`horovodrun -np 2`: tests/parallel/test_resume_settings.py."""
import numpy as np
import pytest
import torch

from hvdtrain.config import TrainConfig
from hvdtrain.run.elastic import ELASTIC_EXTRA
from hvdtrain.run.report import EpochMetrics
from hvdtrain.run.training import EPOCH_FIELDS, resume_changes
from hvdtrain.torch import checkpoint as torch_checkpoint


def _sgd_state(momentum: float, steps: int = 2) -> tuple[torch.nn.Linear, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    return model, opt.state_dict()


def test_torch_resume_keeps_this_runs_momentum_and_drops_buffers_it_does_not_use():
    model, state = _sgd_state(0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0, weight_decay=0.0)
    changed = torch_checkpoint.load_optimizer(opt, state)
    # Before: load_state_dict alone left momentum 0.9 and weight decay 1e-3 in the groups.
    assert opt.param_groups[0]["momentum"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.0
    assert changed == {"momentum": (0.9, 0.0), "weight_decay": (1e-3, 0.0)}
    # At momentum 0 the checkpoint's momentum buffers are dropped (a later resume at a momentum
    # again starts them afresh, as Keras starts a new slot); the rate is left to the schedule.
    assert all("momentum_buffer" in s for s in state["state"].values())
    assert not any("momentum_buffer" in opt.state[p] for p in model.parameters())
    assert opt.param_groups[0]["lr"] == 0.1
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert not any("momentum_buffer" in opt.state[p] and opt.state[p]["momentum_buffer"]
                   is not None for p in model.parameters())


def test_torch_resume_from_momentum_zero_starts_the_buffers():
    model, state = _sgd_state(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    assert torch_checkpoint.load_optimizer(opt, state) == {"momentum": (0.0, 0.9)}
    assert opt.param_groups[0]["momentum"] == 0.9
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())


def test_resume_changes_names_the_options_given_otherwise():
    saved = TrainConfig(momentum=0.9, lr=0.02).to_dict()
    cfg = TrainConfig(momentum=0.0, lr=0.02, backward_passes_per_step=2)
    assert resume_changes(saved, cfg) == {"momentum": (0.9, 0.0),
                                          "backward_passes_per_step": (1, 2)}
    assert resume_changes(None, cfg) == {}
    assert resume_changes(saved, TrainConfig(momentum=0.9, lr=0.02)) == {}


def test_an_elastic_epoch_reads_back_as_epoch_metrics():
    entry = {**vars(EpochMetrics(1, 2.0, 0.3, 1.5, 0.5, 0.04, 45, 1.0, 1437.0)),
             "samples": 1438, "sizes": [2]}
    assert set(ELASTIC_EXTRA) <= set(entry)
    # Before: EpochMetrics(**entry) raised TypeError (unexpected keyword argument 'samples').
    assert EpochMetrics(**{k: entry[k] for k in EPOCH_FIELDS}).optimizer_steps == 45


def _keras_pair(hk, keras, momentum, k, precision):
    from hvdtrain.keras.models import build_model
    keras.mixed_precision.set_global_policy(
        "mixed_float16" if precision == "fp16" else "float32")
    try:
        model = build_model(10, 8, 0.0, False)
        opt = keras.optimizers.SGD(learning_rate=0.02, momentum=momentum)
        if precision == "fp16":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        return hk.distribute(model, opt, backward_passes_per_step=k, on_nonfinite="skip")
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("momentum, k, precision, fresh, dropped", [
    (0.9, 1, "fp32", 0, 0),
    (0.0, 1, "fp32", 0, 8),     # momentum slots dropped
    (0.9, 2, "fp32", 8, 0),     # gradient accumulators new (zeros)
    (0.9, 1, "fp16", 4, 0),     # the loss-scale optimizer's own variables new
])
def test_keras_optimizer_variables_load_by_key(momentum, k, precision, fresh, dropped):
    keras = pytest.importorskip("keras")
    import hvdtrain.keras as hk
    from hvdtrain.keras import checkpoint
    hk.init(seed=0)
    model, opt = _keras_pair(hk, keras, 0.9, 1, "fp32")
    for i, var in enumerate(opt.variables):
        var.assign(np.full(var.shape, i + 1, dtype=var.dtype))
    keys = checkpoint.optimizer_keys(opt, model.trainable_variables)
    assert keys[:3] == ["inner/iteration", "inner/0:momentum", "inner/1:momentum"]
    values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in opt.variables]
    model2, opt2 = _keras_pair(hk, keras, momentum, k, precision)
    got = checkpoint.load_optimizer(opt2, model2.trainable_variables, keys, values)
    assert (len(got["fresh"]), len(got["dropped"])) == (fresh, dropped)
    by_key = dict(zip(checkpoint.optimizer_keys(opt2, model2.trainable_variables),
                      opt2.variables))
    saved = dict(zip(keys, values))
    for key in got["restored"]:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(by_key[key]), saved[key])
    for key in got["fresh"]:
        if key.endswith(":gradient_accumulator"):
            assert not keras.ops.convert_to_numpy(by_key[key]).any()
    # A checkpoint without keys (older) loads by position only into as many variables.
    if len(opt2.variables) != len(values):
        with pytest.raises(ValueError, match="--momentum"):
            checkpoint.load_optimizer(opt2, model2.trainable_variables, None, values)
