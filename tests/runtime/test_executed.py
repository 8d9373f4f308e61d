"""collect_executed and variable_writes on a two-stage toy: nested stage functions, micro-batches, per-stage tapes."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import keras
import pytest
import tensorflow as tf

from partitioner.errors import InputError
from runtime import executed
from runtime.devices import canonical

# TensorFlow reads the switch once, when it places its first function; test modules are imported
# before any test runs, so this is early enough (conftest only makes the logical devices).
executed.enable_collection()

NUM_MICROBATCHES = 4
HEAVY_KERNELS = ("MatMul", "BiasAdd", "Relu")  # MatMul, _MklMatMul, _MklNativeFusedMatMul, BiasAddGrad, ReluGrad...


def _two_stage_step(devices, *, backward_on_stage_devices=True, update="sgd"):
    """A step like the pipeline's: stage k's Dense layer on devices[k], called as a nested function.

    For each micro-batch it records each stage call on its own tape, takes the loss on stage 1, and
    runs the backward of stage 1 then stage 0 (under their devices unless ``backward_on_stage_devices``
    is False); then it sums each stage's gradients on its device and updates every variable under its
    device, with plain SGD ("sgd"), Keras' Adam one variable at a time ("adam"), or Keras' Adam
    ``apply_gradients`` called once without a device scope ("adam_unscoped").
    """
    layers = []
    for k in range(2):
        with tf.device(devices[k]):
            layer = keras.layers.Dense(8, activation="relu")
            layer.build((None, 8))
            layers.append(layer)
    optimizer = keras.optimizers.Adam(1e-2) if update != "sgd" else None
    if optimizer is not None:
        optimizer.build([v for layer in layers for v in layer.trainable_variables])

    def stage_fn(k):
        def forward(x):
            with tf.name_scope(f"stage{k}"):
                return layers[k](x)

        forward.__name__ = f"stage{k}_forward"  # the function's graphs are named after it
        return tf.function(forward, experimental_attributes={"_noinline": True})

    stages = [stage_fn(0), stage_fn(1)]

    def on_device(k):
        return tf.device(devices[k]) if backward_on_stage_devices else contextlib.nullcontext()

    @tf.function
    def step(x, y):
        size = x.shape[0] // NUM_MICROBATCHES
        sums = [None, None]
        for m in range(NUM_MICROBATCHES):
            xm, ym = x[m * size : (m + 1) * size], y[m * size : (m + 1) * size]
            with tf.device(devices[0]), tf.GradientTape() as tape0:
                tape0.watch(xm)
                h = stages[0](xm)
            with tf.device(devices[1]), tf.GradientTape() as tape1:
                tape1.watch(h)
                loss = tf.reduce_mean((stages[1](h) - ym) ** 2)
            with on_device(1):
                grad_h, *grads1 = tape1.gradient(loss, [h, *layers[1].trainable_variables])
            with on_device(0):
                grads0 = tape0.gradient(h, layers[0].trainable_variables, output_gradients=grad_h)
            for k, grads in enumerate((grads0, grads1)):
                with tf.device(devices[k]):
                    sums[k] = grads if sums[k] is None else [a + b for a, b in zip(sums[k], grads, strict=True)]
        variables = [v for layer in layers for v in layer.trainable_variables]
        grads = sums[0] + sums[1]
        if update == "adam_unscoped":
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            return loss
        for variable, grad in zip(variables, grads, strict=True):
            with tf.device(canonical(variable.value.device)):
                if update == "sgd":
                    variable.assign_sub(0.1 * grad)
                else:
                    optimizer.update_step(grad, variable, tf.cast(optimizer.learning_rate, variable.dtype))
        if update != "sgd":
            optimizer.iterations.assign_add(1)
        return loss

    x = tf.random.stateless_normal((16, 8), seed=(1, 2))
    y = tf.random.stateless_normal((16, 8), seed=(3, 4))
    return step, x, y, layers


def _stage_of(graph: str) -> int | None:
    """0 or 1 for the forward or backward function of a stage, None for the outer step."""
    found = re.search(r"stage(\d)_forward", graph)
    return int(found[1]) if found else None


def _misplaced(nodes, devices) -> list[str]:
    """Heavy kernels of a stage's forward or backward function that ran off that stage's device."""
    return [
        f"{n.graph}: {n.name} ({n.op}) on {n.device}, stage {_stage_of(n.graph)} is on {devices[_stage_of(n.graph)]}"
        for n in nodes
        if _stage_of(n.graph) is not None
        and any(k in n.op for k in HEAVY_KERNELS)
        and n.device != devices[_stage_of(n.graph)]
    ]


def _matmuls(nodes, prefix: str, stage: int) -> list[executed.ExecutedNode]:
    return [n for n in nodes if n.graph.startswith(prefix) and _stage_of(n.graph) == stage and "MatMul" in n.op]


@pytest.mark.parametrize("update", ["sgd", "adam"])
def test_collect_executed_runs_each_stage_forward_and_backward_on_its_device(virtual_devices, update) -> None:
    devices = virtual_devices[:2]
    step, x, y, _ = _two_stage_step(devices, update=update)
    loss, nodes = executed.collect_executed(step, x, y)
    assert float(loss) > 0
    assert all(re.fullmatch(r"/device:CPU:\d", n.device) for n in nodes)
    for k in (0, 1):
        forward = _matmuls(nodes, f"__forward_stage{k}_forward", k)
        backward = _matmuls(nodes, f"__inference___backward_stage{k}_forward", k)
        assert forward and {n.device for n in forward} == {devices[k]}
        assert len(backward) >= 1 + k and {n.device for n in backward} == {devices[k]}  # stage 0 has no input grad
    assert _misplaced(nodes, devices) == []


def test_collect_executed_shows_a_backward_taken_outside_the_stage_device(virtual_devices) -> None:
    devices = virtual_devices[:2]
    step, x, y, _ = _two_stage_step(devices, backward_on_stage_devices=False)
    _, nodes = executed.collect_executed(step, x, y)
    misplaced = _misplaced(nodes, devices)
    assert any("__backward_stage1_forward" in line and "MatMul" in line for line in misplaced), misplaced
    assert {n.device for n in _matmuls(nodes, "__forward_stage1_forward", 1)} == {devices[1]}


@pytest.mark.parametrize("update", ["sgd", "adam"])
def test_variable_writes_finds_the_update_arithmetic_on_the_variable_device(virtual_devices, update) -> None:
    devices = virtual_devices[:2]
    step, x, y, layers = _two_stage_step(devices, update=update)
    _, nodes = executed.collect_executed(step, x, y)
    writes = [w for w in executed.variable_writes(nodes) if w.write.device == devices[1]]
    assert len(writes) >= len(layers[1].trainable_variables)  # kernel and bias (and Adam's two slots each)
    for write in writes:
        ops = {f.op for f in write.feeders}
        assert ops & {"Mul", "Sub", "AddV2"}, (write.write.name, ops)  # computed here, not only received
    if update == "adam":
        assert any("Sqrt" in {f.op for f in w.feeders} for w in writes)  # Adam's variable step, on its device


def test_variable_writes_shows_update_arithmetic_done_on_another_device(virtual_devices) -> None:
    devices = virtual_devices[:2]
    step, x, y, _ = _two_stage_step(devices, update="adam_unscoped")
    _, nodes = executed.collect_executed(step, x, y)
    writes = [w for w in executed.variable_writes(nodes) if w.write.device == devices[1]]
    assert writes
    assert all({f.op for f in w.feeders} == {"_Recv"} for w in writes)  # Keras computed them on devices[0]


def test_collect_executed_lists_only_what_the_call_placed(virtual_devices) -> None:
    first, x, y, _ = _two_stage_step(virtual_devices[:2])
    _, first_nodes = executed.collect_executed(first, x, y)
    with pytest.raises(InputError, match="placed no new function"):
        executed.collect_executed(first, x, y)
    second, x, y, _ = _two_stage_step(virtual_devices[2:4])
    _, second_nodes = executed.collect_executed(second, x, y)
    assert not {n.graph for n in first_nodes} & {n.graph for n in second_nodes}
    assert {n.device for n in second_nodes if _stage_of(n.graph) is not None} == set(virtual_devices[2:4])


def test_collect_executed_says_when_collection_was_not_enabled_in_time() -> None:
    script = """
import tensorflow as tf
from partitioner.errors import InputError
from runtime import executed
from runtime.devices import canonical
try:
    executed.collect_executed(lambda: None)
except InputError as err:
    print("NOT ENABLED:", err)
tf.function(lambda: tf.constant(1.0) * 2.0)()
executed.enable_collection()
try:
    executed.collect_executed(lambda: None)
except InputError as err:
    print("TOO LATE:", err)
"""
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": ""}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root)
    assert "NOT ENABLED: TensorFlow's graph dumps are off" in run.stdout, run.stderr[-2000:]
    assert "TOO LATE: enable_collection() ran after TensorFlow had placed its first function" in run.stdout


def test_variable_writes_judges_the_value_written_not_any_feeder(virtual_devices) -> None:
    """A scatter whose indices are computed on the variable's device but whose rows come from another
    device writes a value computed elsewhere: a local feeder (the indices' ArgMax) does not make it local."""
    first, second = virtual_devices[:2]
    with tf.device(second):
        table = tf.Variable(tf.zeros([4, 3]))
        counter = tf.Variable(0.0)

    @tf.function
    def step(rows, scores):
        with tf.device(first):
            received = rows * 2.0  # computed on the first device
        with tf.device(second):
            indices = tf.argmax(scores, axis=1, output_type=tf.int32)  # computed here
            table.scatter_add(tf.IndexedSlices(received, indices))
            counter.assign_add(tf.reduce_sum(scores))  # computed here
        return indices

    rows = tf.random.stateless_normal((2, 3), seed=(1, 2))
    scores = tf.random.stateless_normal((2, 4), seed=(3, 4))
    _, nodes = executed.collect_executed(step, rows, scores)
    writes = {w.write.op: w for w in executed.variable_writes(nodes) if w.write.device == second}
    scatter, add = writes["ResourceScatterAdd"], writes["AssignAddVariableOp"]
    assert "ArgMax" in {f.op for f in scatter.feeders}  # a local feeder, which the old rule took as enough
    assert [v.op for v in scatter.values] == ["_Recv"]
    assert not scatter.computed_here
    assert add.computed_here and add.values[0].op == "Sum"
