"""Cuts a rebuilt model into stages: each stage's nodes in order, and the boundary tensors between stages.

A stage is the part of the flat rebuilt model (``runtime.rebuild``) whose operations run on one
device. Its inputs are the symbolic tensors its nodes read but another stage (or the model's input)
produces; its outputs are the tensors it produces that a later stage reads, or that are model
outputs. A skip edge that crosses several stages goes straight from its producer's stage to its
consumer's: every boundary tensor is a (producer stage, consumer stage) pair of names, nothing is
relayed through the stages in between.

The last stage also reads every model output produced elsewhere, and the masks of masked outputs:
the loss is computed there.

    stage 0:  inputs [features]          -> outputs [dense_1]
    stage 1:  inputs [dense_1]           -> outputs [dense_3]          (a model output)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.errors import PlanError
from profiles.internals import keras_mask, nodes_by_depth


@dataclass(frozen=True)
class Stage:
    """One stage of a pipelined model: what it reads, what it computes, what it hands on."""

    index: int  # position in the pipeline
    device: str  # TensorFlow device name
    nodes: tuple[Any, ...]  # keras Nodes of the rebuilt model, in an order that respects their edges
    inputs: tuple[Any, ...]  # symbolic tensors read from model inputs or earlier stages
    outputs: tuple[Any, ...]  # symbolic tensors later stages (or the loss) read
    trainable_variables: tuple[Any, ...]  # the stage's trainable weights, each once
    operations: tuple[Any, ...]  # the distinct layers the stage calls (Keras ops hold no weights, seeds or losses)


def output_masks(model: Any) -> list[Any]:
    """The distinct Keras masks the flat model's outputs carry (symbolic tensors of its graph), in order."""
    masks = [keras_mask(t) for t in model.outputs]
    return list({id(m): m for m in masks if m is not None}.values())


def cut_stages(model: Any, device_of: dict[int, str], devices: Sequence[str]) -> list[Stage]:
    """Splits a flat functional ``model`` into one Stage per device of ``devices`` (pipeline order).

    Args:
        model: the rebuilt flat functional keras.Model.
        device_of: id(operation) -> device, for every operation of ``model``.
        devices: the plan's stages (used devices) in pipeline order.

    Raises:
        PlanError: when an edge goes from a later stage to an earlier one (the plan is not a pipeline).
    """
    import keras

    position = {d: i for i, d in enumerate(devices)}
    producer: dict[int, int] = {id(t): -1 for t in model.inputs}  # id(tensor) -> stage producing it (-1: input)
    ordered = [
        node
        for depth, at_depth in sorted(nodes_by_depth(model).items(), reverse=True)
        for node in at_depth
        if node.operation is not None and not node.is_input
    ]
    nodes: list[list[Any]] = [[] for _ in devices]
    for node in ordered:
        stage = position[device_of[id(node.operation)]]
        for tensor in node.input_tensors:
            source = producer[id(tensor)]
            if source > stage:
                raise PlanError(
                    f"'{node.operation.name}' on stage {stage} ({devices[stage]}) reads a tensor of stage {source} "
                    f"({devices[source]}): every edge must go forward in pipeline order. Plan again."
                )
        nodes[stage].append(node)
        for tensor in node.outputs:
            producer[id(tensor)] = stage

    last = len(devices) - 1
    reads: list[dict[int, Any]] = [{} for _ in devices]  # stage -> boundary tensors it reads, in first-use order
    for stage, stage_nodes in enumerate(nodes):
        for node in stage_nodes:
            for tensor in node.input_tensors:
                if producer[id(tensor)] != stage:
                    reads[stage].setdefault(id(tensor), tensor)
    for tensor in [*model.outputs, *output_masks(model)]:
        if producer[id(tensor)] != last:
            reads[last].setdefault(id(tensor), tensor)

    sends: list[dict[int, Any]] = [{} for _ in devices]
    for stage in range(len(devices)):
        for key, tensor in reads[stage].items():
            source = producer[key]
            if source >= 0:
                sends[source].setdefault(key, tensor)

    stages = []
    for stage, device in enumerate(devices):
        operations = tuple(
            dict.fromkeys(n.operation for n in nodes[stage] if isinstance(n.operation, keras.layers.Layer))
        )
        variables = {id(v): v for op in operations for v in op.trainable_weights}
        stages.append(
            Stage(
                index=stage,
                device=device,
                nodes=tuple(nodes[stage]),
                inputs=tuple(reads[stage].values()),
                outputs=tuple(sends[stage].values()),
                trainable_variables=tuple(variables.values()),
                operations=operations,
            )
        )
    return stages
