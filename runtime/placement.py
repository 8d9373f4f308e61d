"""Where things really are: the devices of each stage's variables and of the ops in the traced step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.table import Table

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
    forward = tf.function(lambda *xs: model(list(xs) if len(xs) > 1 else xs[0], training=False))
    graph = forward.get_concrete_function(*specs).graph
    counts: Counter[str] = Counter(canonical(op.device) for op in graph.get_operations() if op.device)
    return PlacementReport(planned, variable_devices, dict(counts), misplaced)
