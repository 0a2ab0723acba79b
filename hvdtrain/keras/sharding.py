"""This rank's share of the training data for Keras's ``fit``, reshuffled globally every epoch
(the counterpart of PyTorch's ``DistributedSampler``), on either Keras backend."""
from __future__ import annotations

import keras
import numpy as np

from hvdtrain import runtime
from hvdtrain.keras import collectives as B


def micro_batches_per_epoch(samples: int, batch_size: int, size: int,
                            backward_passes_per_step: int) -> int:
    """Micro-batches one rank runs per Keras epoch: its shard's batches (the last one completed
    by wrapping around) rounded down to a multiple of k, so every epoch ends on a complete
    accumulation group (at least one group).

    Args:
        samples: training samples in the whole dataset.
        batch_size: local batch.
        size: world size.
        backward_passes_per_step: k.

    Raises:
        ValueError: ``batch_size`` or k below 1, or a rank's shard holds fewer than
            ``batch_size x k`` samples.
    """
    if batch_size < 1 or backward_passes_per_step < 1:
        raise ValueError(f"batch_size and backward_passes_per_step must be >= 1; got "
                         f"{batch_size} and {backward_passes_per_step}")
    per_rank = samples // size
    groups = per_rank // (batch_size * backward_passes_per_step)
    if groups < 1:
        raise ValueError(f"{samples} samples over {size} ranks leave {per_rank} per rank, fewer "
                         f"than one optimizer step needs (batch {batch_size} x k "
                         f"{backward_passes_per_step}); lower --batch-size or "
                         "--backward-passes-per-step")
    return -(-per_rank // batch_size) // backward_passes_per_step * backward_passes_per_step


class ShardedDataset(keras.utils.PyDataset):
    """This rank's endless stream of micro-batches ``(x (B, ...), y (B,))`` for ``fit``, the
    counterpart of PyTorch's ``DistributedSampler``: every epoch visits a new global permutation
    of all samples (``numpy.random.default_rng((seed, epoch))``, the same on every rank) and rank
    r takes its entries ``r, r + size, ...`` (``samples // size`` of them), so the ranks' shards
    change every epoch and together cover the data. An epoch is :attr:`steps_per_epoch`
    micro-batches (:func:`micro_batches_per_epoch`: a whole number of accumulation groups; the
    last batch is completed by wrapping around the shard).

    Batch ``i`` of the stream is a pure function of ``(start_batch + i)``, so a resumed run
    starts at its position directly (``start_batch``) instead of replaying the stream. Works with
    both Keras backends; pass ``steps_per_epoch=data.steps_per_epoch`` to ``fit``.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, *, batch_size: int, rank: int, size: int,
                 seed: int = 0, shuffle: bool = True, backward_passes_per_step: int = 1,
                 start_batch: int = 0, **kwargs):
        super().__init__(**kwargs)
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x, self.y, self.batch_size = x, y, int(batch_size)
        self.rank, self.size, self.seed, self.shuffle = rank, size, seed, shuffle
        self.per_rank = len(x) // size
        self.steps_per_epoch = micro_batches_per_epoch(len(x), batch_size, size,
                                                       backward_passes_per_step)
        self.start_batch = int(start_batch)
        self._epoch, self._shard = None, None

    @property
    def num_batches(self):
        return None  # endless: fit() takes steps_per_epoch

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's sample indices in ``epoch`` (``samples // size`` of them)."""
        if self._epoch != epoch:
            n = len(self.x)
            order = (np.random.default_rng((self.seed, epoch)).permutation(n) if self.shuffle
                     else np.arange(n))
            self._epoch, self._shard = epoch, order[self.rank::self.size][:self.per_rank]
        return self._shard

    def __getitem__(self, i):
        epoch, j = divmod(self.start_batch + int(i), self.steps_per_epoch)
        shard = self.shard(epoch)
        idx = shard[(j * self.batch_size + np.arange(self.batch_size)) % len(shard)]
        return self.x[idx], self.y[idx]


def shard_dataset(x: np.ndarray, y: np.ndarray, *, batch_size: int, seed: int = 0,
                  shuffle: bool = True, info: runtime.RankInfo | None = None,
                  backward_passes_per_step: int = 1, start_batch: int = 0) -> ShardedDataset:
    """This rank's micro-batches of ``(x (N, ...), y (N,))`` for ``fit``, reshuffled globally
    every epoch (:class:`ShardedDataset`; ``steps_per_epoch`` attribute for ``fit``).

    Args:
        x: inputs ``(N, ...)``; y: labels ``(N,)``.
        batch_size: local batch.
        seed: shuffle seed (the same on every rank).
        shuffle: a new permutation every epoch (False: strided shards of the data in order).
        info: rank and size; defaults to Horovod's.
        backward_passes_per_step: k (an epoch is a whole number of groups of k).
        start_batch: micro-batches of the stream already trained (``--resume``).

    Raises:
        ValueError: ``x`` and ``y`` differ in length, ``batch_size`` or k below 1, or a shard is
            too small for one step.
    """
    rank, size = (info.rank, info.size) if info else (B.hvd.rank(), B.hvd.size())
    return ShardedDataset(x, y, batch_size=batch_size, rank=rank, size=size, seed=seed,
                          shuffle=shuffle, backward_passes_per_step=backward_passes_per_step,
                          start_batch=start_batch)


def sharded_fit_defaults(model: keras.Model) -> None:
    """``fit``/``evaluate`` of a distributed model given a :class:`ShardedDataset` (an endless
    stream) without ``steps_per_epoch``/``steps`` (or as ``validation_data`` without
    ``validation_steps``) take its epoch (``data.steps_per_epoch``)
    instead of running forever, and a ``steps_per_execution`` that does not divide the epoch is
    refused before any step (Keras runs whole chunks of an endless dataset: with 4 and an epoch
    of 6 it would train 8 micro-batches an epoch). Installed on the model object by
    :func:`hvdtrain.keras.distribute` (once)."""
    if "hvdtrain_fit" in model.__dict__:
        return
    fit, evaluate = model.fit, model.evaluate

    def epoch_of(data, steps, what):
        if not isinstance(data, ShardedDataset):
            return steps
        steps = data.steps_per_epoch if steps is None else int(steps)
        chunk = int(getattr(model, "steps_per_execution", 1) or 1)
        if steps % chunk:
            raise ValueError(
                f"{what}={steps} is not a multiple of the model's steps_per_execution={chunk}: "
                f"Keras runs whole chunks of {chunk} batches of this endless sharded dataset, "
                f"so an epoch would run {-(-steps // chunk) * chunk}; compile with a "
                f"steps_per_execution that divides {steps}")
        return steps

    def sharded_fit(x=None, y=None, *args, steps_per_epoch=None, **kwargs):
        validation = kwargs.get("validation_data")
        if isinstance(validation, ShardedDataset) and kwargs.get("validation_steps") is None:
            kwargs["validation_steps"] = epoch_of(validation, None, "validation_steps")
        return fit(x, y, *args, steps_per_epoch=epoch_of(x, steps_per_epoch, "steps_per_epoch"),
                   **kwargs)

    def sharded_evaluate(x=None, y=None, *args, steps=None, **kwargs):
        return evaluate(x, y, *args, steps=epoch_of(x, steps, "steps"), **kwargs)

    model.hvdtrain_fit = sharded_fit
    model.fit, model.evaluate = sharded_fit, sharded_evaluate
