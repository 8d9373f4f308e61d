"""Where things really are: the devices of each stage's variables, and of the ops a training step executed."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.table import Table

from profiles.internals import input_structure, output_structure
from profiles.shapes import InputShapes
from runtime.devices import canonical


@dataclass(frozen=True)
class PlacementReport:
    """Observed placement of a PipelinedModel, to check against its plan."""

    planned: dict[str, str]  # node -> device the plan names
    variable_devices: dict[str, list[str]]  # node -> devices of its variables, as TensorFlow reports them
    op_devices: dict[str, int]  # device -> number of ops placed there in the traced forward pass
    misplaced: list[str] = field(default_factory=list)  # "node: variable on X, plan says Y", misplaced slots

    @property
    def ok(self) -> bool:
        """True iff every variable lives on the device its plan names, and every optimizer slot (once the
        optimizer is built) on its variable's device."""
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
    """Reads the devices of ``model``'s variables (and, once compiled, its optimizer's slots) and of the
    ops of its traced forward pass.

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

    misplaced += misplaced_slots(model)

    specs = [tf.TensorSpec(t.shape, t.dtype) for t in model.staged.inputs]
    import keras

    struct = input_structure(model.staged)  # a list, one tensor, or a dict (keras-hub models)
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
# the functions the runtime names (runtime.executor): a stage's, or the micro-batch loss's
_FUNCTION = re.compile(
    r"(?:stage(?P<stage>\d+)_(?P<kind>forward|inference|recompute|accumulate)|(?P<loss>microbatch_loss))_"
)
# a node of such a function inlined into the step (one micro-batch): its name carries the call's name scope
_INLINED = re.compile(
    r"(?:^|/)(?:stage(?P<stage>\d+)_(?P<kind>forward|inference|recompute|backward|accumulate)|(?P<loss>microbatch_loss))"
    r"(?:_\d+)?/"
)


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

    Which part of the step a node belongs to, by the function it is in (or, inlined at M = 1, by its
    name scope), and the functions that function was called from (a nested function a stage calls
    belongs to that stage, read through):

        stage s's forward functions                            forward[s]   on stage s's device
        its generated backward, its recomputing forward and
        its gradient sums (``stage<s>_accumulate``)             backward[s]  on stage s's device
        the micro-batch loss (``microbatch_loss``)             loss         on the last stage's device
        the optimizer's writes (its name scope)                optimizer    see below
        anything else of the step: micro-batch slicing and
        stacking, the loop, the loss and metric sums           outside      any device, not judged

    ``optimizer[s]`` counts the optimizer's variable writes on stage s's device whose value was
    computed there (``runtime.executed.VariableWrite.computed_here``: the node that produces the value
    ran there, not merely some feeder); a write on a device no stage uses is off its device. The
    optimizer's slots (Adam's moments, momentum) must sit on their variable's device
    (``misplaced_slots``). A stage function compiled by XLA (``jit_compile=True``) lists no body: XLA
    compiles it whole for the device of its call and runs it there, ``tf.device`` scopes inside
    ignored, so its call's device is where all of it ran: ``compiled[s]`` counts stage s's compiled
    calls on its device (its ops are not in ``forward`` or ``backward``). Any other call whose body
    TensorFlow did not list (a name too long for its dump file) is *unread*: counted in
    ``unread_calls`` of its stage, and ``ok`` is then False, since what ran inside was not seen.
    ``off_device`` lists what ran elsewhere, ``unread`` what could not be read.
    """

    stages: tuple[str, ...]  # stage devices in pipeline order
    forward: tuple[Share, ...]
    backward: tuple[Share, ...]
    optimizer: tuple[Share, ...]
    off_device: tuple[str, ...]  # "stage s <kind>: <op> '<node>' on <device>", "optimizer: ...", "loss: ..."
    loss: Share = Share(0, 0)  # the micro-batch loss function's ops on the last stage's device
    unread_calls: tuple[int, ...] = ()  # per stage: calls of functions whose body was not listed
    unread: tuple[str, ...] = ()  # "stage s <kind>: call '<node>' of '<function>' on <device>: its body is not listed"
    outside: dict[str, int] = field(default_factory=dict)  # device -> compute ops outside every function above
    compiled: tuple[Share, ...] = ()  # per stage: its XLA-compiled calls (forward, backward) on its device

    @property
    def ok(self) -> bool:
        """True iff every op was read and ran on its planned device: nothing off its device, no unread call."""
        shares = (*self.forward, *self.backward, *self.optimizer, self.loss, *self.compiled)
        return not self.off_device and not self.unread and all(s.on_device == s.total for s in shares)

    def table(self) -> Table:
        """Per stage: forward, backward and optimizer ops on the planned device, as counts and shares, the
        calls not read, and the step's other ops on that device; a row per other device with such ops."""
        table = Table(title="Executed placement (one training step)", box=box.SIMPLE_HEAD, title_justify="left")
        headers = ("stage", "device", "forward ops there", "backward ops there", "optimizer updates there")
        for header in (*headers, "loss ops there", "XLA calls there", "calls not read", "other step ops there"):
            table.add_column(header, justify="left" if header in ("stage", "device") else "right")
        last = len(self.stages) - 1
        for s, device in enumerate(self.stages):
            compiled = self.compiled[s] if self.compiled else Share(0, 0)
            cells = [
                f"{x.on_device}/{x.total}" + (f" ({x.fraction:.0%})" if x.total else "")
                for x in (self.forward[s], self.backward[s], self.optimizer[s], self.loss, compiled)
            ]
            cells[3] = cells[3] if s == last else "-"
            unread = self.unread_calls[s] if self.unread_calls else 0
            table.add_row(str(s), device, *cells, str(unread), str(self.outside.get(device, 0)))
        for device in sorted(set(self.outside) - set(self.stages)):
            table.add_row("-", device, "-", "-", "-", "-", "-", "-", str(self.outside[device]))
        return table


def misplaced_slots(model: Any) -> list[str]:
    """The optimizer slots (Adam's moments, momentum) not on their variable's device, one line each.

    Empty when the optimizer is not built yet (no slots). Slots are matched to variables by Keras'
    naming rule (``runtime.optimizer_state.slots``).

    Example:
        >>> misplaced_slots(wrapped)              # doctest: +SKIP
        ["optimizer slot 'adam/dense_3_kernel_momentum' on /device:CPU:3, its variable 'dense_3/kernel' on ..."]
    """
    from runtime.optimizer_state import slots

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "built", False):
        return []
    lines = []
    for slot, variable in slots(optimizer, model.trainable_variables):
        slot_device, device = canonical(slot.value.device), canonical(variable.value.device)
        if slot_device != device:
            lines.append(f"optimizer slot '{slot.path}' on {slot_device}, its variable '{variable.path}' on {device}")
    return lines


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
        pack(input_structure(functional), list(functional.inputs)),
        pack(output_structure(functional), list(functional.outputs)),
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
    owner = _owners(nodes)
    read = {node.graph for node in nodes}
    last = len(stages) - 1
    forward, backward = [[0, 0] for _ in stages], [[0, 0] for _ in stages]
    loss, unread_calls = [0, 0], [0 for _ in stages]
    compiled = [[0, 0] for _ in stages]
    outside: Counter[str] = Counter()
    off: list[str] = []
    unread: list[str] = []
    scope = f"{model.optimizer.name}/"
    for node in nodes:
        device = canonical(node.device)
        part = _part_of_name(node.name) or owner.get(node.graph)
        if node.calls and node.calls not in read:  # its body was not listed: XLA-compiled, or placed before
            part = _part_of_function(node.calls) or part
            call = f"{'XLA call' if node.compiled else 'call'} '{node.name}' of '{node.calls}' on {device}"
            if part is None:  # a function the step itself calls: counted with no stage
                if node.compiled:  # ran wholly on its call's device: the step's other work there
                    outside[device] += 1
                else:
                    unread.append(f"step: {call}: its body is not listed")
                continue
            s = last if part[0] is None else part[0]
            if node.compiled:  # XLA runs the whole body on the call's device: the call says where it ran
                compiled[s][1] += 1
                compiled[s][0] += device == stages[s]
            else:
                unread_calls[s] += 1
                unread.append(f"stage {s} {part[1]}: {call}: its body is not listed")
            if device != stages[s]:
                off.append(f"stage {s} {part[1]}: {call}")
            continue
        if node.op in _PLUMBING or node.calls:  # a call whose body is listed: its body's nodes are counted
            continue
        if part is None:
            if not node.name.startswith(scope):  # the optimizer's arithmetic is judged by its writes
                outside[device] += 1
            continue
        owner_stage, kind = part
        if owner_stage is None:  # the micro-batch loss: the last stage's
            counts, expected = loss, stages[last]
        else:
            counts, expected = (backward if kind == "backward" else forward)[owner_stage], stages[owner_stage]
        counts[1] += 1
        if device == expected:
            counts[0] += 1
        else:
            where = "loss" if kind == "loss" else f"stage {owner_stage} {kind}"
            off.append(f"{where}: {node.op} '{node.name}' on {device}")
    optimizer = [[0, 0] for _ in stages]
    for write in variable_writes(nodes):
        device = canonical(write.write.device)
        if not write.write.name.startswith(scope):
            continue
        if device not in stages:
            off.append(f"optimizer: '{write.write.name}' writes a variable on {device}, a device no stage uses")
            continue
        counts = optimizer[stages.index(device)]
        counts[1] += 1
        if write.computed_here:
            counts[0] += 1
        else:
            off.append(f"optimizer: '{write.write.name}' on {device} writes a value computed on another device")
    off += misplaced_slots(model)
    return ExecutedPlacement(
        stages,
        tuple(Share(*c) for c in forward),
        tuple(Share(*c) for c in backward),
        tuple(Share(*c) for c in optimizer),
        tuple(off),
        Share(*loss),
        tuple(unread_calls),
        tuple(unread),
        dict(outside),
        tuple(Share(*c) for c in compiled),
    )


# (stage, kind) of a node: stage None for the micro-batch loss; kind "forward", "backward" or "loss"
Part = tuple[int | None, str]


def _part_of_function(function: str) -> Part | None:
    """The part of the step a function is, by the name the runtime gave it (specialised copies carry
    their call site's name after '_specialized_for_': only the function's own name counts)."""
    own = function.split("_specialized_for_")[0]
    match = _FUNCTION.search(own)
    if match is None:
        return None
    if match["loss"]:
        return None, "loss"
    backward = "__backward_" in own or match["kind"] in ("recompute", "accumulate")
    return int(match["stage"]), "backward" if backward else "forward"


def _part_of_name(name: str) -> Part | None:
    """The part of the step a node inlined into the step is, by its name scope (M = 1)."""
    match = _INLINED.search(name)
    if match is None:
        return None
    if match["loss"]:
        return None, "loss"
    return int(match["stage"]), "backward" if match["kind"] in ("recompute", "backward", "accumulate") else "forward"


def _owners(nodes: list[Any]) -> dict[str, Part]:
    """Per listed function, the part of the step it belongs to: by its own name, else by the call that
    runs it (a nested function a stage function calls belongs to that stage; its generated backward,
    called from the stage's backward, to the stage's backward)."""
    callers: dict[str, list[Any]] = {}
    for node in nodes:
        if node.calls:
            callers.setdefault(node.calls, []).append(node)
    owners: dict[str, Part | None] = {}

    def owner(graph: str, seen: frozenset[str]) -> Part | None:
        if graph in owners:
            return owners[graph]
        part = _part_of_function(graph)
        for call in callers.get(graph, []) if part is None else []:
            if call.graph not in seen:
                part = _part_of_name(call.name) or owner(call.graph, seen | {graph})
            if part is not None:
                break
        owners[graph] = part
        return part

    found = {graph: owner(graph, frozenset({graph})) for graph in {node.graph for node in nodes}}
    return {graph: part for graph, part in found.items() if part is not None}
