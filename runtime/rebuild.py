"""Rebuilds a Keras model as stages: each layer re-created on its plan's device, weights copied over.

The original model is walked with the profiler's own walk (``profiles.walk``), so node names match
the plan's. Every leaf operation (layer or Keras op such as ``x * 2.0``) is cloned from its config
and called on the symbolic inputs, both under ``tf.device(device)`` (which creates its variables
there), and given the original's weights; the layers of a keras-hub backbone whose blocks do not
rebuild from their own config are taken from the backbone rebuilt whole (``runtime.backbones``).
Nested models are flattened; a shared layer is cloned once and called at every call site, and a layer
that holds another layer of the graph as an attribute (a tied weight: keras-hub's ``MaskedLMHead`` holds
the token embedding) holds that layer's clone (the plan keeps the two on one device). Masks need
no special care: Keras records a mask a layer reads as an argument of its call, computed by an op
node (``NotEqual`` for ``Embedding(mask_zero=True)``), so it is an ordinary tensor of the flat graph
and crosses stages like any other. A masked model output goes through a ``MaskCarrier`` that takes
its mask as an argument, so the mask is a tensor of the flat graph too, and the last stage returns
it for the loss. The result is a flat functional model plus a map from each cloned operation to its
device.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from partitioner.errors import PlanError, ProfileError
from profiles.internals import (
    flatten_layers,
    inbound_nodes,
    input_structure,
    keras_history,
    keras_mask,
    lambda_output_shape,
    output_structure,
    replace_sublayer,
    seed_generators,
    set_keras_mask,
    unsafe_deserialization,
)
from profiles.walk import LayerCall, flatten_calls, functional_graph, graph_operations, tied_layers
from runtime.backbones import backbone_layers


@dataclass
class Rebuilt:
    """A flat functional model whose layers live on their devices, and how it maps to the original."""

    model: Any  # keras.Model (Functional) made of the clones
    device_of: dict[int, str]  # id(cloned operation) -> TensorFlow device name
    origin: list[tuple[Any, Any]]  # (original operation, clone) for every operation with weights, seeds or kept state
    node_of: dict[int, str]  # id(cloned operation) -> the plan's node name (first call)
    input_devices: tuple[str, ...] = ()  # per input of ``model``: its InputLayer's device, where its batch is split
    clone_of: dict[int, Any] = field(default_factory=dict)  # id(original operation or InputLayer) -> its clone


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


def rebuild(model: Any, assignment: Mapping[str, str], last_device: str | None = None) -> Rebuilt:
    """Clones ``model``'s layers onto the devices ``assignment`` names and wires them as the original.

    Every operation of the flattened graph (layer or Keras op) is cloned once, under
    ``tf.device(its device)``, so variables made in ``__init__`` (wrappers such as Bidirectional,
    seed generators) land there too, and called there at each of its call sites. A clone keeps its
    layer's name unless flattening makes two names meet (an outer and a nested ``"fc"``): then it
    takes its node name, with ``"_"`` for ``"/"``.

    A model output made by a layer's softmax or sigmoid activation on another device than ``last_device``
    (the last stage's, which takes the loss) is made by the layer's clone without its activation and an
    ``Activation`` on ``last_device`` (``_moved_activation``): Keras' cross-entropies compute from the logits
    behind such an activation, which only the last stage hands to the loss.

    Args:
        model: a built Functional or Sequential keras.Model.
        assignment: {node name: TensorFlow device name}, e.g. ``plan.assignment``.
        last_device: the last stage's device (``plan.stages[-1]``); None: no activation is moved.

    Raises:
        PlanError: when the plan's nodes differ from the model's layer calls.
        ProfileError: when a layer cannot be copied from its config.
    """
    import keras
    import tensorflow as tf

    functional = functional_graph(model)
    calls, sources = flatten_calls(functional)
    check_plan_matches([c.name for c in calls], assignment)
    names = _clone_names(calls)
    first_device: dict[int, str] = {}  # id(operation) -> the device of its first call, where its clone lives
    first_node: dict[int, str] = {}  # id(operation) -> the plan's name of its first call
    for call in calls:
        first_device.setdefault(id(call.operation), assignment[call.name])
        first_node.setdefault(id(call.operation), call.name)
    operations = graph_operations(calls)
    taken = backbone_layers(model, first_device)  # layers of keras-hub backbones rebuilt whole, already placed

    produced: list[list[Any]] = []  # per call: its new symbolic outputs, flattened
    clones: dict[int, Any] = {}  # id(original operation) -> clone
    device_of: dict[int, str] = {}
    node_of: dict[int, str] = {}
    origin: list[tuple[Any, Any]] = []
    masks = _Masks(device_of, set(names.values()))

    def clone_of(operation: Any) -> Any:
        """The clone of ``operation``, made on the device of its first call the first time it is asked for;
        a layer it holds that is an operation of the graph too (a tied weight) is that operation's clone."""
        key = id(operation)
        clone = clones.get(key)
        if clone is not None:
            return clone
        device = first_device[key]
        clone = taken.get(key)
        if clone is None:
            with tf.device(device):
                clone = clone_operation(operation, names[key])
        else:
            clone.name = names[key]  # the same name unless flattening made two names meet
        clones[key] = clone
        device_of[id(clone)] = device
        node_of[id(clone)] = first_node[key]
        for attribute, layer in tied_layers(operation, operations).items():
            replace_sublayer(clone, attribute, clone_of(layer))
        if getattr(operation, "weights", None) or seed_states(operation) or _keeps_state(operation):
            origin.append((operation, clone))
        return clone

    model_outputs = {
        (s.call, s.output) for s in (sources[id(t)] for t in keras.tree.flatten(output_structure(functional)))
    }
    reads = {(s.call, s.output) for call in calls for s in call.sources}
    for index, call in enumerate(calls):
        device = assignment[call.name]
        node = call.node
        if call.is_input:
            (tensor,) = node.output_tensors
            with tf.device(device):
                new = keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype, name=call.operation.name)
            clones[id(call.operation)] = keras_history(new).operation
            produced.append([new])
            masks.produced(new, device)
            continue
        values = {
            id(t): masks.carried(produced[s.call][s.output], device)
            for t, s in zip(node.input_tensors, call.sources, strict=True)
        }
        args, kwargs = node.arguments.fill_in(values)
        clone = clone_of(call.operation)
        # the device the output's activation moves to (``_moved_activation``), or None
        moved = (
            last_device
            if last_device is not None
            and device != last_device
            and (index, 0) in model_outputs
            and (index, 0) not in reads
            and _moved_activation(call, calls, clone)
            else None
        )
        if moved is not None:
            activation = clone.activation
            clone.activation = keras.activations.linear
        with tf.device(device):
            outputs = clone(*args, **kwargs)
        produced.append(keras.tree.flatten(outputs))
        if moved is not None:
            name = f"{clone.name}_activation"
            while name in names.values() or name in masks.taken:
                name = f"{name}_"
            masks.taken.add(name)
            with tf.device(moved):
                layer = keras.layers.Activation(activation, name=name, dtype=clone.dtype_policy)
                produced[-1] = [layer(produced[-1][0])]
            device_of[id(layer)] = moved
            masks.produced(produced[-1][0], moved)
            continue
        for new in produced[-1]:
            masks.produced(new, device)

    def new_tensor(tensor: Any) -> Any:
        source = sources[id(tensor)]
        return produced[source.call][source.output]

    inputs = keras.tree.map_structure(new_tensor, input_structure(functional))
    outputs = keras.tree.map_structure(new_tensor, output_structure(functional))
    _check_output_masks(model.name, keras.tree.flatten(outputs))
    outputs = keras.tree.map_structure(masks.output, outputs)
    flat = keras.Model(inputs, outputs, name=f"{model.name}_staged")
    copy_weights(origin)
    # a weight the original does not train though its layer is trainable (a nested model or the model frozen
    # around a layer set trainable again: Keras trains nothing there) is not trained by its clone either; the
    # flat model has no enclosing model to freeze it (found by probing, stop 38: the clone trained, 0.14 off)
    trained = {id(v) for v in model.trainable_weights}
    for original, clone in origin:
        for a, b in zip(original.weights, clone.weights, strict=True):
            if b.trainable and id(a) not in trained:
                b.trainable = False
    return Rebuilt(flat, device_of, origin, node_of, tuple(masks.device[id(t)] for t in flat.inputs), clones)


def _moved_activation(call: LayerCall, calls: list[LayerCall], clone: Any) -> bool:
    """Whether the model output ``call`` makes (its only output, read by no other call) can come from its clone
    without its activation and an ``Activation`` on the last stage: a layer called once, without a Keras mask
    on its output, whose ``activation`` is Keras' softmax or sigmoid (the output then carries the logits
    Keras' cross-entropies compute from, which a stage boundary drops)."""
    import keras

    operation = call.operation
    if not isinstance(operation, keras.layers.Layer) or len(call.node.output_tensors) != 1:
        return False
    if sum(c.operation is operation for c in calls) > 1 or keras_mask(call.node.output_tensors[0]) is not None:
        return False
    activation = getattr(clone, "activation", None)
    return activation is not None and activation in (keras.activations.softmax, keras.activations.sigmoid)


class _Masks:
    """Places the ops that compute Keras masks, and puts masks back on tensors that cross devices.

    Keras keeps a tensor's mask as an attribute of the tensor object (``_keras_mask``), computed
    by op nodes a layer's ``compute_mask`` adds beside the graph. A layer that takes the mask as an
    argument gets it as a tensor of the graph (Keras records it in the call), but some read the
    attribute itself (MultiHeadAttention's query mask, the merge layers Add, Multiply, ...), and a
    stage boundary passes values, not attributes. So each tensor that carries a mask gets, on each
    other device that reads it, a ``MaskCarrier`` call that sets the attribute again from the mask
    tensor, and the mask's ops run on the device of the layer whose output it masks.
    """

    def __init__(self, device_of: dict[int, str], taken: set[str]) -> None:
        self.device_of = device_of  # filled in: id(mask op or carrier) -> device
        self.taken = taken  # names in the flat model
        self.known: set[int] = set()  # ids of tensors of the flat graph and of masks already placed
        self.device: dict[int, str] = {}  # id(tensor) -> device of the call that produced it
        self.carriers: dict[tuple[int, str], Any] = {}  # (id(tensor), device) -> the tensor with its mask

    def produced(self, tensor: Any, device: str) -> None:
        """Records a new tensor of the flat graph and places the ops of its mask on ``device``."""
        self.known.add(id(tensor))
        self.device[id(tensor)] = device
        own = keras_mask(tensor)
        pending = [] if own is None else [own]
        while pending:
            mask = pending.pop()
            if id(mask) in self.known:
                continue
            self.known.add(id(mask))
            history = keras_history(mask)
            if history is None or history.operation is None:
                continue
            self.device_of.setdefault(id(history.operation), device)
            pending.extend(inbound_nodes(history.operation)[history.node_index].input_tensors)

    def carried(self, tensor: Any, device: str) -> Any:
        """``tensor`` as a call on ``device`` reads it: with its mask set again if it crosses devices."""
        mask = keras_mask(tensor)
        if mask is None or self.device.get(id(tensor), device) == device:
            return tensor
        return self._carry(tensor, mask, device)

    def output(self, tensor: Any) -> Any:
        """A model output as the flat model returns it: a masked one through a carrier on its own device,
        which takes the mask as an argument, so the mask's ops are nodes of the flat graph (a stage can
        return the mask, and the loss read it) even where no layer of the model reads it."""
        mask = keras_mask(tensor)
        return tensor if mask is None else self._carry(tensor, mask, self.device[id(tensor)])

    def _carry(self, tensor: Any, mask: Any, device: str) -> Any:
        key = (id(tensor), device)
        if key not in self.carriers:
            import tensorflow as tf

            number = len(self.carriers)
            while f"mask_carrier_{number}" in self.taken:
                number += 1
            name = f"mask_carrier_{number}"
            self.taken.add(name)
            with tf.device(device):
                carrier = _mask_carrier_class()(name=name)
                self.carriers[key] = carrier(tensor, mask)
            self.device_of[id(carrier)] = device
            self.device[id(self.carriers[key])] = device
            self.known.add(id(self.carriers[key]))
        return self.carriers[key]


@functools.cache
def _mask_carrier_class() -> type:
    import keras

    class MaskCarrier(keras.layers.Layer):  # type: ignore[misc]  # keras ships no type hints
        """Returns its input with ``mask`` set as its Keras mask (the identity on values and gradients)."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(autocast=False, **kwargs)
            self.supports_masking = True

        def call(self, inputs: Any, mask: Any) -> Any:
            outputs = keras.ops.copy(inputs)
            set_keras_mask(outputs, mask)
            return outputs

        def compute_mask(self, inputs: Any, previous_mask: Any = None) -> Any:
            return previous_mask

    return MaskCarrier


def _check_output_masks(model_name: str, outputs: list[Any]) -> None:
    """Raises ProfileError for masked outputs the pipelined loss cannot weight as Keras does.

    Keras' mean loss over a masked output is the mean over its valid steps; the runtime makes each
    micro-batch's loss count its valid steps (``runtime.executor``), which is exact when every output
    carries one same mask (or none does). Read on the flat graph: a nested model's output carries
    no mask symbolically, but at run time it carries the mask of the layer that made it, and so does
    the flat graph's tensor.
    """
    masks = [keras_mask(t) for t in outputs]
    if all(m is None for m in masks) or all(m is masks[0] for m in masks):
        return
    names = [keras_history(t).operation.name for t in outputs]
    masked = [n for n, m in zip(names, masks) if m is not None]
    raise ProfileError(
        f"Model '{model_name}' returns the masked output(s) {masked} among the outputs {names}, with "
        "different masks or beside unmasked outputs: the pipelined loss can count the valid steps of one "
        "mask only, so it would differ from the original's. Expected every output masked by the same mask, "
        "or none: drop the masks before the outputs (e.g. a pooling layer reading them) and weight the loss "
        "with fit(..., sample_weight=...) instead."
    )


def _clone_names(calls: list[LayerCall]) -> dict[int, str]:
    """id(operation) -> a name for its clone, unique in the flat model.

    The original name where it is unique after flattening; else the node name (``"inner/fc"``)
    with ``"_"`` for ``"/"`` (Keras forbids ``"/"``), numbered if even that is taken.
    """
    first: dict[int, LayerCall] = {}
    for call in calls:
        first.setdefault(id(call.operation), call)
    base = {key: call.name for key, call in first.items()}  # a first call is named as its layer (or "outer/layer")
    taken = {call.operation.name for key, call in first.items() if base[key] == call.operation.name}
    names: dict[int, str] = {}
    for key, call in first.items():
        name = call.operation.name
        if base[key] != name:
            name = candidate = base[key].replace("/", "_")
            number = 1
            while name in taken:
                name = f"{candidate}_{number}"
                number += 1
            taken.add(name)
        names[key] = name
    return names


def clone_operation(operation: Any, name: str) -> Any:
    """A fresh copy of a layer or Keras op, named ``name``, made from its config (weights not copied).

    A Lambda layer gets the user's own function back rather than a deserialized one (its config
    holds Python bytecode, which Keras loads only with unsafe deserialization, or a function's name,
    which Keras finds only when it is registered). Any other layer is made from its config with the
    user's code at hand (``user_code``: a ``TimeDistributed(Lambda(f))``). A Keras op that has
    no config (made with arguments Keras cannot serialize) is used as it is: ops hold no state.
    """
    import keras

    if isinstance(operation, keras.layers.Lambda):
        config = keras.layers.Layer.get_config(operation)  # name, trainable, dtype: no function
        config["name"] = name
        return keras.layers.Lambda(
            operation.function,
            output_shape=lambda_output_shape(operation),
            mask=operation.mask,
            arguments=operation.arguments,
            **config,
        )
    alike = [(key, functions) for key, functions in _functions_by_name(operation).items() if len(functions) > 1]
    if alike:
        key, functions = alike[0]
        raise ProfileError(
            f"Cannot copy '{operation.name}' ({type(operation).__name__}): it holds {len(functions)} different "
            f"functions named {key!r}, which its config names alike, so a copy made from the config cannot tell "
            "them apart. Expected one name per function; give each its own name (set its __name__)."
        )
    try:
        config = operation.get_config()
        if "name" in config:
            config = {**config, "name": name}
        with user_code(operation):
            clone = operation.__class__.from_config(config)
    except Exception as err:
        if not isinstance(operation, keras.layers.Layer) and operation.name == name:
            return operation  # a Keras op holds no state: the same op, called once more in the flat graph
        library = type(operation).__module__.split(".")[0]
        advice = (
            f"the layer is {library}'s own, whose get_config does not give back its arguments (keras-hub 0.32's "
            "Llama, Qwen3, GPT-NeoX and ViT blocks; keras.models.clone_model fails on them too): this runtime "
            "wraps such a layer only inside a keras-hub Backbone, which it rebuilds from the backbone's own config; "
            "wrap the backbone (or a task holding it), or train it unwrapped."
            if library in ("keras_hub", "keras_nlp", "keras_cv")
            else "Expected every layer to be rebuildable from its config, as keras.models.clone_model needs; "
            "implement get_config() (returning every __init__ argument) in the layer's class."
        )
        raise ProfileError(
            f"Cannot copy '{operation.name}' ({type(operation).__name__}): "
            f"from_config(get_config()) failed with {type(err).__name__}: {' '.join(str(err).split()).rstrip('.')}. "
            f"{advice[0].upper()}{advice[1:]}"
        ) from err
    if clone.name != name:  # an op whose __init__ takes no name
        clone.name = name
    return clone


@contextlib.contextmanager
def user_code(operation: Any) -> Iterator[None]:
    """Keras' deserialization, for a moment, as for the user's own model in memory (not a file): a Python
    lambda is made from its bytecode (what Keras' safe mode refuses from a file), and a function that a
    layer inside ``operation`` holds (a Lambda's, an ``activation=my_fn``) and its config names is that
    very function, where no other function there has its name (else Keras looks the name up in its
    registry, as it does when loading a file)."""
    import keras

    functions = {key: named[0] for key, named in _functions_by_name(operation).items() if len(named) == 1}
    with unsafe_deserialization(), keras.saving.custom_object_scope(functions):
        yield


def _functions_by_name(operation: Any) -> dict[str, list[Any]]:
    """{name: the different functions of that name} that the layers inside ``operation`` hold (a Lambda's
    function, an ``activation=my_fn``), of those a config names by their bare name: the user's own,
    unregistered functions (Keras' own are named by their module, registered ones by their registered
    name, Python lambdas by their bytecode)."""
    import keras

    by_name: dict[str, list[Any]] = {}
    for layer in flatten_layers(operation):
        for value in vars(layer).values():
            if (
                isinstance(value, types.FunctionType)
                and value.__name__ != "<lambda>"
                and value.__module__.split(".")[0] not in ("keras", "keras_hub", "tensorflow")
                and keras.saving.get_registered_name(value) == value.__name__
            ):
                named = by_name.setdefault(value.__name__, [])
                if not any(value is f for f in named):
                    named.append(value)
    return by_name


def seed_states(operation: Any) -> list[Any]:
    """The state variables of the seed generators (dropout and other random layers) in a layer, in order."""
    return [generator.state for layer in flatten_layers(operation) for generator in seed_generators(layer)]


def _keeps_state(operation: Any) -> bool:
    """True iff ``operation`` or a layer in it adapts to data or saves assets (see ``copy_weights``)."""
    return any(hasattr(layer, "finalize_state") or hasattr(layer, "save_assets") for layer in flatten_layers(operation))


def _variable_pairs(source: Any, destination: Any) -> list[tuple[Any, Any]]:
    """(a variable of ``source``, the same of its copy ``destination``) for every weight: in order, or by name where
    each name is the layer's once and the copy made them in another order (a Dense quantized to float8 after it
    was built holds its scales before its kernel; its copy from the config after: found by probing, stop 38).

    Raises:
        ProfileError: when the copy holds other weights than the layer (Keras cannot rebuild it from its config).
    """
    names, copied = [v.name for v in source.weights], [v.name for v in destination.weights]
    if len(names) == len(copied) and (names == copied or len(set(names)) < len(names)):
        pairs = list(zip(source.weights, destination.weights))
    elif sorted(names) == sorted(copied):
        by_name = {v.name: v for v in destination.weights}
        pairs = [(v, by_name[v.name]) for v in source.weights]
    else:
        raise ProfileError(
            f"Cannot copy layer '{source.name}' ({type(source).__name__}): it holds {len(names)} weights, its copy "
            f"made from its config {len(copied)}, so Keras cannot rebuild it from its config (keras.models."
            "clone_model(model) fails the same way; a MultiHeadAttention quantized to int8 does). Expected a layer "
            "whose config and build make the same weights: leave this layer unquantized (model.quantize(mode, "
            "filters=...) chooses the layers), or train the model before quantizing it."
        )
    for a, b in pairs:
        if tuple(a.shape) != tuple(b.shape):
            raise ProfileError(
                f"Cannot copy layer '{source.name}' ({type(source).__name__}): its weight '{a.name}' has shape "
                f"{tuple(a.shape)}, its copy's made from its config {tuple(b.shape)}. Expected a layer whose config "
                "and build make the same weights (keras.models.clone_model(model) fails the same way)."
            )
    return pairs


def copy_weights(pairs: list[tuple[Any, Any]]) -> None:
    """Sets each destination's weights, kept state and random-seed states to its source's: [(source, destination), ...];
    each variable also takes its source's ``trainable``, ``constraint`` and ``regularizer``.

    The seed states go along so that a copy draws the dropout masks its source would draw next.
    Layers that adapt to data (``finalize_state``) or save assets keep state that ``set_weights``
    does not set: Normalization's mean and variance are tensors derived from its variables (its
    ``load_own_variables`` derives them again), a lookup's vocabulary (StringLookup, IntegerLookup,
    TextVectorization) is a lookup table that Keras saves as an asset, and a TF-IDF lookup's weights
    a variable outside ``weights``, a Discretization's bin boundaries an attribute (Keras saves them
    in its config). Each such layer inside a pair is copied as Keras' ``save`` and
    ``load_model`` copy it: ``save_own_variables`` into ``load_own_variables``, then ``save_assets``
    into ``load_assets`` through a temporary folder. Other layers are copied by ``set_weights`` only
    (Keras' ``save_own_variables`` of a Dense with LoRA would merge the adapters into the kernel).
    """
    for source, destination in pairs:
        for a, b in _variable_pairs(source, destination):
            b.assign(a.value)
            # what a variable carries beside its value, set on it rather than in its layer's config (found by
            # probing, stop 38: a kernel frozen by `kernel.trainable = False` trained, 0.14 off; a constraint
            # and a regularizer set on a variable were dropped)
            if b.trainable != a.trainable:
                b.trainable = a.trainable
            b.constraint, b.regularizer = a.constraint, a.regularizer
        sources, destinations = flatten_layers(source), flatten_layers(destination)
        if len(sources) != len(destinations):
            raise ProfileError(
                f"Cannot copy the state of '{source.name}' into '{destination.name}': they hold "
                f"{len(sources)} and {len(destinations)} layers. Expected the copy made from the layer's "
                "config to hold the same layers; make the layer's build create every layer inside it."
            )
        for layer, copy in zip(sources, destinations):
            if _keeps_state(layer):
                store: dict[str, Any] = {}
                layer.save_own_variables(store)
                copy.load_own_variables(store)
                if hasattr(layer, "save_assets"):
                    with tempfile.TemporaryDirectory() as folder:
                        layer.save_assets(folder)
                        copy.load_assets(folder)
                if getattr(layer, "bin_boundaries", None) is not None:  # Discretization's, kept in its config
                    copy.bin_boundaries = list(layer.bin_boundaries)  # (adapted on the wrapped model: lost, probe)
        for state, copy in zip(seed_states(source), seed_states(destination)):
            copy.assign(state.value)
