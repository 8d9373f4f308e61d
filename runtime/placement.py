"""Where things really are: the devices of each stage's variables, and of the ops a training step executed."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.table import Table

from profiles.shapes import InputShapes
from runtime.devices import canonical


@dataclass(frozen=True)
class PlacementReport:
    """Observed placement of a PipelinedModel, to check against its plan."""

    planned: dict[str, str]  # node -> device the plan names
    variable_devices: dict[str, list[str]]  # node -> devices of its variables, as TensorFlow reports them
    op_devices: dict[str, int]  # device -> number of ops placed there in the traced forward pass
    misplaced: list[str] = field(default_factory=list)  # "node: variable on X, plan says Y"

    @property
    def ok(self) -> bool:
        """True iff every variable lives on the device its plan names."""
        return not self.misplaced

    def table(self) -> Table:
        """Per device: the nodes, variables and traced ops found there."""
        table = Table(title="Observed placement", box=box.SIMPLE_HEAD, title_justify="left")
        for header in ("device", "nodes (plan)", "variables there", "ops traced there"):
            table.add_column(header, justify="left" if header == "device" else "right")
        devices = sorted(set(self.planned.values()) | set(self.op_devices))
        for device in devices:
            nodes = [n for n, d in self.planned.items() if d == device]
            num_vars = sum(devs.count(device) for devs in self.variable_devices.values())
            table.add_row(device, str(len(nodes)), str(num_vars), str(self.op_devices.get(device, 0)))
        return table


def placement_report(model: Any) -> PlacementReport:
    """Reads the devices of ``model``'s variables and of the ops of its traced forward pass.

    Args:
        model: a PipelinedModel.

    Example:
        >>> report = placement_report(wrapped)     # doctest: +SKIP
        >>> report.ok                              # doctest: +SKIP
        True
    """
    import tensorflow as tf

    rebuilt = model._state.rebuilt
    planned = {node: canonical(device) for node, device in model.plan.assignment.items()}
    variable_devices: dict[str, list[str]] = {}
    misplaced: list[str] = []
    for _, clone in rebuilt.origin:
        node = rebuilt.node_of[id(clone)]
        devices = [canonical(v.value.device) for v in clone.weights]
        variable_devices[node] = devices
        for variable, device in zip(clone.weights, devices):
            if device != planned[node]:
                misplaced.append(f"{node}: variable '{variable.path}' on {device}, the plan says {planned[node]}")

    specs = [tf.TensorSpec(t.shape, t.dtype) for t in model.staged.inputs]
    import keras

    struct = model.staged._inputs_struct  # a list, one tensor, or a dict (keras-hub models)
    forward = tf.function(lambda *xs: model(keras.tree.pack_sequence_as(struct, xs), training=False))
    graph = forward.get_concrete_function(*specs).graph
    counts: Counter[str] = Counter(canonical(op.device) for op in graph.get_operations() if op.device)
    return PlacementReport(planned, variable_devices, dict(counts), misplaced)


# Nodes that move or name data rather than compute it: left out of the shares.
_PLUMBING = {
    "_Arg", "_Retval", "_DeviceArg", "_DeviceRetval", "NoOp", "Const", "HostConst", "Identity", "IdentityN",
    "_Send", "_Recv", "_HostSend", "_HostRecv", "ReadVariableOp", "VarHandleOp", "Placeholder",
    # the loop over micro-batches: frames and their edges (also control edges into a stage's function)
    "Enter", "Exit", "Merge", "Switch", "NextIteration", "LoopCond", "ControlTrigger",
}  # fmt: skip
_STAGE_GRAPH = re.compile(r"stage(?P<stage>\d+)_(?P<kind>forward|inference|recompute)_")
# a node of a stage function inlined into the step (one micro-batch): its name carries the call's name scope
_INLINED = re.compile(r"(?:^|/)stage(?P<stage>\d+)_(?P<kind>forward|inference|recompute|backward)(?:_\d+)?/")


@dataclass(frozen=True)
class Share:
    """How many of some ops ran on the planned device, of how many."""

    on_device: int
    total: int

    @property
    def fraction(self) -> float:
        return self.on_device / self.total if self.total else 1.0


@dataclass(frozen=True)
class ExecutedPlacement:
    """Where one training step's work ran, per stage, read from the graphs TensorFlow executed.

    ``forward[s]`` counts the compute nodes of stage s's forward functions and the calls of them,
    ``backward[s]`` those of its generated backward functions and of its recomputing forward (with XLA
    a stage function's body is one compiled cluster: only its calls are listed), ``optimizer[s]`` the optimizer's
    variable writes on stage s's device whose value was computed there (the moments, bias correction
    and update arithmetic found by walking back from the write, ``runtime.executed.variable_writes``)
    rather than received from another device. ``off_device`` lists what ran elsewhere.
    """

    stages: tuple[str, ...]  # stage devices in pipeline order
    forward: tuple[Share, ...]
    backward: tuple[Share, ...]
    optimizer: tuple[Share, ...]
    off_device: tuple[str, ...]  # "stage s <kind>: <op> '<node>' on <device>"

    @property
    def ok(self) -> bool:
        """True iff every counted op ran on its stage's device."""
        shares = (*self.forward, *self.backward, *self.optimizer)
        return not self.off_device and all(s.on_device == s.total for s in shares)

    def table(self) -> Table:
        """Per stage: forward, backward and optimizer ops on the planned device, as counts and shares."""
        table = Table(title="Executed placement (one training step)", box=box.SIMPLE_HEAD, title_justify="left")
        for header in ("stage", "device", "forward ops there", "backward ops there", "optimizer updates there"):
            table.add_column(header, justify="left" if header in ("stage", "device") else "right")
        for s, device in enumerate(self.stages):
            cells = [
                f"{x.on_device}/{x.total} ({x.fraction:.0%})"
                for x in (self.forward[s], self.backward[s], self.optimizer[s])
            ]
            table.add_row(str(s), device, *cells)
        return table


def synthetic_batch(
    model: Any,
    batch_size: int,
    seed: int = 0,
    *,
    input_shapes: InputShapes | None = None,
    sequence_length: int | None = None,
) -> tuple[Any, Any]:
    """Random data shaped like ``model``'s inputs and outputs, for one step that shows placement.

    Float inputs and targets are standard normal; integer inputs (token ids, class ids) are 0 or 1,
    which every embedding and lookup accepts. Pair it with a loss that takes float targets of the
    output's shape, such as "mse". Inputs come as a dict where the model takes a dict (keras-hub
    models), else as a list, or one array for one input.

    Args:
        model: a built Functional or Sequential keras.Model.
        batch_size: rows of the batch.
        seed: the random seed.
        input_shapes, sequence_length: sizes for the model's unknown non-batch dimensions, as for
            ``plan_and_wrap`` (``profiles.shapes``); without them every unknown dimension is 1.

    Example:
        >>> x, y = synthetic_batch(model, 8)                          # doctest: +SKIP
        >>> x, y = synthetic_batch(gpt2_backbone, 8, sequence_length=16)   # doctest: +SKIP
    """
    import keras
    import numpy as np

    from profiles.shapes import call_shapes, needs_shapes
    from profiles.shapes import input_shapes as resolve_input_shapes
    from profiles.walk import flatten_calls, functional_graph

    functional = functional_graph(model)
    if input_shapes is None and sequence_length is None:
        sequence_length = 1
    planned = resolve_input_shapes(functional, input_shapes, sequence_length)
    shape_of: dict[int, tuple[Any, ...]] = {id(t): tuple(t.shape) for t in functional.outputs}
    if needs_shapes(functional, planned):
        calls, sources = flatten_calls(functional)
        shapes = call_shapes(calls, planned)
        shape_of = {id(t): shapes[sources[id(t)].call][sources[id(t)].output] for t in functional.outputs}
    shape_of.update({id(t): (None, *shape) for t, shape in zip(functional.inputs, planned.values())})
    rng = np.random.default_rng(seed)

    def like(tensor: Any) -> Any:
        shape = (batch_size, *(d if d is not None else 1 for d in shape_of[id(tensor)][1:]))
        dtype = str(getattr(tensor.dtype, "name", tensor.dtype))
        if "int" in dtype or "bool" in dtype:
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.normal(size=shape).astype(dtype)

    def pack(struct: Any, tensors: list[Any]) -> Any:
        if isinstance(struct, dict):
            return keras.tree.map_structure(like, struct)
        return [like(t) for t in tensors] if len(tensors) > 1 else like(tensors[0])

    return (
        pack(functional._inputs_struct, list(functional.inputs)),
        pack(functional._outputs_struct, list(functional.outputs)),
    )


def executed_placement(model: Any, x: Any, y: Any = None, sample_weight: Any = None) -> ExecutedPlacement:
    """Runs ONE training step of ``model`` (it updates the weights) and reports where its ops ran.

    Needs ``runtime.executed.enable_collection()`` called first thing in the process, before
    TensorFlow runs any function, and a compiled model.

    Example:
        >>> from runtime import executed; executed.enable_collection()          # doctest: +SKIP
        >>> report = executed_placement(wrapped, x, y)                            # doctest: +SKIP
        >>> report.ok                                                             # doctest: +SKIP
        True
    """
    from runtime.executed import collect_executed, variable_writes

    stages = tuple(canonical(d) for d in model.plan.stages)
    model.retrace()  # new stage functions: TensorFlow places (and so lists) a function once
    _, nodes = collect_executed(model.train_on_batch, x, y, sample_weight=sample_weight)
    num = len(stages)
    forward, backward = [[0, 0] for _ in stages], [[0, 0] for _ in stages]
    off: list[str] = []
    for node in nodes:
        # a stage function's own nodes, or a call of one (the only trace of an XLA-compiled stage function,
        # which XLA compiles and runs as one cluster on the call's device)
        function = node.calls or node.graph
        match = _STAGE_GRAPH.search(function) or _INLINED.search(node.name)
        if match is None or node.op in _PLUMBING:
            continue
        s = int(match["stage"])
        kind = "backward" if "__backward_" in function or match["kind"] in ("recompute", "backward") else "forward"
        counts = (backward if kind == "backward" else forward)[s]
        counts[1] += 1
        if canonical(node.device) == stages[s]:
            counts[0] += 1
        else:
            off.append(f"stage {s} {kind}: {node.op} '{node.name}' on {canonical(node.device)}")
    optimizer = [[0, 0] for _ in stages]
    scope = f"{model.optimizer.name}/"
    for write in variable_writes(nodes):
        device = canonical(write.write.device)
        if not write.write.name.startswith(scope) or device not in stages:
            continue
        counts = optimizer[stages.index(device)]
        counts[1] += 1
        if any(f.op not in _PLUMBING for f in write.feeders):
            counts[0] += 1
        else:
            off.append(f"optimizer: '{write.write.name}' on {device} writes a value computed on another device")
    return ExecutedPlacement(
        stages,
        tuple(Share(*c) for c in forward[:num]),
        tuple(Share(*c) for c in backward[:num]),
        tuple(Share(*c) for c in optimizer[:num]),
        tuple(off),
    )
