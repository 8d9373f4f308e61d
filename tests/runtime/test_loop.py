"""The loop over micro-batches: a step graph that does not grow with M, and the schedule's bound on the
micro-batches each stage holds."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from zoo import ZOO

import partitioner as pt
from profiles import profile_model
from runtime import wrap


def _wrapped(model, devices, num_microbatches: int, schedule: str, batch: int = 16):
    graph = profile_model(model, batch_size=batch, num_microbatches=num_microbatches, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in devices])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=num_microbatches)
    return wrap(model, plan, validate=False, schedule=schedule)


def _step_graph_size(wrapped, x, y) -> int:
    """Nodes of one training step's graph, the functions it defines included (the loop's body)."""
    specs = (tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)), tf.TensorSpec(y.shape, tf.as_dtype(y.dtype)))
    definition = tf.function(wrapped.train_step).get_concrete_function(specs).graph.as_graph_def()
    return len(definition.node) + sum(len(f.node_def) for f in definition.library.function)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_graph_does_not_grow_with_microbatches(schedule: str, virtual_devices) -> None:
    """The step holds one iteration of the loop, whatever M (the unrolled runtime grew by K stage calls
    per micro-batch, and its first step with it)."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["mlp"]()
    x, y = make_batch(16, 0)
    sizes = []
    for num_microbatches in (4, 16):
        wrapped = _wrapped(model, virtual_devices[:2], num_microbatches, schedule)
        wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        sizes.append(_step_graph_size(wrapped, x, y))
    assert sizes[0] == sizes[1]


@keras.saving.register_keras_serializable(package="tests")
class InFlight(keras.layers.Layer):
    """Identity that counts the micro-batches between its forward and its backward: +1 in the forward,
    -1 in the backward (a custom gradient), and keeps the most it saw."""

    def build(self, input_shape) -> None:
        self.held = self.add_weight(shape=(), initializer="zeros", trainable=False, name="held")
        self.most = self.add_weight(shape=(), initializer="zeros", trainable=False, name="most")

    def call(self, x):
        held, most = self.held.value, self.most.value

        @tf.custom_gradient
        def counted(x):
            now = held.assign_add(1.0)
            with tf.control_dependencies([most.assign(tf.maximum(most, now))]):
                y = tf.identity(x)

            def backward(dy):
                with tf.control_dependencies([held.assign_sub(1.0)]):
                    return tf.identity(dy)

            return y, backward

        return counted(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatches_overlap_up_to_the_schedules_bound(schedule: str, virtual_devices) -> None:
    """The loop's iterations overlap: under GPipe (M = 8, K = 2) the first stage runs the forwards of
    several micro-batches before the slow second stage sends their gradients back (built with
    TensorFlow's automatic control dependencies, the iterations ran one after the other: 1 at most);
    1F1B holds at most K - s: 2 on stage 0, 1 on stage 1, counted where each stage's forward ends."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = InFlight(name="first")(keras.layers.Dense(64, activation="relu")(h))
    h = keras.layers.Dense(1024, activation="relu")(h)  # a slow second stage: the first could run ahead
    outputs = InFlight(name="second")(keras.layers.Dense(4)(h))
    model = keras.Model(inputs, outputs)
    wrapped = _wrapped(model, virtual_devices[:2], 8, schedule, batch=32)
    assert [wrapped.plan.assignment[n] for n in ("first", "second")] == list(virtual_devices[:2])
    wrapped.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
    for _ in range(3):
        wrapped.train_on_batch(x, y)
    counters = {clone.name: clone for _, clone in wrapped._state.rebuilt.origin if isinstance(clone, InFlight)}
    assert {name: float(c.held.numpy()) for name, c in counters.items()} == {"first": 0.0, "second": 0.0}
    most = {name: float(c.most.numpy()) for name, c in counters.items()}
    if schedule == "gpipe":
        assert most["first"] >= 3.0, most
    else:
        assert 1.0 <= most["first"] <= 2.0 and most["second"] == 1.0, most


def test_custom_schedule_runs_with_its_own_windows(virtual_devices) -> None:
    """A custom schedule the loop can follow runs as written: stage 0 holds up to 3 micro-batches (more than
    1F1B's 2, fewer than GPipe's 8), stage 1 one; the loop keeps to those windows, and one training step
    gives the original model's loss and weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = InFlight(name="first")(keras.layers.Dense(64, activation="relu")(h))
    h = keras.layers.Dense(1024, activation="relu")(h)  # a slow second stage: the first could run ahead
    outputs = InFlight(name="second")(keras.layers.Dense(4)(h))
    model = keras.Model(inputs, outputs)
    first = ["0F0", "0F1", "0F2"] + [a for m in range(5) for a in (f"0B{m}", f"0F{m + 3}")] + ["0B5", "0B6", "0B7"]
    second = [a for m in range(8) for a in (f"1F{m}", f"1B{m}")]
    schedule = pt.Schedule.parse(f"0: {' '.join(first)}\n1: {' '.join(second)}")
    assert schedule.name == "custom" and schedule.windows() == (3, 1)
    graph = profile_model(model, batch_size=32, num_microbatches=8, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices[:2]])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=8)
    assert plan.num_stages == 2
    wrapped = wrap(model, plan, validate=False, schedule=schedule)
    assert wrapped.executor.schedule is schedule and wrapped.executor.windows() == [3, 1]
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    for runner in (wrapped, reference):
        runner.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
    loss = wrapped.train_on_batch(x, y)
    expected = reference.train_on_batch(x, y)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    ours, theirs = wrapped.unwrap().trainable_weights, reference.trainable_weights  # the counters differ
    assert len(ours) == len(theirs) == len(model.trainable_weights) == 8
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    counters = {clone.name: clone for _, clone in wrapped._state.rebuilt.origin if isinstance(clone, InFlight)}
    most = {name: float(c.most.numpy()) for name, c in counters.items()}
    assert 1.0 <= most["first"] <= 3.0 and most["second"] == 1.0, most
