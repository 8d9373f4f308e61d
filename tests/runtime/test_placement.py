"""Placement you can trust: where each stage's forward, backward and optimizer update actually ran.

The executed graphs of one training step (``runtime.executed``, switched on in conftest) list every
node with its device, nested stage functions and their generated backward functions included. Every
stage's forward and backward kernels and its optimizer's update arithmetic must run on the stage's
planned device, for every schedule, with and without recomputation and XLA.

Before the runtime engine (commit 4ebdfcd) the same reading found every backward kernel of a
2-device MLP's second stage, and all its Adam arithmetic, on the first device.
"""

from __future__ import annotations

import keras
import pytest
from zoo import ZOO

import partitioner as pt
from profiles import profile_model
from runtime import executed_placement, wrap
from runtime.devices import canonical

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

    assert report.ok, report.off_device[:10]
    for stage, forward, backward, update in zip(
        wrapped.executor.stages, report.forward, report.backward, report.optimizer, strict=True
    ):
        if stage.nodes:  # a stage of input layers only computes nothing
            assert forward.total > 0
        if stage.trainable_variables:
            assert backward.total > 0 and backward.on_device == backward.total
            assert update.total >= len(stage.trainable_variables)  # at least one write per variable
            assert update.on_device == update.total


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
