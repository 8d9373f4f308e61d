"""Walks a Keras functional graph into its leaf layer calls, nested models flattened, named as the plan names them.

The profiler and the runtime both walk models with this module, so a plan's node names always
match the layer calls the runtime rebuilds: "layer" for a layer's first call, "layer:1", ... for
later calls (sharing ``colocation_group="layer"``), and "outer/layer" where flattening nested models
makes names collide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from partitioner.errors import ProfileError


@dataclass
class LayerCall:
    """One call of a Keras operation (layer or op) in the flattened graph."""

    operation: Any  # the keras Layer or Operation
    node: Any  # the keras Node of the call (its arguments and output tensors)
    path: tuple[str, ...]  # names of the nested models it sits in, outermost first
    sources: list[tuple[int, Any]] = field(default_factory=list)  # per input tensor: (call index, tensor)
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
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise ProfileError(
                f"Sequential model '{model.name}' is not built, so it has no layer graph yet. "
                "Call model.build(input_shape), e.g. model.build((None, 784)), or start it with "
                "keras.Input(shape=...)."
            )
        return functional
    if not hasattr(model, "_nodes_by_depth"):
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

    if isinstance(operation, keras.Sequential) or (
        isinstance(operation, keras.Model) and hasattr(operation, "_nodes_by_depth")
    ):
        return functional_graph(operation)
    return None


def _ordered_nodes(functional: Any) -> Iterator[Any]:
    """Keras nodes from inputs to outputs: by decreasing depth, then Keras' operation order."""
    rank = {id(op): i for i, op in enumerate(functional._operations)}
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        yield from sorted(
            functional._nodes_by_depth[depth],
            key=lambda n: (rank.get(id(n.operation), len(rank)), n.operation._inbound_nodes.index(n)),
        )


def _flatten(functional: Any) -> tuple[list[LayerCall], dict[int, tuple[int, Any]]]:
    """Lists the leaf calls of a functional graph in topological order, nested models expanded."""
    calls: list[LayerCall] = []
    producer: dict[int, tuple[int, Any]] = {}  # id(KerasTensor) -> (call index, tensor as produced)

    def walk(graph: Any, path: tuple[str, ...]) -> None:
        for node in _ordered_nodes(graph):
            operation = node.operation
            if node.is_input:
                if path:  # a nested model's input: already bound to the outer tensor
                    continue
                calls.append(LayerCall(operation, node, path))
                for tensor in node.output_tensors:
                    producer[id(tensor)] = (len(calls) - 1, tensor)
                continue
            for tensor in node.input_tensors:
                if id(tensor) not in producer:
                    raise ProfileError(
                        f"Cannot find the layer that produces input '{tensor.name}' of '{operation.name}'. "
                        "Expected a connected functional graph; rebuild the model with keras.Input."
                    )
            inner = _inner_graph(operation)
            if inner is not None:
                outer_inputs, inner_inputs = node.input_tensors, list(inner.inputs)
                if len(outer_inputs) != len(inner_inputs):
                    raise ProfileError(
                        f"Nested model '{operation.name}' takes {len(inner_inputs)} input(s) but is called "
                        f"with {len(outer_inputs)} tensor(s). Call it with one tensor per keras.Input."
                    )
                for outer, inner_tensor in zip(outer_inputs, inner_inputs, strict=True):
                    producer[id(inner_tensor)] = producer[id(outer)]
                walk(inner, (*path, operation.name))
                for outer, inner_tensor in zip(node.output_tensors, inner.outputs, strict=False):
                    producer[id(outer)] = producer[id(inner_tensor)]
                continue
            call = LayerCall(operation, node, path, sources=[producer[id(t)] for t in node.input_tensors])
            calls.append(call)
            for tensor in node.output_tensors:
                producer[id(tensor)] = (len(calls) - 1, tensor)

    walk(functional, ())
    return calls, producer


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
    num_calls = Counter(id(call.operation) for call in calls)
    seen: Counter[int] = Counter()
    for call in calls:
        key = id(call.operation)
        call.name = base[key] if seen[key] == 0 else f"{base[key]}:{seen[key]}"
        call.colocation_group = base[key] if num_calls[key] > 1 else None
        seen[key] += 1
    names = Counter(call.name for call in calls)
    duplicates = sorted(name for name, count in names.items() if count > 1)
    if duplicates:
        raise ProfileError(
            f"Layers of the flattened model share the names {duplicates}, even after prefixing nested "
            "model names. Expected unique names; give layers and nested models distinct name= arguments."
        )


def flatten_calls(model: Any) -> tuple[list[LayerCall], dict[int, tuple[int, Any]]]:
    """Returns the named leaf calls of ``model`` in topological order, and where each tensor comes from.

    The second value maps ``id(tensor)`` of every tensor of the graph (nested models' included) to
    ``(index of the call that produces it, the tensor as that call produced it)``.

    Raises:
        ProfileError: for subclassed or unbuilt models, and disconnected graphs.
    """
    functional = functional_graph(model)
    calls, producer = _flatten(functional)
    _name_calls(calls)
    return calls, producer
