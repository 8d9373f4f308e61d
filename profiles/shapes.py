"""Shapes to plan for: fixed sizes for a model's unknown input dimensions, carried through its layer graph.

Keras models often leave the sequence length open: a keras-hub ``GPT2Backbone`` takes
``token_ids`` of shape ``(None, None)``. Costs need fixed sizes, so the user names the shape to
plan for, and every tensor of the flattened graph gets its static shape from the layers' own
``compute_output_spec`` on those inputs. The model itself keeps its open shapes: a wrapped model
runs any length the original accepts, its plan is made for one.

    argument                             token_ids (None, None)   features (None, None, 8)
    -----------------------------------  -----------------------  ------------------------
    sequence_length=128                  (128,)                   (128, 8)
    input_shapes={"token_ids": 128}      (128,)                   still unknown: an error
    input_shapes=[(128,), (64, 8)]       (128,)                   (64, 8)     (model.inputs order)

Example:
    >>> import keras                                                            # doctest: +SKIP
    >>> tokens = keras.Input((None,), dtype="int32", name="token_ids")          # doctest: +SKIP
    >>> model = keras.Model(tokens, keras.layers.Embedding(100, 8)(tokens))     # doctest: +SKIP
    >>> input_shapes(model, sequence_length=16)                                 # doctest: +SKIP
    {'token_ids': (16,)}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.errors import InputError, ProfileError
from profiles.internals import keras_history

Shape = tuple[int | None, ...]  # a tensor's shape, the batch axis (axis 0) left as None
InputShapes = Mapping[str, int | Sequence[int]] | Sequence[int | Sequence[int]]

HOW_TO_FIX = (
    "pass the shape to plan for: sequence_length=128 (every unknown non-batch dimension of every input), or "
    "input_shapes={{{example}}} (shapes without the batch axis; CLI: --sequence-length 128 or {cli})"
)


def input_names(model: Any) -> list[str]:
    """Names of ``model``'s inputs in the order of ``model.inputs`` (the names of their InputLayers)."""
    return [keras_history(tensor).operation.name for tensor in model.inputs]


def input_shapes(
    model: Any,
    input_shapes: InputShapes | None = None,
    sequence_length: int | None = None,
) -> dict[str, tuple[int, ...]]:
    """The shape to plan for of each of ``model``'s inputs, without the batch axis.

    Each input keeps its own known dimensions; ``input_shapes`` sets whole shapes (a dict by input
    name, or a list in the order of ``model.inputs``; a bare int for a one-dimensional shape), and
    ``sequence_length`` fills every dimension still unknown.

    Args:
        model: a built keras.Model.
        input_shapes: ``{"token_ids": (128,)}``, ``{"token_ids": 128}`` or ``[(128,), (128,)]``.
        sequence_length: the size for every unknown non-batch dimension of every input.

    Returns:
        {input name: shape without the batch axis}, every dimension a positive int.

    Raises:
        InputError: for an unknown input name, a shape of the wrong rank, one that contradicts a
            dimension the model fixes, or a size that is not a positive int.
        ProfileError: when a dimension is still unknown, naming the arguments that fix it.
    """
    names = input_names(model)
    known: dict[str, Shape] = {name: tuple(t.shape)[1:] for name, t in zip(names, model.inputs)}
    given = _given_shapes(model.name, names, input_shapes)
    if sequence_length is not None:
        _check_size("sequence_length", sequence_length)
    resolved: dict[str, tuple[int, ...]] = {}
    for name, own in known.items():
        shape = own
        if name in given:
            shape = _merge(model.name, name, own, given[name])
        shape = tuple(sequence_length if d is None else d for d in shape)
        if any(d is None for d in shape):
            example = ", ".join(f"{n!r}: {_example(known[n])}" for n in names if None in known[n])
            cli = " ".join(f"--input-shape {n}={_cli(known[n])}" for n in names if None in known[n])
            raise ProfileError(
                f"Input '{name}' of model '{model.name}' has shape {(None, *own)}, with unknown dimensions "
                "beyond the batch axis; profiling needs static shapes. To plan this model, "
                + HOW_TO_FIX.format(example=example, cli=cli)
                + "."
            )
        resolved[name] = tuple(int(d) for d in shape)  # type: ignore[arg-type]  # None ruled out above
    return resolved


def needs_shapes(model: Any, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """True iff ``shapes`` differ from the shapes ``model`` was built with (so sizes must be carried through)."""
    return any(tuple(t.shape)[1:] != shapes[name] for name, t in zip(input_names(model), model.inputs))


def call_shapes(calls: Sequence[Any], shapes: Mapping[str, tuple[int, ...]]) -> list[list[Shape]]:
    """Per call of a flattened graph (``profiles.walk``), the shapes of its outputs for inputs of ``shapes``.

    Each operation is asked for its output spec on inputs of the planned shapes
    (``operation.compute_output_spec``, which Keras itself uses to build functional models); no
    layer is called and no Keras node is added.

    Raises:
        ProfileError: when an operation cannot compute its output for the planned shapes.
    """
    import keras

    specs: list[list[Any]] = []
    for call in calls:
        if call.is_input:
            (tensor,) = call.node.output_tensors
            specs.append([keras.KerasTensor((None, *shapes[call.operation.name]), dtype=tensor.dtype)])
            continue
        values = {id(t): specs[s.call][s.output] for t, s in zip(call.node.input_tensors, call.sources, strict=True)}
        args, kwargs = call.node.arguments.fill_in(values)
        try:
            outputs = call.operation.compute_output_spec(*args, **kwargs)
        except Exception as err:
            planned = [tuple(v.shape) for v in values.values()]
            raise ProfileError(
                f"Cannot compute the output shape of '{call.operation.name}' ({type(call.operation).__name__}) "
                f"for inputs of shapes {planned}: {type(err).__name__}: {_first_line(err)}. Expected the model "
                "to accept the planned input shapes; pass shapes it accepts (input_shapes= or sequence_length=)."
            ) from err
        specs.append(keras.tree.flatten(outputs))
    return [[tuple(spec.shape) for spec in outputs] for outputs in specs]


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """Parses the CLI's ``--input-shape token_ids=128`` or ``features=128x8`` into (name, shape).

    Raises:
        InputError: when the text is not NAME=SIZE[xSIZE...] with positive sizes.
    """
    name, equals, sizes = text.partition("=")
    try:
        shape = tuple(int(size) for size in sizes.replace(",", "x").split("x"))
    except ValueError:
        shape = ()
    if not equals or not name or not shape or any(size < 1 for size in shape):
        raise InputError(
            f"--input-shape takes NAME=SIZE or NAME=SIZExSIZE (the shape without the batch axis, sizes >= 1). "
            f"Received: {text!r}. For example: --input-shape token_ids=128."
        )
    return name, shape


# --- checks ----------------------------------------------------------------------------------------


def _given_shapes(model_name: str, names: list[str], given: InputShapes | None) -> dict[str, tuple[int, ...]]:
    """``input_shapes`` as {input name: shape}, checked for names, count and sizes."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise InputError(
                f"input_shapes names {unknown}, which are not inputs of model '{model_name}'. "
                f"Expected names among its inputs: {names}."
            )
        items = list(given.items())
    elif isinstance(given, Sequence) and not isinstance(given, str):
        if len(given) != len(names):
            raise InputError(
                f"input_shapes has {len(given)} shape(s) but model '{model_name}' has {len(names)} input(s) "
                f"{names}. Give one shape per input, in the order of model.inputs, or a dict by name."
            )
        items = list(zip(names, given))
    else:
        raise InputError(f"input_shapes must be a dict {{input name: shape}} or a list of shapes. Received: {given!r}.")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in items:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        for dim in dims:
            _check_size(f"input_shapes[{name!r}]", dim)
        shapes[str(name)] = dims
    return shapes


def _merge(model_name: str, name: str, own: Shape, given: tuple[int, ...]) -> Shape:
    """The given shape, checked against the dimensions the model fixes."""
    if len(given) != len(own) or any(d is not None and d != g for d, g in zip(own, given)):
        raise InputError(
            f"input_shapes gives input '{name}' of model '{model_name}' the shape {given}, but the model takes "
            f"{(None, *own)}. Expected a shape without the batch axis that keeps the known sizes, e.g. "
            f"{_example(own)}."
        )
    return given


def _check_size(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{what} must be a positive integer. Received: {value!r}.")


def _example(shape: Shape) -> tuple[int, ...]:
    return tuple(128 if d is None else d for d in shape)


def _cli(shape: Shape) -> str:
    return "x".join(str(d) for d in _example(shape))


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else ""
