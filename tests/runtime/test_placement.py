"""Placement you can trust: where each stage's forward, backward and optimizer update actually ran.

The executed graphs of one training step (``runtime.executed``, switched on in conftest) list every
node with its device, nested stage functions and their generated backward functions included. Every
stage's forward and backward kernels and its optimizer's update arithmetic must run on the stage's
planned device, for every schedule, with and without recomputation and XLA.

Before the runtime engine (commit 4ebdfcd) the same reading found every backward kernel of a
2-device MLP's second stage, and all its Adam arithmetic, on the first device.
"""

from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from zoo import ZOO

import partitioner as pt
from profiles import profile_model
from runtime import executed_placement, placement_report, wrap
from runtime.devices import canonical
from runtime.optimizer_state import slots

# with one micro-batch (M = 1) the stage functions are inlined into the step; their nodes are found by name
CASES = [
    ("mlp", 2, "gpipe", "never", False, 4),
    ("mlp", 4, "1f1b", "always", False, 4),
    ("cifar_cnn", 2, "1f1b", "never", True, 4),
    ("resnet_style", 4, "gpipe", "always", False, 4),
    ("two_in_two_out", 4, "1f1b", "never", False, 4),
    ("shared_layer", 2, "gpipe", "never", True, 4),
    ("tagger", 4, "1f1b", "always", False, 4),
    ("mlp", 2, "gpipe", "never", False, 1),
    ("resnet_style", 4, "1f1b", "always", False, 1),
    ("cifar_cnn", 2, "gpipe", "never", True, 1),
]


@pytest.mark.parametrize(("name", "num_devices", "schedule", "recompute", "jit_compile", "num_microbatches"), CASES)
def test_every_stage_runs_its_forward_backward_and_update_on_its_device(
    name: str,
    num_devices: int,
    schedule: str,
    recompute: str,
    jit_compile: bool,
    num_microbatches: int,
    virtual_devices,
) -> None:
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO[name]()
    x, y = make_batch(8, 1)
    graph = profile_model(model, batch_size=8, num_microbatches=num_microbatches, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices[:num_devices]])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=num_microbatches)
    wrapped = wrap(model, plan, validate=False, schedule=schedule, recompute=recompute)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=jit_compile)

    report = executed_placement(wrapped, x, y)

    assert not report.off_device, report.off_device[:10]
    assert report.loss.total > 0 and report.loss.on_device == report.loss.total
    # XLA runs each stage function as one compiled cluster on its call's device: TensorFlow lists the call,
    # not the body, and the report counts the call where it ran
    assert all(_too_long_to_dump(line) for line in report.unread)
    assert report.ok == (not report.unread)
    for stage, forward, backward, update, compiled in zip(
        wrapped.executor.stages, report.forward, report.backward, report.optimizer, report.compiled, strict=True
    ):
        assert compiled.on_device == compiled.total
        assert (compiled.total > 0) == (jit_compile and bool(stage.nodes))  # XLA per stage, and only with XLA
        if stage.nodes:  # a stage of input layers only computes nothing
            assert forward.total > 0 or (jit_compile and compiled.total > 0)
        if stage.trainable_variables:
            assert backward.total > 0 or (jit_compile and compiled.total > 0)
            assert backward.on_device == backward.total
            assert update.total >= len(stage.trainable_variables)  # at least one write per variable
            assert update.on_device == update.total


def _too_long_to_dump(unread: str) -> bool:
    """True iff the function an unread line names has a name too long for TensorFlow's dump file (255
    characters with the partition suffix; it logs 'Failed to dump graph' and writes nothing): with
    recomputation a specialised nested body gets such a name."""
    function = re.search(r" of '([^']+)'", unread)[1]
    suffix = "_partition__job:localhost_replica:0_task:0_device:CPU:0.0000.main.after_partition_passes.pb"
    return len(function + suffix) > 255


def _two_stage(name: str, devices, num_microbatches: int = 2, optimizer=None, batch: int = 8):
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO[name]() if isinstance(name, str) else name
    x, y = make_batch(batch, 1)
    graph = profile_model(model, batch_size=batch, num_microbatches=num_microbatches, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in devices])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=num_microbatches)
    assert plan.num_stages == len(devices)
    wrapped = wrap(model, plan, validate=False)
    wrapped.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3), loss=loss)
    return wrapped, x, y


def test_an_xla_call_on_another_device_is_off_its_device(virtual_devices, monkeypatch) -> None:
    """An XLA-compiled stage function runs wholly on its call's device: a call of stage 1's compiled forward
    read on the first device (as if TensorFlow had placed it there) is reported off its device, and not ok."""
    from runtime import executed

    wrapped, x, y = _two_stage("mlp", virtual_devices[:2])
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ZOO["mlp"]()[2], jit_compile=True)
    collect = executed.collect_executed
    moved = []

    def misplaced(fn, *args, **kwargs):
        result, nodes = collect(fn, *args, **kwargs)
        for i, node in enumerate(nodes):
            if node.compiled and "stage1_forward" in node.calls:
                nodes[i] = dataclasses.replace(node, device=canonical(virtual_devices[0]))
                moved.append(node.name)
        return result, nodes

    monkeypatch.setattr(executed, "collect_executed", misplaced)
    report = executed_placement(wrapped, x, y)

    assert moved and not report.ok
    assert report.compiled[1].on_device == report.compiled[1].total - len(moved)
    assert any(o.startswith(f"stage 1 forward: XLA call '{moved[0]}'") for o in report.off_device), report.off_device
    assert report.compiled[0].on_device == report.compiled[0].total > 0


@keras.saving.register_keras_serializable("test_placement")
class _NestedOnDevice(keras.layers.Layer):
    """A Dense-like layer whose matmul runs in a nested function TensorFlow never inlines, under a device
    of its own when ``device`` is set: work off its stage's device, inside a body called from the stage."""

    def __init__(self, device: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.device = device

    def build(self, shape) -> None:
        self.kernel = self.add_weight(shape=(shape[-1], 8), name="kernel")

        def nested_matmul(x):
            with tf.device(self.device or None):
                return tf.matmul(x, self.kernel.value)

        self.nested = tf.function(nested_matmul, experimental_attributes={"_noinline": True})

    def call(self, x):
        return self.nested(x)

    def compute_output_shape(self, shape):
        return (*shape[:-1], 8)

    def get_config(self):
        return {**super().get_config(), "device": self.device}


@pytest.mark.parametrize("off", [False, True])
def test_executed_placement_reads_nested_function_bodies(off: bool, virtual_devices) -> None:
    """Issue 18, item 16: a function a stage calls and TensorFlow does not inline is placed on its own;
    its body's nodes count for the stage, and one on another device is seen (it was left out before)."""
    device = virtual_devices[3] if off else ""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(3)(_NestedOnDevice(device, name="nested")(hidden))

    def make_batch(rows, seed):
        rng = np.random.default_rng(seed)
        return rng.normal(size=(rows, 6)).astype("float32"), rng.normal(size=(rows, 3)).astype("float32")

    wrapped, x, y = _two_stage((keras.Model(inputs, outputs), make_batch, "mse"), virtual_devices[:2])
    stage = next(s.index for s in wrapped.executor.stages if any(n.operation.name == "nested" for n in s.nodes))

    report = executed_placement(wrapped, x, y)

    assert not report.unread
    line = f"stage {stage} forward: _MklMatMul"
    if off:
        assert not report.ok
        assert any(o.startswith(f"stage {stage} forward") and virtual_devices[3] in o for o in report.off_device)
        assert report.forward[stage].on_device < report.forward[stage].total
    else:
        assert report.ok, report.off_device
        assert not any(line in o for o in report.off_device)


def test_executed_placement_reports_the_loss_and_the_steps_other_ops(virtual_devices) -> None:
    """The loss function's ops are judged against the last stage's device; the step's own ops (micro-batch
    slicing, the loop, sums) are counted per device, here also on a device no stage uses (the default one)."""
    wrapped, x, y = _two_stage("mlp", virtual_devices[1:3])
    report = executed_placement(wrapped, x, y)
    assert report.ok, report.off_device
    assert report.loss.total > 0 and report.loss.on_device == report.loss.total
    assert report.outside.get(canonical(virtual_devices[0]), 0) > 0  # TensorFlow's default device
    assert set(report.outside) <= {canonical(d) for d in virtual_devices[:3]}
    rows = {row for row in report.table().columns[1]._cells}
    assert canonical(virtual_devices[0]) in rows  # shown, though no stage runs there


def _misplacing_slots(optimizer, source: str, target: str):
    """Makes ``optimizer`` create the slots of the variables on device ``source`` on device ``target``.

    Keras' TensorFlow optimizer colocates a slot with its variable (``add_variable_from_reference``);
    its base class does not, so a device scope around it wins (Keras 3.15)."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        if canonical(reference_variable.value.device) != canonical(source):
            return type(optimizer).add_variable_from_reference(optimizer, reference_variable, name, initializer)
        with tf.device(target):
            return BaseOptimizer.add_variable_from_reference(optimizer, reference_variable, name, initializer)

    optimizer.add_variable_from_reference = add_variable_from_reference
    return optimizer


def test_adam_slots_sit_beside_their_variables_on_a_three_stage_plan(virtual_devices) -> None:
    wrapped, x, y = _two_stage("mlp", virtual_devices[:3])
    pairs = slots(wrapped.optimizer, wrapped.trainable_variables)
    assert len(pairs) == 2 * len(wrapped.trainable_variables)  # Adam's two moments per variable
    assert len({canonical(v.value.device) for _, v in pairs}) == 3
    assert all(canonical(s.value.device) == canonical(v.value.device) for s, v in pairs)
    assert placement_report(wrapped).ok
    assert executed_placement(wrapped, x, y).ok


@pytest.mark.parametrize("where", ["other stage", "no stage"])
def test_misplaced_adam_slots_are_reported(where: str, virtual_devices) -> None:
    """The last stage's slots on the first stage's device, or on a device no stage uses (whose writes the
    report used to drop)."""
    devices = virtual_devices[:2] if where == "other stage" else virtual_devices[1:3]
    target = devices[0] if where == "other stage" else virtual_devices[3]
    optimizer = _misplacing_slots(keras.optimizers.Adam(1e-3), devices[1], target)
    wrapped, x, y = _two_stage("mlp", devices, optimizer=optimizer)
    num_slots = 2 * len(wrapped.executor.stages[1].trainable_variables)  # Adam's two moments
    lines = [line for line in placement_report(wrapped).misplaced if "optimizer slot" in line]
    assert len(lines) == num_slots and all(f"on {canonical(target)}," in line for line in lines)

    report = executed_placement(wrapped, x, y)

    assert not report.ok
    assert sum("optimizer slot" in line for line in report.off_device) == num_slots
    if where == "no stage":
        assert sum("a device no stage uses" in line for line in report.off_device) == num_slots  # their writes


def test_executed_placement_sees_work_on_the_wrong_device(virtual_devices) -> None:
    """The check can fail: an optimizer whose updates are not placed computes them on the default device."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["mlp"]()
    x, y = make_batch(8, 1)
    graph = profile_model(model, batch_size=8, num_microbatches=2, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices[:2]])
    wrapped = wrap(model, pt.baselines.uniform(graph, cluster, num_microbatches=2), validate=False)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    optimizer = wrapped.optimizer
    del optimizer.update_step, optimizer._apply_weight_decay  # undo runtime's placement: Keras' own methods
    report = executed_placement(wrapped, x, y)
    assert not report.ok
    assert report.optimizer[1].on_device < report.optimizer[1].total
    assert any("computed on another device" in line for line in report.off_device)


def test_a_plan_that_reverses_the_device_order_runs_each_stage_on_its_planned_device(virtual_devices) -> None:
    """Plan.devices is the pipeline order the planner chose: stage 0 runs on the plan's first device,
    also when that is the cluster's last."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["mlp"]()
    x, y = make_batch(8, 1)
    graph = profile_model(model, batch_size=8, num_microbatches=2, measure_time=False)
    first, second = virtual_devices[:2]
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in (second, first)])  # reversed
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=2)
    assert plan.stages == (second, first)
    pt.validate_plan(plan, graph, pt.Cluster([pt.Device(d, memory="4GiB") for d in (first, second)]))
    wrapped = wrap(model, plan, validate=True)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)

    report = executed_placement(wrapped, x, y)

    assert report.ok, report.off_device[:10]
    assert report.stages == (canonical(second), canonical(first))  # stage 0 on the cluster's second device
    for forward in report.forward:
        assert forward.total > 0 and forward.on_device == forward.total


def test_with_one_microbatch_the_stage_functions_are_inlined_and_still_on_their_devices(virtual_devices) -> None:
    # M = 1 calls each stage function once per step: it runs inlined, as plain Keras' one graph does (no
    # executed graph of its own), and the report finds its nodes by the call's name scope.
    from runtime import executed

    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["mlp"]()
    x, y = make_batch(8, 1)
    graph = profile_model(model, batch_size=8, num_microbatches=1, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices[:2]])
    wrapped = wrap(model, pt.baselines.uniform(graph, cluster, num_microbatches=1), validate=False)
    wrapped.compile(optimizer="adam", loss=loss)
    _, nodes = executed.collect_executed(wrapped.train_on_batch, x, y)
    assert not [n.graph for n in nodes if "stage0_forward" in n.graph or "stage1_forward" in n.graph]
    inlined = {(n.name.split("/")[0], canonical(n.device)) for n in nodes if n.op == "MatMul" or "MatMul" in n.op}
    assert ("stage0_forward", canonical(virtual_devices[0])) in inlined
    assert ("stage1_backward", canonical(virtual_devices[1])) in inlined
    report = executed_placement(wrapped, x, y)
    assert report.ok and all(f.total > 0 for f in report.forward) and all(b.total > 0 for b in report.backward)


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_the_batch_is_split_into_microbatches_on_the_first_stage_device(num_microbatches, virtual_devices) -> None:
    """The cost model charges the batch split into micro-batches (inputs and targets) to the first stage:
    the split runs there, not on TensorFlow's default device (here a device no stage uses). A batch of 9
    rows, which M does not divide: the rows are gathered, repeats included (one M divides is reshaped)."""
    wrapped, x, y = _two_stage("mlp", virtual_devices[1:3], num_microbatches=num_microbatches, batch=9)
    specs = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    graph = tf.function(wrapped.train_step).get_concrete_function(specs).graph
    splits = [op for op in graph.get_operations() if op.type == "GatherV2"]
    assert len(splits) == 2  # the inputs and the targets, each [B, ...] -> [M, ceil(B / M), ...]
    assert {canonical(op.device) for op in splits} == {canonical(virtual_devices[1])}


def test_each_input_is_split_on_its_input_layers_device(virtual_devices) -> None:
    """The cost model charges each input's M micro-batches to the device of its InputLayer node: with
    input "b" on the second stage, its split runs there; input "a" and the targets split on the first."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["two_in_two_out"]()
    x, y = make_batch(9, 1)  # M = 4 does not divide 9: each input's rows are gathered
    graph = profile_model(model, batch_size=9, num_microbatches=4, measure_time=False)
    first, second = virtual_devices[1:3]
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in (first, second)])
    pins = {"a": first, "b": second, **{v: second for v in graph.successors("b")}}
    plan = pt.solve(graph, cluster, num_microbatches=4, pins=pins, time_limit_s=5)
    assert plan.num_stages == 2 and plan.assignment["a"] == first and plan.assignment["b"] == second
    wrapped = wrap(model, plan)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    specs = keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), (x, y))
    step = tf.function(wrapped.train_step).get_concrete_function(specs).graph
    splits = [canonical(op.device) for op in step.get_operations() if op.type == "GatherV2"]
    assert len(splits) == 4  # inputs a and b, the targets of both outputs
    assert sorted(splits) == sorted([canonical(first)] * 3 + [canonical(second)])


@pytest.mark.parametrize("step", ["train", "evaluate"])
def test_no_collected_tensor_list_crosses_devices(step: str, virtual_devices) -> None:
    """What the loop collects (each micro-batch's model outputs on the last stage, a deferred batch norm's
    statistics on its stage) is a TensorArray carried from iteration to iteration: made on another device
    than its writer's, the loop sends it there and back in every iteration, which on GPUs copies every
    tensor written so far. None crosses: no TensorList (DT_VARIANT) is sent between devices, in the
    pipeline's loop, the metrics' loop after it, or after them."""
    from runtime import executed

    wrapped, x, y = _two_stage("resnet_style", virtual_devices[:2], num_microbatches=4)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.01), loss=wrapped.loss, metrics=["accuracy"])
    run = wrapped.train_on_batch if step == "train" else wrapped.test_on_batch
    _, nodes = executed.collect_executed(run, x, y)
    written = {n.device for n in nodes if n.op == "TensorListSetItem"}
    # outputs on the last stage; in training, batch norm statistics on the first too
    assert written == ({*virtual_devices[:2]} if step == "train" else {virtual_devices[1]})
    sends = ("_Send", "_Recv", "_HostSend", "_HostRecv")
    crossing = [n.name for n in nodes if n.op in sends and n.dtype == "DT_VARIANT"]
    assert crossing == []
