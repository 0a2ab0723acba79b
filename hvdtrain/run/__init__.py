"""The training run of ``hvdtrain train``, framework-free and written once.

- :mod:`~hvdtrain.run.training`: :func:`~hvdtrain.run.training.start` and
  :class:`~hvdtrain.run.training.Run` (resume, position, header, each epoch's end, the
  preemption stop, rank agreement), driven by a framework's trainer.
- :mod:`~hvdtrain.run.hooks`: the ~12 operations a framework supplies
  (:mod:`hvdtrain.torch.hooks`, :mod:`hvdtrain.keras.hooks`).
- :mod:`~hvdtrain.run.report`: ``metrics.json`` (its schema, :class:`RunHeader`), the run header,
  TensorBoard's epoch scalars, and the stops every rank takes together (:func:`stop_together`).
- :mod:`~hvdtrain.run.preempt`: signals, the agreed stop, exit 75 and Slurm requeue.
- :mod:`~hvdtrain.run.elastic`: the record and stops of elastic mode.

Nothing here imports torch, TensorFlow or Keras.
"""
