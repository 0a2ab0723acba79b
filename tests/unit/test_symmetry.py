"""hvdtrain.torch and hvdtrain.keras offer the same concepts under the same names."""
import inspect

import hvdtrain.keras as hk
import hvdtrain.torch as ht

# Names only one framework has, and why.
TORCH_ONLY = {"micro_batches", "MicroBatch", "Warmup"}  # the user writes the PyTorch loop;
# Keras's fit accumulates inside the optimizer (Keras 3's gradient_accumulation_steps). Warmup is
# the scheduler object warmup() returns (Keras: WarmupCallback, with WarmupSchedule inside the
# optimizer).
# hvd.SyncBatchNorm is PyTorch's; Keras models take Horovod's hvd.SyncBatchNormalization layer
# themselves (TensorFlow backend only; patched for Keras 3, scripts/horovod_patches/), so the Keras
# side offers no converter, only sync_buffers.
TORCH_ONLY |= {"convert_sync_batchnorm"}
KERAS_ONLY = {"shard_dataset", "ShardedDataset", "micro_batches_per_epoch", "callbacks",
              "WarmupCallback", "WarmupSchedule", "SyncBuffersCallback",
              "MetricAverageCallback"}  # PyDataset and fit() plumbing; PyTorch uses
# DistributedSampler + DataLoader and a LambdaLR, and calls sync_buffers() in its own loop.
# Keras 3 only: which backend runs (KERAS_BACKEND), and Keras's micro-batch counter, which
# optimizer.iterations (optimizer steps) hides once it accumulates (a torch loop counts itself).
KERAS_ONLY |= {"backend", "micro_batch_count", "set_micro_batch_count"}
SHARED = {"init", "rank_info", "distribute", "broadcast_state", "warmup", "allreduce_sums",
          "ranks_where", "sync_buffers"}


def test_public_names_are_symmetric():
    assert set(ht.__all__) == SHARED | TORCH_ONLY
    assert set(hk.__all__) == SHARED | KERAS_ONLY


# Keras's fit() owns the training loop, so the non-finite check lives in the optimizer
# (distribute(on_nonfinite=...)); a PyTorch loop calls ranks_where() itself, as hvdtrain's trainer
# does. Extra parameters come last, so shared calls read the same.
KERAS_ONLY_PARAMS = {"distribute": ["on_nonfinite"]}
# A PyTorch user's own LR scheduler composes with the warmup (warmup(..., scheduler=...)); a Keras
# user's LearningRateSchedule is the optimizer's learning_rate, which distribute() composes.
TORCH_ONLY_PARAMS = {"warmup": ["scheduler"], "distribute": ["sync_batchnorm"]}


def test_shared_functions_take_the_same_parameters():
    for name in SHARED:
        torch_params = list(inspect.signature(getattr(ht, name)).parameters)
        keras_params = list(inspect.signature(getattr(hk, name)).parameters)
        torch_params = [p for p in torch_params if p not in TORCH_ONLY_PARAMS.get(name, [])]
        assert torch_params + KERAS_ONLY_PARAMS.get(name, []) == keras_params, name


def test_shared_functions_are_documented():
    for module in (ht, hk):
        for name in module.__all__:
            assert inspect.getdoc(getattr(module, name)), f"{module.__name__}.{name}"


def test_the_runs_framework_hooks_are_mirrored():
    """hvdtrain/torch/hooks.py and hvdtrain/keras/hooks.py implement every operation of the
    run's Hooks protocol, with the protocol's parameters, and nothing else public."""
    from hvdtrain.keras import hooks as keras_hooks
    from hvdtrain.run.hooks import Hooks
    from hvdtrain.torch import hooks as torch_hooks
    protocol = {name for name in vars(Hooks) if not name.startswith("_")} | set(
        Hooks.__annotations__)
    for module in (torch_hooks, keras_hooks):
        implemented = {name for name in vars(module.Hooks) if not name.startswith("_")}
        assert implemented == protocol, module.__name__
        for name in protocol - {"framework", "checkpoint_files"}:
            expected = list(inspect.signature(getattr(Hooks, name)).parameters)
            assert list(inspect.signature(getattr(module.Hooks, name)).parameters) == expected, \
                (module.__name__, name)
    assert torch_hooks.Hooks.framework == "torch" and keras_hooks.Hooks.framework == "keras"
    # The same helper names beside the class (evaluate; Keras adds the backend's version).
    torch_names = {n for n in vars(torch_hooks) if callable(getattr(torch_hooks, n))
                   and getattr(getattr(torch_hooks, n), "__module__", "") == torch_hooks.__name__}
    keras_names = {n for n in vars(keras_hooks) if callable(getattr(keras_hooks, n))
                   and getattr(getattr(keras_hooks, n), "__module__", "") == keras_hooks.__name__}
    assert torch_names - {"autocast"} == keras_names - {"backend_version"}


def test_torch_and_keras_have_the_same_files():
    """The torch/ and keras/ halves mirror each other file by file (Keras adds the modules of
    Keras 3's fit plumbing and its backends; overlap.py starts the all-reduces during backward on
    Keras's torch backend, which Horovod's own DistributedOptimizer does for PyTorch; lightning.py
    is PyTorch Lightning's strategy: Lightning trains PyTorch modules only, and Keras's own fit()
    is its trainer)."""
    from pathlib import Path
    root = Path(ht.__file__).parent.parent
    torch_files = {p.name for p in (root / "torch").glob("*.py")}
    keras_files = {p.name for p in (root / "keras").glob("*.py")}
    keras_extra = {"callbacks.py", "overlap.py", "sharding.py",
                   "trainer_callbacks.py", "xla.py"}
    torch_extra = {"buffers.py", "lightning.py"}
    assert torch_files - torch_extra == keras_files - keras_extra
