"""PyTorch's side of the training run (:class:`hvdtrain.run.hooks.Hooks`): Horovod's collectives
from ``horovod.torch``, the model's evaluation, buffers, checkpoint and RNG states. The Keras
mirror is :mod:`hvdtrain.keras.hooks`.
"""
from __future__ import annotations

from pathlib import Path

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvdtrain import datasets
from hvdtrain.torch import adapter, checkpoint

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """``torch.autocast`` for ``precision`` (``"fp32"``: a context that changes nothing)."""
    return torch.autocast(device.type, dtype=AMP_DTYPES.get(precision, torch.float32),
                          enabled=precision in AMP_DTYPES)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, size: int,
             batch_size: int = 256, precision: str = "fp32") -> tuple[float, float]:
    """Mean loss and accuracy over ``(x, y)`` (shapes ``(N, ...)`` and ``(N,)``, on the model's
    device) on all ranks together: each rank scores an unpadded shard, and sums are all-reduced,
    so every sample counts exactly once. Returns ``(loss, accuracy)`` on every rank."""
    idx = torch.from_numpy(datasets.shard_indices(len(x), rank, size)).to(x.device)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    with torch.no_grad(), autocast(x.device, precision):
        for chunk in idx.split(batch_size):
            logits = model(x[chunk])
            loss_sum += F.cross_entropy(logits.float(), y[chunk], reduction="sum").double()
            correct += (logits.argmax(1) == y[chunk]).sum()
    totals = adapter.allreduce_sums({"loss": loss_sum.item(), "correct": correct.item(),
                                     "n": len(idx)}, name="hvdtrain.eval")
    return totals["loss"] / totals["n"], totals["correct"] / totals["n"]


class Hooks:
    """The run's PyTorch operations on one model and optimizer.

    Args:
        model: the model (``(B, 1, S, S)`` images -> ``(B, classes)`` logits).
        optimizer: its optimizer (Horovod's ``DistributedOptimizer`` once distributed; the state
            is loaded before :func:`~hvdtrain.torch.adapter.distribute`, which broadcasts it).
        x_test, y_test: the test split on the model's device, ``(N, 1, S, S)`` and ``(N,)``.
        precision: ``fp32``, ``bf16`` or ``fp16`` (evaluation under autocast).
        base_lr: this run's ``--lr``: a restored optimizer's groups get it as the base to scale.

    Attributes:
        scaler: the fp16 ``GradScaler`` (set by the trainer; saved and restored with the run).
        skipped, overflows: optimizer steps skipped for a non-finite loss, and for overflowing
            fp16 gradients (the trainer counts them).
    """

    framework = "torch"
    checkpoint_files = (checkpoint.CHECKPOINT_FILE, checkpoint.PREVIOUS_FILE)

    def __init__(self, model: torch.nn.Module, optimizer, x_test: torch.Tensor,
                 y_test: torch.Tensor, precision: str, base_lr: float):
        self.model, self.optimizer = model, optimizer
        self.x_test, self.y_test, self.precision, self.base_lr = x_test, y_test, precision, base_lr
        self.scaler = None
        self.skipped = self.overflows = 0

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "horovod": horovod.__version__}

    def broadcast_object(self, obj, root_rank: int = 0, name: str | None = None):
        return hvd.broadcast_object(obj, root_rank=root_rank, name=name)

    def allgather_object(self, obj, name: str | None = None) -> list:
        return hvd.allgather_object(obj, name=name)

    def allreduce_sums(self, sums: dict[str, float], name: str) -> dict[str, float]:
        return adapter.allreduce_sums(sums, name=name)

    def sync_buffers(self) -> None:
        adapter.sync_buffers(self.model)

    def evaluate(self) -> tuple[float, float]:
        return evaluate(self.model, self.x_test, self.y_test, hvd.rank(), hvd.size(),
                        precision=self.precision)

    def rng_state(self) -> dict:
        return checkpoint.rng_state()

    def set_rng_state(self, state: dict) -> None:
        checkpoint.set_rng_state(state)

    def counters(self) -> dict[str, int]:
        return {"skipped": self.skipped, "overflows": self.overflows}

    def restore_counters(self, counters: dict) -> None:
        self.skipped = int(counters.get("skipped", 0))
        self.overflows = int(counters.get("overflows", 0))

    def save(self, output_dir: Path, record: dict) -> None:
        scaler = self.scaler.state_dict() if self.scaler is not None and \
            self.scaler.is_enabled() else None
        checkpoint.save(output_dir, {"model": self.model.state_dict(),
                                     "optimizer": self.optimizer.state_dict(),
                                     "scaler": scaler, **record})

    def load(self, output_dir: Path) -> dict:
        payload = checkpoint.load(output_dir)
        self.model.load_state_dict(payload.pop("model"))
        # The state from the checkpoint, the settings (momentum, ...) this run's.
        payload["optimizer_settings"] = checkpoint.load_optimizer(self.optimizer,
                                                                  payload.pop("optimizer"))
        for group in self.optimizer.param_groups:  # this run's --lr is the base to scale
            group["hvdtrain_base_lr"] = self.base_lr
        return payload

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.model.state_dict().values()
                         if t.is_floating_point()))
