"""Walks a Keras functional graph into its leaf layer calls, nested models flattened, named as the plan names them.

The profiler and the runtime both walk models with this module, so a plan's node names always
match the layer calls the runtime rebuilds: "layer" for a layer's first call, "layer:1", ... for
later calls (sharing ``colocation_group="layer"``, as does a layer that holds another's weights,
``tied_layers``), and "outer/layer" where flattening nested models makes names collide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from partitioner.errors import ProfileError
from profiles.internals import inbound_nodes, is_functional, nodes_by_depth, operation_order, sequential_graph


class Source(NamedTuple):
    """Where a call's input comes from: one output of an earlier call of the flattened graph.

    A nested model called twice reuses its inner Keras tensors, so a tensor object alone does not
    say which call produced it; ``(call, output)`` does.
    """

    call: int  # index of the producing call in the flattened list
    output: int  # position of the tensor among that call's (flattened) outputs
    tensor: Any  # the KerasTensor as that call's node produced it (its shape and dtype)


@dataclass
class LayerCall:
    """One call of a Keras operation (layer or op) in the flattened graph."""

    operation: Any  # the keras Layer or Operation
    node: Any  # the keras Node of the call (its arguments and output tensors)
    path: tuple[str, ...]  # names of the nested models it sits in, outermost first
    sources: list[Source] = field(default_factory=list)  # one per tensor of node.input_tensors
    name: str = ""
    colocation_group: str | None = None

    @property
    def is_input(self) -> bool:
        return bool(self.node.is_input)


def functional_graph(model: Any) -> Any:
    """Returns the Functional graph of a Functional or built Sequential model, or raises ProfileError."""
    import keras

    if not isinstance(model, keras.Model):
        raise ProfileError(
            f"profile_model needs a keras.Model. Received: {type(model).__name__}. "
            "Wrap layers in a model first, e.g. keras.Model(inputs, outputs) or keras.Sequential([...])."
        )
    preprocessor = getattr(model, "preprocessor", None)
    if preprocessor is not None:  # a keras-hub task: it preprocesses its data in fit/predict, outside the graph
        raise ProfileError(
            f"Model '{model.name}' ({type(model).__name__}) has a preprocessor ({type(preprocessor).__name__}) "
            "that turns raw data into the inputs of its layer graph, and only the layer graph is partitioned. "
            f"Build it with preprocessor=None, e.g. {type(model).__name__}(backbone=backbone, preprocessor=None), "
            "and preprocess in the data pipeline, e.g. dataset.map(preprocessor)."
        )
    if isinstance(model, keras.Sequential):
        functional = sequential_graph(model)
        if functional is None:
            raise ProfileError(
                f"Sequential model '{model.name}' is not built, so it has no layer graph yet. "
                "Call model.build(input_shape), e.g. model.build((None, 784)), or start it with "
                "keras.Input(shape=...)."
            )
        return functional
    if not is_functional(model):
        raise ProfileError(
            f"Model '{model.name}' ({type(model).__name__}) is a subclassed keras.Model: it has no "
            "functional graph of layers to partition. Rebuild it with the functional API "
            "(keras.Input + layer calls, then keras.Model(inputs, outputs)) or keras.Sequential, "
            "or wrap its pieces as layers in a functional model."
        )
    return model


def _inner_graph(operation: Any) -> Any | None:
    """The Functional graph of a nested model, None for any other operation."""
    import keras

    if isinstance(operation, keras.Sequential) or (isinstance(operation, keras.Model) and is_functional(operation)):
        return functional_graph(operation)
    return None


def _ordered_nodes(functional: Any) -> Iterator[Any]:
    """Keras nodes from inputs to outputs: by decreasing depth, then Keras' operation order."""
    rank = {id(op): i for i, op in enumerate(operation_order(functional))}
    for _, nodes in sorted(nodes_by_depth(functional).items(), reverse=True):
        yield from sorted(
            nodes, key=lambda n: (rank.get(id(n.operation), len(rank)), inbound_nodes(n.operation).index(n))
        )


def _flatten(functional: Any) -> tuple[list[LayerCall], dict[int, Source]]:
    """Lists the leaf calls of a functional graph in topological order, nested models expanded.

    Each call of a nested model is walked with a map of its own from the inner graph's tensors to
    their sources: the inner tensors are the same objects at every call, the sources are not.
    """
    calls: list[LayerCall] = []

    def walk(graph: Any, path: tuple[str, ...], bound: dict[int, Source]) -> dict[int, Source]:
        where = dict(bound)  # id(KerasTensor of this graph) -> its source, for this call of the graph
        for node in _ordered_nodes(graph):
            operation = node.operation
            if node.is_input:
                if path:  # a nested model's input: already bound to the outer tensor
                    continue
                calls.append(LayerCall(operation, node, path))
                for position, tensor in enumerate(node.output_tensors):
                    where[id(tensor)] = Source(len(calls) - 1, position, tensor)
                continue
            for tensor in node.input_tensors:
                if id(tensor) not in where:
                    raise ProfileError(
                        f"Cannot find the layer that produces input '{tensor.name}' of '{operation.name}'. "
                        "Expected a connected functional graph; rebuild the model with keras.Input."
                    )
            inner = _inner_graph(operation)
            if inner is not None:
                # Keras passes the inputs' masks as call(mask=...): not inputs; they travel with the tensors
                mask = node.arguments.kwargs.get("mask")
                masks = {id(t) for t in (mask if isinstance(mask, (list, tuple)) else [mask])}
                outer_inputs = [t for t in node.input_tensors if id(t) not in masks]
                inner_inputs = list(inner.inputs)
                outer_outputs, inner_outputs = node.output_tensors, list(inner.outputs)
                if len(outer_inputs) != len(inner_inputs) or len(outer_outputs) != len(inner_outputs):
                    raise ProfileError(
                        f"Nested model '{operation.name}' takes {len(inner_inputs)} input(s) and returns "
                        f"{len(inner_outputs)} output(s) but is called with {len(outer_inputs)} tensor(s) "
                        f"and gives {len(outer_outputs)}. Call it with one tensor per keras.Input."
                    )
                inner_bound = {id(i): where[id(o)] for o, i in zip(outer_inputs, inner_inputs, strict=True)}
                inner_where = walk(inner, (*path, operation.name), inner_bound)
                for outer, inner_tensor in zip(outer_outputs, inner_outputs, strict=True):
                    where[id(outer)] = inner_where[id(inner_tensor)]
                continue
            call = LayerCall(operation, node, path, sources=[where[id(t)] for t in node.input_tensors])
            calls.append(call)
            for position, tensor in enumerate(node.output_tensors):
                where[id(tensor)] = Source(len(calls) - 1, position, tensor)
        return where

    return calls, walk(functional, (), {})


def _name_calls(calls: list[LayerCall]) -> None:
    """Names nodes "layer", "layer:1", ...; prefixes "outer/inner/" where flattened names collide."""
    first: dict[int, LayerCall] = {}
    for call in calls:
        first.setdefault(id(call.operation), call)
    owners = Counter(call.operation.name for call in first.values())
    base: dict[int, str] = {}
    for key, call in first.items():
        name = call.operation.name
        base[key] = "/".join((*call.path, name)) if owners[name] > 1 and call.path else name
    group = _weight_groups(calls)
    num_calls = Counter(group[id(call.operation)] for call in calls)
    seen: Counter[int] = Counter()
    for call in calls:
        key = id(call.operation)
        call.name = base[key] if seen[key] == 0 else f"{base[key]}:{seen[key]}"
        call.colocation_group = base[group[key]] if num_calls[group[key]] > 1 else None
        seen[key] += 1
    names = Counter(call.name for call in calls)
    duplicates = sorted(name for name, count in names.items() if count > 1)
    if duplicates:
        raise ProfileError(
            f"Layers of the flattened model share the names {duplicates}, even after prefixing nested "
            "model names. Expected unique names; give layers and nested models distinct name= arguments."
        )


def graph_operations(calls: list[LayerCall]) -> dict[int, Any]:
    """id(operation) -> operation for the operations of a flat graph's calls, each once (input layers left out):
    what ``tied_layers`` looks a held layer up in."""
    return {id(call.operation): call.operation for call in calls if not call.is_input}


def tied_layers(operation: Any, operations: dict[int, Any]) -> dict[str, Any]:
    """{attribute: layer} for the layers with weights of ``operations`` (id -> operation of the flat graph) that
    ``operation`` holds as attributes of its own: a weight tied between two layers of the graph (keras-hub's
    ``MaskedLMHead`` holds its backbone's token embedding as ``token_embedding`` and calls it for its logits)."""
    held = getattr(operation, "__dict__", {})
    return {
        attribute: value
        for attribute, value in held.items()
        if value is not operation and id(value) in operations and getattr(value, "weights", None)
    }


def _weight_groups(calls: list[LayerCall]) -> dict[int, int]:
    """id(operation) -> id of the first operation (in call order) of the group it shares weights with: itself,
    or the layer it holds or that holds it (``tied_layers``), transitively."""
    operations = graph_operations(calls)
    group = {id(call.operation): id(call.operation) for call in calls}
    order = {key: position for position, key in enumerate(dict.fromkeys(id(call.operation) for call in calls))}

    def root(key: int) -> int:
        while group[key] != key:
            key = group[key]
        return key

    for key, operation in operations.items():
        for layer in tied_layers(operation, operations).values():
            one, other = root(key), root(id(layer))
            first, last = sorted((one, other), key=order.__getitem__)
            group[last] = first
    return {key: root(key) for key in group}


def flatten_calls(model: Any) -> tuple[list[LayerCall], dict[int, Source]]:
    """Returns the named leaf calls of ``model`` in topological order, and where its tensors come from.

    The second value maps ``id(tensor)`` of every tensor of ``model``'s own graph (its outputs
    included) to its Source. Tensors inside nested models are not in it: a nested model called
    twice has one inner tensor and two sources; each call's ``sources`` names them.

    Raises:
        ProfileError: for subclassed or unbuilt models, and disconnected graphs.
    """
    functional = functional_graph(model)
    calls, sources = _flatten(functional)
    _name_calls(calls)
    return calls, sources
