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
    return _reset(wrap(model, plan, validate=False, schedule=schedule))


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


def _recomputing() -> bool:
    """True while a stage's recomputing forward is traced: ``runtime.program`` names its function
    ``stage<s>_recompute`` (the graph being built, or one it is built inside)."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(graph, "name", "").split("_")[1:2] == ["recompute"]:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


@keras.saving.register_keras_serializable(package="tests")
class InFlight(keras.layers.Layer):
    """Identity that counts the micro-batches between its forward and its backward: +1 ``held`` in the
    forward, -1 in the backward (a custom gradient), and keeps the most it saw. In a recomputing stage
    the forward that keeps only the stage's inputs counts ``held`` and the forward run again in the
    backward counts ``alive`` (its activations exist until its backward is done), both -1 in the backward."""

    def build(self, input_shape) -> None:
        # TensorFlow's variables, not the layer's weights: a recomputing forward puts the stage's
        # non-trainable weights back (``StageProgram.restored``), and would undo the counts
        self.held, self.most, self.alive, self.most_alive = (tf.Variable(0.0, trainable=False) for _ in range(4))

    def call(self, x):
        recomputed = _recomputing()
        held, most = (self.alive, self.most_alive) if recomputed else (self.held, self.most)
        released = [self.alive, self.held] if recomputed else [self.held]

        @tf.custom_gradient
        def counted(x):
            now = held.assign_add(1.0)
            with tf.control_dependencies([most.assign(tf.maximum(most, now))]):
                y = tf.identity(x)

            def backward(dy):
                with tf.control_dependencies([counter.assign_sub(1.0) for counter in released]):
                    return tf.identity(dy)

            return y, backward

        return counted(x)


def _counters(wrapped) -> dict[str, InFlight]:
    """The InFlight layers of the wrapped model (its clones on their devices), by name."""
    return {layer.name: layer for layer in wrapped._state.rebuilt.model.layers if isinstance(layer, InFlight)}


def _reset(wrapped):
    """Zeroes the counters of the wrapped model's InFlight layers: the wrap ran the rebuilt model once in inference
    (``runtime.supported.check_rebuilt``), a forward without a backward, on TensorFlow variables it does not put
    back (not the layer's weights, on purpose)."""
    for layer in _counters(wrapped).values():
        for counter in (layer.held, layer.most, layer.alive, layer.most_alive):
            counter.assign(0.0)
    return wrapped


def _counts(wrapped) -> dict[str, dict[str, float]]:
    """Per InFlight layer of the wrapped model: what it holds now and the most it saw."""
    counters = _counters(wrapped)
    names = ("held", "most", "alive", "most_alive")
    return {name: {k: float(getattr(c, k).numpy()) for k in names} for name, c in counters.items()}


def _slow_second_stage() -> keras.Model:
    """Dense, Dense, InFlight "first" | Dense(1024), Dense, InFlight "second": the uniform plan cuts it in two,
    and the slow second stage lets the first run ahead."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = InFlight(name="first")(keras.layers.Dense(64, activation="relu")(h))
    h = keras.layers.Dense(1024, activation="relu")(h)  # a slow second stage: the first could run ahead
    outputs = InFlight(name="second")(keras.layers.Dense(4)(h))
    return keras.Model(inputs, outputs)


def _one_step_as_the_original(wrapped, model, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Compiles ``wrapped`` and a copy of ``model`` alike (SGD, mean squared error), takes one step of each on
    the same batch of ``rows`` and checks the losses and the weights after it (the InFlight counters aside)
    agree; returns the batch."""
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    for runner in (wrapped, reference):
        runner.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(rows, 8)).astype("float32"), rng.normal(size=(rows, 4)).astype("float32")
    np.testing.assert_allclose(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y), rtol=1e-5)
    ours, theirs = wrapped.unwrap().trainable_weights, reference.trainable_weights
    assert len(ours) == len(theirs) == len(model.trainable_weights)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    return x, y


def _custom_schedule() -> pt.Schedule:
    """K = 2, M = 8: stage 0 holds up to 3 micro-batches (between 1F1B's 2 and GPipe's 8), stage 1 one."""
    first = ["0F0", "0F1", "0F2"] + [a for m in range(5) for a in (f"0B{m}", f"0F{m + 3}")] + ["0B5", "0B6", "0B7"]
    second = [a for m in range(8) for a in (f"1F{m}", f"1B{m}")]
    return pt.Schedule.parse(f"0: {' '.join(first)}\n1: {' '.join(second)}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatches_overlap_up_to_the_schedules_bound(schedule: str, virtual_devices) -> None:
    """The loop's iterations overlap: under GPipe (M = 8, K = 2) the first stage runs the forwards of
    several micro-batches before the slow second stage sends their gradients back (built with
    TensorFlow's automatic control dependencies, the iterations ran one after the other: 1 at most);
    1F1B holds at most K - s: 2 on stage 0, 1 on stage 1, counted where each stage's forward ends. The
    last stage holds one under either schedule: its backward runs right after its forward."""
    model = _slow_second_stage()
    wrapped = _wrapped(model, virtual_devices[:2], 8, schedule, batch=32)
    assert [wrapped.plan.assignment[n] for n in ("first", "second")] == list(virtual_devices[:2])
    wrapped.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
    for _ in range(3):
        wrapped.train_on_batch(x, y)
    counters = _counters(wrapped)
    assert {name: float(c.held.numpy()) for name, c in counters.items()} == {"first": 0.0, "second": 0.0}
    most = {name: float(c.most.numpy()) for name, c in counters.items()}
    if schedule == "gpipe":
        assert most["first"] >= 3.0 and most["second"] == 1.0, most
    else:
        assert 1.0 <= most["first"] <= 2.0 and most["second"] == 1.0, most


def test_one_stage_sums_its_gradients_beside_the_next_forward(virtual_devices) -> None:
    """One stage (window 1, M = 4): the loop still runs two iterations at once, so the sums of micro-batch
    m's gradients run beside micro-batch m + 1's forward (one iteration at a time, the stage waited for its
    sums every micro-batch), while the stage holds one micro-batch; the step is the original's."""
    model = _slow_second_stage()
    graph = profile_model(model, batch_size=32, num_microbatches=4, measure_time=False)
    plan = pt.baselines.uniform(graph, pt.Cluster([pt.Device(virtual_devices[0], memory="4GiB")]), num_microbatches=4)
    wrapped = _reset(wrap(model, plan, validate=False))
    assert plan.num_stages == 1 and wrapped.executor.windows() == [1]
    x, y = _one_step_as_the_original(wrapped, model, rows=32)
    assert {name: float(c.most.numpy()) for name, c in _counters(wrapped).items()} == {"first": 1.0, "second": 1.0}
    specs = (tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(y.shape, tf.float32))
    step = tf.function(wrapped.train_step).get_concrete_function(specs).graph
    loops = [op for op in step.get_operations() if op.type in ("While", "StatelessWhile")]
    assert [op.get_attr("parallel_iterations") for op in loops] == [2]


def test_custom_schedule_runs_with_its_own_windows(virtual_devices) -> None:
    """A custom schedule the loop can follow runs as written: stage 0 holds up to 3 micro-batches (more than
    1F1B's 2, fewer than GPipe's 8), stage 1 one; the loop keeps to those windows, and one training step
    gives the original model's loss and weights."""
    model = _slow_second_stage()
    schedule = _custom_schedule()
    assert schedule.name == "custom" and schedule.windows() == (3, 1)
    graph = profile_model(model, batch_size=32, num_microbatches=8, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices[:2]])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=8)
    assert plan.num_stages == 2
    wrapped = _reset(wrap(model, plan, validate=False, schedule=schedule))
    assert wrapped.executor.schedule is schedule and wrapped.executor.windows() == [3, 1]
    _one_step_as_the_original(wrapped, model, rows=32)
    assert len(model.trainable_weights) == 8  # the counters aside
    counters = _counters(wrapped)
    most = {name: float(c.most.numpy()) for name, c in counters.items()}
    assert 1.0 <= most["first"] <= 3.0 and most["second"] == 1.0, most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "custom"])
def test_recomputing_stage_holds_its_window_and_one_microbatchs_activations(schedule: str, virtual_devices) -> None:
    """With recomputation (M = 8, K = 2, a slow first stage whose backwards could pile up): stage 0 keeps
    the inputs of at most its window's micro-batches (GPipe 8, and more than one: they overlap; 1F1B 2;
    the custom schedule 3) and the activations of one micro-batch at a time, those of the forward run
    again in its backward (the loop ran several of a stage's recomputing backwards at once, each with a
    micro-batch's activations, so recomputation saved nothing); stage 1, the last, never recomputes and
    holds one micro-batch under every schedule (under GPipe its forwards ran ahead of its backwards, up
    to M). One step gives the original model's loss."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(1024, activation="relu")(inputs)  # a slow first stage: its backwards could overlap
    h = InFlight(name="first")(keras.layers.Dense(1024, activation="relu")(h))
    outputs = InFlight(name="second")(keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(h)))
    model = keras.Model(inputs, outputs)
    graph = profile_model(model, batch_size=64, num_microbatches=8, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices[:2]])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=8)
    assert plan.num_stages == 2
    assert [plan.assignment[n] for n in ("first", "second")] == list(virtual_devices[:2])
    order = _custom_schedule() if schedule == "custom" else schedule
    wrapped = _reset(wrap(model, plan, validate=False, schedule=order, recompute="always"))
    assert wrapped.executor.options.recomputes(0) and not wrapped.executor.options.recomputes(1)
    window = {"gpipe": 8, "1f1b": 2, "custom": 3}[schedule]
    assert wrapped.executor.windows() == [window, 1]
    x, y = _one_step_as_the_original(wrapped, model, rows=64)
    for _ in range(3):
        wrapped.train_on_batch(x, y)
    counts = _counts(wrapped)
    assert all(c["held"] == c["alive"] == 0.0 for c in counts.values()), counts
    first, second = counts["first"], counts["second"]
    assert 1.0 <= first["most"] <= window and first["most_alive"] == 1.0, counts
    if schedule == "gpipe":
        assert first["most"] >= 2.0, counts  # the micro-batches still overlap
    assert second["most"] == 1.0 and second["most_alive"] == 0.0, counts
