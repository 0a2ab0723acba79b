"""``model.compile(..., jit_compile=True)`` for a distributed model on Keras's TensorFlow backend.

Keras compiles the whole train step (forward, backward, optimizer update) into one XLA cluster
when ``jit_compile`` is on. Horovod's TensorFlow ops have no XLA kernels (and this build leaves
its XLA ops out), so the all-reduce inside the distributed optimizer's ``apply`` would make the
compilation fail (``tf2xla conversion failed ... horovod_grouped_allreduce``). With
:func:`split_train_step` the forward and backward pass (the model, the loss, the loss tracker,
the gradients) are one XLA-compiled function, and the step around it, which all-reduces the
gradients and applies them, stays an ordinary ``tf.function``: the collective is outside the XLA
cluster, the arithmetic inside it. ``jit_compile="auto"`` (Keras's default) and ``False`` are
left as Keras makes them: on a CPU-only host ``"auto"`` means no XLA; where Keras resolves
``"auto"`` to XLA (a GPU visible to TensorFlow) the model's ``jit_compile`` is True and the split
applies.
"""
from __future__ import annotations

import keras


def split_train_step(model: keras.Model) -> None:
    """Make ``model``'s train function, when it is built with ``model.jit_compile`` True, compile
    only the forward and backward pass with XLA (TensorFlow backend).

    Installs an instance ``make_train_function`` that defers to Keras's own unless
    ``model.jit_compile`` is True at the time ``fit`` builds the function (after ``compile``).
    Then it builds Keras's train function from :func:`_train_step` with ``jit_compile``
    switched off for the outer function only (``evaluate`` and ``predict`` keep XLA). The step
    computes what Keras's own ``train_step`` does: ``model(x, training=True)``,
    ``model.compute_loss``, the ``loss`` tracker, ``optimizer.scale_loss``, the gradients,
    ``optimizer.apply_gradients`` and ``model.compute_metrics``.

    Args:
        model: the distributed ``keras.Model`` (any input and output shapes).

    Raises:
        ValueError: (when ``fit`` builds the function) ``jit_compile`` is True and the model's
            class has its own ``train_step``, which this cannot split.
    """
    make_keras_train_function = model.make_train_function
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    own_step = type(model).train_step is not TensorFlowTrainer.train_step

    def make_train_function(force: bool = False):
        if model.train_function is not None and not force:
            return model.train_function
        if not model.jit_compile:
            return make_keras_train_function(force=force)
        if own_step:
            raise ValueError(
                f"{type(model).__name__} has its own train_step and was compiled with "
                "jit_compile=True: XLA cannot compile the Horovod all-reduce inside the "
                "optimizer's apply. Compile with jit_compile=False, or put your forward and "
                "backward pass in a tf.function(jit_compile=True) inside train_step and call "
                "optimizer.apply_gradients outside it")
        model.train_step = _train_step(model)  # read once, when Keras builds the function
        model.hvdtrain_xla_split = True  # what the tests read back
        model.jit_compile = False  # the outer step (with the all-reduce): plain tf.function
        try:
            make_keras_train_function(force=True)
        finally:
            model.jit_compile = True
            del model.train_step
        return model.train_function

    model.make_train_function = make_train_function


def _train_step(model: keras.Model):
    """Keras's TensorFlow ``train_step`` with its forward and backward pass in one XLA function."""
    import tensorflow as tf

    def forward_backward(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = (model(x, training=True) if getattr(model, "_call_has_training_arg", True)
                      else model(x))
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
            tracker = getattr(model, "_loss_tracker", None)  # fit's "loss" log (Keras's own)
            if tracker is not None:
                first = next(t for t in tf.nest.flatten(x) if t is not None)
                tracker.update_state(loss, sample_weight=tf.shape(first)[0])
            loss = model.optimizer.scale_loss(loss)
        return y_pred, tape.gradient(loss, model.trainable_weights)

    compiled = tf.function(forward_backward, jit_compile=True, reduce_retracing=True)

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, gradients = compiled(x, y, sample_weight)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step
