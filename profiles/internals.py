"""The fence: every use of a Keras or TensorFlow internal (``keras.src``, private attributes) in one module.

Keras 3 and TensorFlow give no public API for some of what the profiler and the runtime must do: walk a
functional model's graph of nodes, find the layers inside a layer, set a tensor's Keras mask, weight each
output's loss of a compiled model, build a loop body without automatic control dependencies. Each such
use is one small function here, with a comment: what it reaches, why no public API does it, and the
versions it was checked on. Every other module of ``profiles/``, ``runtime/``, ``examples/`` and
``benchmarks/`` calls these functions; ``tests/profiles/test_internals.py`` proves that no other module
imports ``keras.src`` or ``tensorflow.python`` or reads one of the private names in ``PRIVATE_NAMES``.

When bumping Keras or TensorFlow (``pyproject.toml`` states the tested range), check each function below
against the new version: the attribute still exists and still means the same. "Checked on 3.15" means
Keras 3.15.1 with TensorFlow 2.21.0 (the test suite runs them); "absent in 3.3" means not found in the
Keras 3.3.3 wheel, so the code cannot run there.

Why here and not in ``runtime/``: ``runtime`` imports ``profiles`` (the model's layer graph, its input
shapes), and ``profiles`` needs internals too (``walk.py``, ``shapes.py``, ``flops.py``, ``timing.py``);
``profiles`` importing ``runtime`` would be an import cycle and an upward import. So the fence sits in the
lower package. It imports neither Keras nor TensorFlow when imported (``profiles`` must not: the CLI
reads input shapes without TensorFlow); each function imports what it reaches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

# The private attribute names of Keras and TensorFlow objects read only here (the fence test holds this).
PRIVATE_NAMES = frozenset(
    {
        # keras Functional / Sequential / Operation / KerasTensor
        "_nodes_by_depth",
        "_operations",
        "_inbound_nodes",
        "_inputs_struct",
        "_outputs_struct",
        "_functional",
        "_keras_history",
        "_keras_mask",
        "_standardize_inputs",
        "_run_through_graph",
        # keras Layer
        "_flatten_layers",
        "_call_context_args",
        "_seed_generators",
        "_get_own_losses",
        "_clear_losses",
        "_get_regularization_losses",
        "_output_shape",
        "_reduction_axes",
        # keras Model, its trainer and CompileLoss
        "_compile_config",
        "_compile_loss",
        "_loss_tracker",
        "_initial_epoch",
        "_flat_losses",
        "_metrics",
        # keras Optimizer and Variable
        "_apply_weight_decay",
        "_exclude_from_weight_decay",
        "_exclude_from_weight_decay_pattern",
        "_exclude_from_weight_decay_cache",
        "_var_key",
        "_value",
        # tensorflow FuncGraph
        "_add_control_dependencies",
        "_get_function",
    }
)


# ----- the functional graph --------------------------------------------------------------------------


def is_functional(model: Any) -> bool:
    """True iff ``model`` has a functional graph of nodes (a Functional model, not a subclassed one).

    Reaches ``Functional._nodes_by_depth``: Keras has no public "is functional" test (the class
    ``keras.src.models.functional.Functional`` is private too). Checked on 3.15, present in 3.3.
    """
    return hasattr(model, "_nodes_by_depth")


def nodes_by_depth(functional: Any) -> dict[int, list[Any]]:
    """{depth: the Keras nodes at that depth} of a functional model (depth 0: the outputs' nodes).

    Reaches ``Functional._nodes_by_depth``: no public API lists a graph's nodes, only its layers.
    Checked on 3.15, present in 3.3.
    """
    return functional._nodes_by_depth  # type: ignore[no-any-return]


def operation_order(functional: Any) -> list[Any]:
    """The operations of a functional model in Keras' own order (``Function._operations``).

    Reaches ``_operations`` as the order Keras built it (``Functional.layers`` leaves the Keras ops out;
    ``Function.operations`` is a copy of this list, but ``keras.Model`` does not promise it).
    Checked on 3.15, present in 3.3.
    """
    return functional._operations  # type: ignore[no-any-return]


def inbound_nodes(operation: Any) -> list[Any]:
    """The nodes of every call of ``operation``, in call order (``Operation._inbound_nodes``).

    No public API gives a layer's calls. Checked on 3.15, present in 3.3.
    """
    return operation._inbound_nodes  # type: ignore[no-any-return]


def input_structure(functional: Any) -> Any:
    """The nesting of a functional model's inputs as it was built (a list, one tensor, a dict).

    Reaches ``Functional._inputs_struct``: ``model.inputs`` is flat, and a dict of inputs (keras-hub)
    must be given back as a dict. Checked on 3.15, present in 3.3.
    """
    return functional._inputs_struct


def output_structure(functional: Any) -> Any:
    """The nesting of a functional model's outputs as it was built (``Functional._outputs_struct``).

    ``model.outputs`` is flat. Checked on 3.15, present in 3.3.
    """
    return functional._outputs_struct


def sequential_graph(model: Any) -> Any | None:
    """The Functional graph a built ``keras.Sequential`` keeps, None when it is not built.

    Reaches ``Sequential._functional``: no public API gives it. Checked on 3.15, present in 3.3.
    """
    return getattr(model, "_functional", None)


def functional_class() -> type:
    """Keras' ``Functional`` model class, which ``keras.Model(inputs, outputs)`` makes.

    ``keras.src.models.functional.Functional``: ``keras.Model`` is its base, and no public name
    tells a plain functional model from a functional subclass. Checked on 3.15, present in 3.3.
    """
    from keras.src.models.functional import Functional

    return Functional  # type: ignore[no-any-return]


def standardize_inputs(functional: Any, inputs: Any) -> list[Any]:
    """``inputs`` as the flat list a functional model's graph takes (``Functional._standardize_inputs``:
    the dict, list or single tensor the user passes, matched to the model's inputs, cast as Keras does).

    Used so the pipelined model takes what the original takes; no public API does this matching.
    Checked on 3.15, present in 3.3.
    """
    return functional._standardize_inputs(inputs)  # type: ignore[no-any-return]


def run_through_graph(functional: Any, inputs: list[Any], operation_fn: Callable[[Any], Any]) -> Any:
    """Runs a functional model's graph on flat ``inputs``, each operation called through
    ``operation_fn(operation)`` (``Function._run_through_graph``): how the pipelined model's ``call``
    puts each layer on its device. No public API runs a graph with a hook per operation.
    Checked on 3.15, present in 3.3.
    """
    return functional._run_through_graph(inputs, operation_fn=operation_fn)


def keras_history(tensor: Any) -> Any:
    """The (operation, node_index, tensor_index) that made a symbolic tensor, or None.

    Reaches ``KerasTensor._keras_history``: no public API gives a symbolic tensor's producer.
    Checked on 3.15, present in 3.3.
    """
    return getattr(tensor, "_keras_history", None)


# ----- masks -----------------------------------------------------------------------------------------


def keras_mask(tensor: Any) -> Any | None:
    """The Keras mask a tensor carries as its attribute ``_keras_mask`` (symbolic tensors), or None.

    Keras keeps masks as a tensor attribute and has no public getter. Checked on 3.15, present in 3.3.
    """
    return getattr(tensor, "_keras_mask", None)


def get_keras_mask(tensor: Any) -> Any | None:
    """Keras' own getter of a tensor's mask (``keras.src.backend.get_keras_mask``, what its layers call).

    Not in ``keras.backend``'s public names. Checked on 3.15, absent in 3.3.
    """
    from keras.src.backend import get_keras_mask as get

    return get(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
    """Keras' own setter of a tensor's mask (``keras.src.backend.set_keras_mask``, what its layers call).

    Not in ``keras.backend``'s public names. Checked on 3.15, absent in 3.3.
    """
    from keras.src.backend import set_keras_mask as set_mask

    set_mask(tensor, mask)


def keras_logits(tensor: Any) -> Any | None:
    """The logits Keras keeps on a softmax's or sigmoid's output (``_keras_logits``, set by its TensorFlow
    backend's ``softmax`` and ``sigmoid``, so by ``activation="softmax"`` and ``keras.ops.softmax``), or None.

    Keras' cross-entropies (``backend.tensorflow.nn._get_logits``) compute from these logits rather than from
    the clipped probabilities. Reaches a private attribute. Checked on 3.15.
    """
    return getattr(tensor, "_keras_logits", None)


def set_keras_logits(tensor: Any, logits: Any) -> None:
    """Puts ``logits`` on ``tensor`` as Keras' softmax and sigmoid do (``keras_logits``)."""
    tensor._keras_logits = logits


# ----- layers ----------------------------------------------------------------------------------------


def flatten_layers(operation: Any, include_self: bool = True, recursive: bool = True) -> list[Any]:
    """The layers inside ``operation`` (itself first when ``include_self``), recursively by default, in
    Keras' order; a Keras op (no layer): itself, or nothing when not ``include_self``.

    Reaches ``Layer._flatten_layers``: ``Model.layers`` goes one level down and a plain Layer has no
    public list of its sublayers. Checked on 3.15, present in 3.3.
    """
    if not hasattr(operation, "_flatten_layers"):
        return [operation] if include_self else []
    return list(operation._flatten_layers(include_self=include_self, recursive=recursive))


def replace_sublayer(layer: Any, attribute: str, sublayer: Any) -> None:
    """Sets ``layer.<attribute>`` (a layer it tracks) to ``sublayer``, in the place the old one held among
    ``layer``'s tracked layers, so its weights keep their order in ``layer.weights``; the old one is no longer
    tracked. Before ``layer`` is built, or where its build reads no more than the sublayer's config (Keras'
    wrappers, keras-hub's ``MaskedLMHead`` and ``TokenAndPositionEmbedding`` call the layer they hold at call
    time).

    Reaches ``Layer._tracker`` and ``Layer._layers``: Keras tracks a layer set as an attribute by appending it,
    and does not untrack the one it replaces. Checked on 3.15.
    """
    old = getattr(layer, attribute)
    tracked = layer._layers
    position = next(i for i, held in enumerate(tracked) if held is old)
    ids = layer._tracker.stored_ids["layers"]
    ids.discard(id(old))
    ids.add(id(sublayer))
    tracked[position] = sublayer
    object.__setattr__(layer, attribute, sublayer)


def takes_training(operation: Any) -> bool:
    """True iff calling ``operation`` takes ``training=`` (Keras passes it on to it from the outer call).

    Reaches ``Layer._call_context_args``: the set Keras consults itself; a signature check would miss
    a layer that reads ``training`` through ``**kwargs``. Checked on 3.15, absent in 3.3.
    """
    return "training" in getattr(operation, "_call_context_args", {})


def seed_generators(layer: Any) -> list[Any]:
    """The seed generators (dropout and other random layers) a layer tracks itself (not its sublayers').

    Reaches ``Layer._seed_generators``: no public API lists them. Checked on 3.15, present in 3.3.
    """
    return list(getattr(layer, "_seed_generators", []))


def own_variables(layer: Any) -> list[Any]:
    """The variables ``layer`` itself tracks (not its sublayers'), trainable or not.

    Reaches ``Layer._trainable_variables`` and ``Layer._non_trainable_variables``: ``layer.variables`` adds the
    sublayers'. Checked on 3.15.
    """
    return [*getattr(layer, "_trainable_variables", []), *getattr(layer, "_non_trainable_variables", [])]


def own_losses(layer: Any) -> list[Any]:
    """The losses ``layer`` itself added in its last call (``add_loss``, activity regularizer).

    Reaches ``Layer._get_own_losses``: ``layer.losses`` adds the sublayers' and the weight
    regularizers'. Checked on 3.15, present in 3.3.
    """
    return list(layer._get_own_losses())


def clear_losses(layer: Any) -> None:
    """Drops the losses ``layer`` and its sublayers keep from their last call (``Layer._clear_losses``).

    Keras calls it itself at the start of an outermost call; no public API. Checked on 3.15, present in 3.3.
    """
    layer._clear_losses()


def regularization_losses(operation: Any) -> list[Any]:
    """The penalties of the weight regularizers of ``operation`` and its sublayers (none for a Keras op).

    Reaches ``Layer._get_regularization_losses``: ``layer.losses`` mixes them with the added losses.
    Checked on 3.15, present in 3.3.
    """
    return list(getattr(operation, "_get_regularization_losses", list)())


def global_seed_state() -> Any:
    """A copy of the state of Keras' global seed generator, which ``keras.random.*`` draws from without a
    ``seed`` (None where none was made yet: reading does not make one). Reaches ``global_state``'s
    ``global_seed_generator`` attribute (keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR); checked on 3.15."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
    return None if generator is None else np.asarray(generator.state.numpy()).copy()


def lambda_output_shape(layer: Any) -> Any:
    """The ``output_shape`` argument a ``keras.layers.Lambda`` was made with (``Lambda._output_shape``).

    Its config serializes the argument; the object itself has no public attribute. Checked on 3.15.
    """
    return layer._output_shape


def reduction_axes(batch_norm: Any) -> list[int]:
    """The axes a ``keras.layers.BatchNormalization`` averages over: all but its ``axis``.

    Reaches ``BatchNormalization._reduction_axes``, set in ``build``. Checked on 3.15, present in 3.3.
    """
    return batch_norm._reduction_axes  # type: ignore[no-any-return]


@contextlib.contextmanager
def embedding_calls_observed(observe: Callable[[Any, Any], None]) -> Iterator[None]:
    """While the block runs, every ``keras.layers.Embedding`` call first calls ``observe(layer, ids)``.

    Replaces ``Embedding.call`` on the class: Keras' ``Layer.__call__`` calls ``self.call``, and
    subclasses that look rows up call it through ``super()``. No public hook sees a lookup inside a layer
    of the user's. Checked on 3.15.
    """
    import keras

    original = keras.layers.Embedding.call

    def call(layer: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        observe(layer, inputs)
        return original(layer, inputs, *args, **kwargs)

    keras.layers.Embedding.call = call
    try:
        yield
    finally:
        keras.layers.Embedding.call = original


def open_name_scope_callers() -> list[Any]:
    """The objects whose Keras name scopes are open now, outermost first (the layers building or called,
    a seed generator making its state).

    Reaches ``keras.src.backend.common.global_state``'s ``name_scope_stack`` (entries opened by
    ``Layer._open_name_scope``): ``name_scope.current_path()`` joins the names only, losing which are
    layers. Checked on 3.15, present in 3.3.
    """
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    return [entry.caller for entry in stack]


@contextlib.contextmanager
def unsafe_deserialization() -> Iterator[None]:
    """Keras' safe mode off while the block runs: a Python lambda is made from its bytecode.

    ``keras.src.saving.serialization_lib.SafeModeScope``: no public scope (``keras.config`` has a
    global switch only). Checked on 3.15, present in 3.3.
    """
    from keras.src.saving.serialization_lib import SafeModeScope

    with SafeModeScope(False):
        yield


# ----- the compiled model ----------------------------------------------------------------------------


def compile_config(model: Any) -> dict[str, Any] | None:
    """The arguments ``model.compile`` was called with, as Keras keeps them (None when never compiled).

    Reaches ``Model._compile_config``: ``get_compile_config()`` serializes them, which would look a
    plain Python function (``loss=my_loss``) up by its name in Keras' registry. Checked on 3.15,
    present in 3.3.
    """
    kept = getattr(model, "_compile_config", None)
    return None if kept is None else dict(kept.config)


def keras_compile_arguments(model: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments Keras' own ``compile`` would receive from ``model.compile(*args, **kwargs)`` where the
    model's class has a ``compile`` of its own (keras-hub's tasks fill in their "auto" optimizer, loss and
    metrics, and add metrics of their own), or None where its ``compile`` is Keras'.

    Runs the class's ``compile`` with Keras' ``Trainer.compile`` replaced by a recorder that stops it there: the
    model is not compiled, and what the class's ``compile`` does after Keras' (CausalLM sets its sampler) does
    not run. Reaches ``keras.src.trainers.trainer.Trainer`` (the class whose ``compile`` every Keras model's is;
    no public API resolves a subclass's defaults without compiling). Checked on 3.15 with keras-hub 0.32.
    """
    import inspect
    from unittest import mock

    from keras.src.trainers.trainer import Trainer

    if type(model).compile is Trainer.compile:
        return None
    recorded: dict[str, Any] = {}
    signature = inspect.signature(Trainer.compile)  # Keras' own, before the recorder takes its place

    class _Recorded(Exception):
        pass

    def record(self: Any, *given: Any, **named: Any) -> None:
        bound = signature.bind(self, *given, **named)
        recorded.update({k: v for k, v in bound.arguments.items() if k != "self"})
        raise _Recorded

    with mock.patch.object(Trainer, "compile", record), contextlib.suppress(_Recorded):
        type(model).compile(model, *args, **kwargs)
    return recorded


def compile_loss(model: Any) -> Any:
    """A compiled model's ``CompileLoss`` (the loss function ``compile(loss=...)`` made), or None.

    Reaches ``Trainer._compile_loss``: Keras' ``compute_loss`` calls it and adds ``model.losses``, which
    the pipeline computes itself. Checked on 3.15, present in 3.3.
    """
    return model._compile_loss


def compile_metrics(model: Any) -> Any:
    """A compiled model's ``CompileMetrics`` (the metrics ``compile(metrics=..., weighted_metrics=...)``
    made), or None. Keras' ``compute_metrics`` updates it; its ``build(y, y_pred)`` resolves the metrics
    ("accuracy" to a class by the outputs' shapes) and ``metrics`` lists them once built.

    Reaches ``Trainer._compile_metrics``. Checked on 3.15.
    """
    return model._compile_metrics


def metric_function(metric: Any) -> Any:
    """The function a ``keras.metrics.MeanMetricWrapper`` averages (``MeanMetricWrapper._fn``, no public
    accessor). Checked on 3.15."""
    return metric._fn


def metric_function_kwargs(metric: Any) -> dict[str, Any]:
    """The keyword arguments a ``keras.metrics.MeanMetricWrapper`` calls its function with
    (``MeanMetricWrapper._fn_kwargs``, no public accessor). Checked on 3.15."""
    return dict(getattr(metric, "_fn_kwargs", {}))


def loss_tracker(model: Any) -> Any:
    """The mean metric that logs a compiled model's "loss" (``Trainer._loss_tracker``).

    A custom ``train_step`` that does not call ``compute_loss`` must update it itself. Checked on 3.15,
    present in 3.3.
    """
    return model._loss_tracker


def initial_epoch(model: Any) -> int | None:
    """The epoch ``fit`` starts from, as read after ``on_train_begin`` (``BackupAndRestore`` sets it).

    Reaches ``Model._initial_epoch``; no public API. Checked on 3.15, present in 3.3.
    """
    return model._initial_epoch  # type: ignore[no-any-return]


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Sets the epoch ``fit`` starts from (``Model._initial_epoch``; see ``initial_epoch``)."""
    model._initial_epoch = epoch


def loss_entries(compile_loss: Any) -> list[Any]:
    """``CompileLoss``'s entries, one per output loss: namedtuples (path, loss, loss_weights, name).

    Reaches ``CompileLoss._flat_losses``, built on the first call. Checked on 3.15, absent in 3.3.
    """
    return list(compile_loss._flat_losses)


@contextlib.contextmanager
def scaled_loss_weights(compile_loss: Any, factors: Sequence[Any]) -> Iterator[None]:
    """While the block runs, each entry's loss weight is multiplied by its factor, and the per-output
    loss metrics are left alone.

    ``CompileLoss.call`` multiplies each output's loss by the ``loss_weights`` of its ``_flat_losses``
    entry, and updates ``_metrics`` (one per entry, when there are several) with the unweighted value;
    no public API weights a loss by a tensor. Checked on 3.15, absent in 3.3.
    """
    entries, metrics = compile_loss._flat_losses, compile_loss._metrics
    compile_loss._flat_losses = [
        entry._replace(loss_weights=factor if entry.loss_weights is None else factor * entry.loss_weights)
        for entry, factor in zip(entries, factors)
    ]
    if metrics:
        compile_loss._metrics = [None] * len(metrics)
    try:
        yield
    finally:
        compile_loss._flat_losses, compile_loss._metrics = entries, metrics


class _WeightedUpdates:
    """A metric whose ``update_state`` takes its own sample weight (``weighted_output_losses``)."""

    def __init__(self, metric: Any, weight: Any) -> None:
        self.metric, self.weight = metric, weight

    def update_state(self, values: Any, sample_weight: Any = None) -> Any:
        return self.metric.update_state(values, sample_weight=self.weight)


@contextlib.contextmanager
def weighted_output_losses(compile_loss: Any, weights: Sequence[Any]) -> Iterator[None]:
    """While the block runs, the per-output loss metrics (one per ``_flat_losses`` entry, when there are several)
    take each entry's value with ``weights[i]`` as its sample weight, where ``CompileLoss.call`` passes the output's
    static batch size (None, so a weight of 1, where the traced batch size is unknown). Reaches
    ``CompileLoss._metrics``; checked on 3.15."""
    metrics = compile_loss._metrics
    if metrics:
        compile_loss._metrics = [_WeightedUpdates(m, w) for m, w in zip(metrics, weights, strict=True)]
    try:
        yield
    finally:
        compile_loss._metrics = metrics


def compute_output_spec(function: Any, *args: Any) -> Any:
    """Calls ``function`` on symbolic ``args`` (``keras.src.backend.compute_output_spec``), as Keras'
    trainer builds its ``CompileLoss``: leaving no ops behind. Not in ``keras.backend``'s public names.
    Checked on 3.15, present in 3.3.
    """
    from keras.src.backend import compute_output_spec as spec

    return spec(function, *args)


# ----- the optimizer ---------------------------------------------------------------------------------


def weight_decay_function(optimizer: Any) -> Callable[[Any], None]:
    """The optimizer's method that applies weight decay to a list of variables (``_apply_weight_decay``).

    Wrapped by ``runtime.optimizer_state.place_updates`` to decay each variable on its device; the
    public ``apply`` does it inside. Checked on 3.15, present in 3.3.
    """
    return optimizer._apply_weight_decay  # type: ignore[no-any-return]


def set_weight_decay_function(optimizer: Any, function: Callable[[Any], None]) -> None:
    """Replaces the optimizer's ``_apply_weight_decay`` (see ``weight_decay_function``)."""
    optimizer._apply_weight_decay = function


def variable_key(optimizer: Any, variable: Any) -> Any:
    """How ``optimizer`` keys ``variable`` (``Optimizer._var_key``: its ``id``, or on TensorFlow its path and a
    number of its own). Checked on 3.15."""
    return optimizer._var_key(variable)


def weight_decay_exclusions(optimizer: Any) -> tuple[set[Any], Any]:
    """What ``optimizer.exclude_from_weight_decay`` set: the excluded variables' keys (``variable_key``) and the
    compiled pattern of excluded names (or None). Neither is in the optimizer's config. Reaches
    ``_exclude_from_weight_decay`` and ``_exclude_from_weight_decay_pattern``; checked on 3.15."""
    return set(getattr(optimizer, "_exclude_from_weight_decay", set())), getattr(
        optimizer, "_exclude_from_weight_decay_pattern", None
    )


def set_weight_decay_exclusions(optimizer: Any, keys: set[Any], pattern: Any) -> None:
    """Sets what ``weight_decay_exclusions`` reads (and empties Keras' cache of the decisions)."""
    optimizer._exclude_from_weight_decay = set(keys)
    optimizer._exclude_from_weight_decay_pattern = pattern
    optimizer._exclude_from_weight_decay_cache = {}


def backing_value(variable: Any) -> Any | None:
    """The TensorFlow variable behind a Keras variable (``Variable._value``), None for another object.

    Read for its device where ``variable.device`` is not a string; ``variable.value`` would read (and
    may cast) the value. Checked on 3.15, present in 3.3.
    """
    return getattr(variable, "_value", None)


# ----- TensorFlow ------------------------------------------------------------------------------------


@contextlib.contextmanager
def automatic_control_dependencies_off() -> Iterator[None]:
    """Ops built in the block get no automatic control dependencies from the current ``tf.function``.

    Reaches the graph attribute ``FuncGraph._add_control_dependencies`` that ``while_v2`` reads for a
    loop's body: TensorFlow has no public switch. Checked on TensorFlow 2.21.
    """
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    saved = graph._add_control_dependencies
    graph._add_control_dependencies = False
    try:
        yield
    finally:
        graph._add_control_dependencies = saved


def function_graph(graph: Any, name: str) -> Any | None:
    """The body graph of the function ``name`` that ``graph`` calls, or None where it has none.

    Reaches ``Graph._get_function``: no public API looks a called function up by name. Checked on
    TensorFlow 2.21.
    """
    import tensorflow as tf

    try:
        function = graph._get_function(name)
    except (AttributeError, KeyError, ValueError):
        return None
    if function is None:
        return None
    body = getattr(function, "graph", None)
    return body if isinstance(body, tf.Graph) else None


def sync_device(device: str) -> None:
    """Blocks until ``device`` has finished the work queued on it.

    What ``tf.test.experimental.sync_devices()`` does, for one device instead of all, from
    ``tensorflow.python.eager.context`` and ``tensorflow.python.ops.gen_sync_ops``; the public call
    (waiting for every device) where those modules have moved. Checked on TensorFlow 2.21.
    """
    import tensorflow as tf

    try:
        from tensorflow.python.eager import context
        from tensorflow.python.ops import gen_sync_ops
    except ImportError:  # pragma: no cover - older or newer TensorFlow layouts
        tf.test.experimental.sync_devices()
        return
    with tf.device(device):
        gen_sync_ops.SyncDevice()
    context.async_wait()


def eager_context() -> Any:
    """TensorFlow's eager context (``tensorflow.python.eager.context.context()``): its run metadata
    gives the graphs of the functions placed meanwhile, which no public API gives. Checked on
    TensorFlow 2.21.
    """
    from tensorflow.python.eager import context

    return context.context()
