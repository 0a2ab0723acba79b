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
