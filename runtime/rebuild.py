"""Rebuilds a Keras model as stages: each layer re-created on its plan's device, weights copied over.

The original model is walked with the profiler's own walk (``profiles.walk``), so node names match
the plan's. Every leaf layer is cloned from its config, called on the symbolic inputs under
``tf.device(device)`` (which creates its variables there) and given the original's weights. Nested
models are flattened; a shared layer is cloned once and called at every call site. The result is a
flat functional model plus a map from each cloned operation to its device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partitioner.errors import PlanError
from profiles.walk import flatten_calls, functional_graph


@dataclass
class Rebuilt:
    """A flat functional model whose layers live on their devices, and how it maps to the original."""

    model: Any  # keras.Model (Functional) made of the clones
    device_of: dict[int, str]  # id(cloned operation) -> TensorFlow device name
    origin: list[tuple[Any, Any]]  # (original operation, clone) for every operation with weights
    node_of: dict[int, str]  # id(cloned operation) -> the plan's node name (first call)


def check_plan_matches(names: list[str], assignment: Mapping[str, str]) -> None:
    """Raises PlanError when the plan's nodes differ from the model's layer calls."""
    missing = [n for n in names if n not in assignment]
    extra = sorted(set(assignment) - set(names))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} layer call(s) of the model are not in the plan (e.g. {missing[:5]})")
        if extra:
            parts.append(f"{len(extra)} node(s) of the plan are not in the model (e.g. {extra[:5]})")
        raise PlanError(
            "The plan was made for another model: " + "; ".join(parts) + ". Plan again for this model "
            "(runtime.plan_and_wrap does both), or load the plan made for it."
        )


def rebuild(model: Any, assignment: Mapping[str, str]) -> Rebuilt:
    """Clones ``model``'s layers onto the devices ``assignment`` names and wires them as the original.

    Args:
        model: a built Functional or Sequential keras.Model.
        assignment: {node name: TensorFlow device name}, e.g. ``plan.assignment``.

    Raises:
        PlanError: when the plan's nodes differ from the model's layer calls.
    """
    import keras
    import tensorflow as tf

    functional = functional_graph(model)
    calls, producer = flatten_calls(functional)
    check_plan_matches([c.name for c in calls], assignment)

    by_original: dict[int, Any] = {}  # id(original tensor as produced) -> new symbolic tensor
    clones: dict[int, Any] = {}  # id(original operation) -> clone
    device_of: dict[int, str] = {}
    node_of: dict[int, str] = {}
    origin: list[tuple[Any, Any]] = []
    new_inputs: dict[int, Any] = {}

    for call in calls:
        device = assignment[call.name]
        node = call.node
        if call.is_input:
            (tensor,) = node.output_tensors
            with tf.device(device):
                new = keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype, name=call.operation.name)
            new_inputs[id(tensor)] = new
            by_original[id(tensor)] = new
            continue
        tensor_dict = {id(t): by_original[id(produced)] for t, (_, produced) in zip(node.input_tensors, call.sources)}
        args, kwargs = node.arguments.fill_in(tensor_dict)
        operation = call.operation
        clone = clones.get(id(operation))
        if clone is None:
            clone = operation.__class__.from_config(operation.get_config())
            clones[id(operation)] = clone
            device_of[id(clone)] = device
            node_of[id(clone)] = call.name
            if operation.weights:
                origin.append((operation, clone))
        with tf.device(device):
            outputs = clone(*args, **kwargs)
        flat_outputs = keras.tree.flatten(outputs)
        for original, new in zip(node.output_tensors, flat_outputs):
            by_original[id(original)] = new

    inputs = keras.tree.map_structure(lambda t: new_inputs[id(t)], functional._inputs_struct)
    outputs = keras.tree.map_structure(lambda t: by_original[id(producer[id(t)][1])], functional._outputs_struct)
    flat = keras.Model(inputs, outputs, name=f"{model.name}_staged")
    for operation, clone in origin:
        clone.set_weights(operation.get_weights())
    return Rebuilt(flat, device_of, origin, node_of)


def copy_weights(pairs: list[tuple[Any, Any]]) -> None:
    """Sets each destination's weights to its source's: [(source, destination), ...]."""
    for source, destination in pairs:
        destination.set_weights(source.get_weights())
