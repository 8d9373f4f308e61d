"""An op that fails inside the micro-batch loop: TensorFlow cancels the other devices' receives and may raise
one of those ("CancelledError: RecvAsync is cancelled", a derived status) instead of the failure. The
pipelined model says so on the error it raises (runtime.pipeline.CANCELLED_NOTE); on one stage the failure
itself is raised."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner as pt
from profiles import profile_model
from runtime import wrap
from runtime.pipeline import CANCELLED_NOTE


@keras.saving.register_keras_serializable("test_step_errors")
class _Bounded(keras.layers.Layer):
    """Fails the step when a value exceeds 100 (an op failing at run time, as an out-of-memory would)."""

    def call(self, x):
        return tf.debugging.check_numerics(x * tf.where(tf.reduce_max(tf.abs(x)) > 100.0, np.inf, 1.0), "too large")


def _wrapped(devices: list[str]):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="first")(inputs)
    h = keras.layers.Dense(4, name="second")(h)
    h = _Bounded(name="bounded")(h)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    graph = profile_model(model, batch_size=8, num_microbatches=2, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="1GiB") for d in devices])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=2)
    wrapped = wrap(model, plan, validate=False)
    wrapped.compile(optimizer="sgd", loss="mse")
    return wrapped


@pytest.mark.parametrize("num_devices", [1, 2])
def test_a_failure_inside_the_loop_is_raised_or_explained(num_devices: int, virtual_devices) -> None:
    wrapped = _wrapped(virtual_devices[:num_devices])
    y = np.zeros((8, 2), "float32")
    wrapped.train_on_batch(np.ones((8, 4), "float32"), y)  # small values: the step runs
    with pytest.raises(tf.errors.OpError) as raised:
        wrapped.train_on_batch(np.full((8, 4), 1e6, "float32"), y)
    error = raised.value
    notes = getattr(error, "__notes__", [])
    if num_devices == 1:
        assert isinstance(error, tf.errors.InvalidArgumentError) and "too large" in str(error)
        assert CANCELLED_NOTE not in notes
    elif isinstance(error, tf.errors.CancelledError):  # what TensorFlow 2.21 raises here
        assert notes == [CANCELLED_NOTE]
    else:
        assert "too large" in str(error)
