"""Refuses models the pipeline would not run as written: steps of their own, layers that mix a batch's rows
or move their own state in training.

A ``PipelinedModel`` runs its own ``train_step``, ``test_step`` and ``predict_step`` over M
micro-batches of the batch, with Keras' compiled loss and metrics. Two kinds of model would then
compute something else than the original, silently, so ``plan_and_wrap`` and ``wrap`` refuse them
(``InputError``) before any weight is copied:

- ``check_steps``: a model whose class overrides a step (``train_step``, ``test_step``,
  ``predict_step``, ``compute_loss``, ``compute_metrics``) or ``call``. Such code runs on the whole
  model and the whole batch (``self(x)``, a tape over every weight), which micro-batches and stages
  cannot split; the pipelined model would skip it. Only the user's own classes are read: Keras'
  classes (``Functional``, ``Sequential``) are what the runtime reproduces. keras-hub's task models
  override ``compile`` (default optimizer and loss; ``wrapped.compile`` takes the user's own) and the
  front doors ``fit``, ``evaluate``, ``predict``, ``*_on_batch`` and ``__call__`` (to run a
  preprocessor first: a task with one is refused by ``profiles.walk``; without one they pass the data
  through), none of them a step, so ``GPT2CausalLM`` and ``BertTextClassifier`` are accepted. Its
  tasks that do override a step (RetinaNet's ``compute_loss`` and ``predict_step``, SigLIP's
  contrastive ``compute_loss``, ...) are refused, as their steps are not Keras'.
- ``check_rows``: a layer or op whose output rows do not come from the same rows of its inputs alone
  (``ops.concatenate(..., axis=0)``, a reshape or transpose across the batch axis, ``ops.mean(x,
  axis=0)``, ``x - ops.mean(x, axis=0)``, ``x + ops.sum(x)``). A micro-batch holds some of the batch's
  rows, so such an op sees other rows than in the original. It is found by running the original
  model, op by op, on a probe batch of 4 rows (random inputs, ``training=False``) and each op again on
  the first and the last 2 rows of its inputs::

      op(inputs[0:4])  ==  concat(op(inputs[0:2]), op(inputs[2:4]))   a row-wise op (most layers)
      op(inputs[0:4])  ==  op(inputs[0:2]) == op(inputs[2:4])          a tensor of its own (no rows)

  Each op gets exactly the rows the probe batch gave its inputs, so an op is judged alone and rounding
  does not add up along the model. With M > 1 the model runs twice more on probe batches whose halves
  differ in sign and scale (floats of the first half small and of one sign, each sign once; of the last
  half 30 times larger): a branch, a loop or a clip decided by a batch-wide value (``ops.cond(ops.mean(x)
  > 0, ...)``, ``x / ops.max(ops.abs(x))``) takes the batch's way on standard normal halves, and another
  way on these. An op that mixes rows and gives other values on a second run of the same rows draws
  random values when not training: it is refused as such. A layer's activity regularizer must be a sum
  over rows (each micro-batch applies it to its own rows and the parts are added): its value on the
  probe batch must be the sum of its values on the halves (Keras' L1 and L2 are; a mean is not). A
  stateful recurrent layer is refused at any M: its states carry rows from one batch to the next.

  A loss a layer adds (``add_loss``) is measured on the probe batch and its halves, in inference and, for a layer
  of the user's that takes ``training``, as in a training step: the same value on any rows (a penalty on the
  layer's weights) or the mean of the halves' (``ops.mean`` of per-row values, a variational autoencoder's KL
  term) splits exactly, each part's value weighted by its share of the batch's rows (a mean where M divides the
  batch: a remainder batch with repeated rows is refused at the step); a batch-wide value (a sum over the rows,
  a mixture of experts' load-balancing loss) is refused unless ``added_losses="per_microbatch"`` takes it the
  pipelines' way, per micro-batch.

  With M > 1 every op must be one of the two; with M = 1 (the micro-batch is the batch) an op may mix
  values, but no tensor may change the batch's row count: the runtime takes the batch's rows of the
  outputs, the loss's predictions and the regularized tensors. A model output must always have one row
  per input row.

  With M > 1 each op also runs once on the probe batch as in a training step (``training=True`` where it
  takes it), and one that changes a non-trainable variable of its own is refused: every micro-batch's forward
  would change it, M times a step where Keras changes it once (a running mean of the user's, a call
  counter, spectral normalization's power iteration). Batch normalization's statistics (``runtime.batchnorm``
  defers them) and the random layers' seed states are the runtime's to handle.

  A layer of the user's that takes ``training`` is also run on the probe batch and its halves with ``training=True``
  and its rows compared as above (a layer of the user's that centres its rows on the batch's mean in
  training only), unless it draws random values or holds a batch normalization (their training outputs
  differ between the batch and its halves by design).

  A layer of the user's (not ``_keras_own``: a Lambda, keras-hub's, a Keras layer holding a function of the user's
  or wrapping a layer of the user's) is also run backward (``_Probe._check_backward_rows``): its inputs' and
  weights' gradients for a random cotangent, on the batch against its halves, one scale for all of them.

  What the probe cannot see: a branch on a batch-wide value that neither probe batch crosses (a threshold
  far from the values the probe gives that op, the batch's row count above 4, which ``check_row_count``
  checks where B and M are known, a clip of the backward's batch-wide norm above what the probe's cotangent
  reaches), mixing only in training inside a layer that draws random
  values or holds a batch normalization (batch normalization itself is the known case, which ``runtime.batchnorm``
  handles), mixing too small for float tolerance (1e-4 of the tensor's largest magnitude in float32, a few ulps in 16
  bits), and rows the random inputs happen to make equal (integer inputs are 0 or 1, as in
  ``runtime.synthetic_batch``: a one-token input makes equal rows likely). The probe reads the
  model's weights and leaves every variable as it found it (it resets the non-trainable ones, seed
  states included, and the losses layers add).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from partitioner.errors import InputError
from profiles.internals import (
    clear_losses,
    flatten_layers,
    get_keras_mask,
    global_seed_state,
    input_structure,
    own_losses,
    own_variables,
    seed_generators,
    set_keras_mask,
    takes_training,
)
from profiles.shapes import InputShapes
from profiles.shapes import input_shapes as resolve_input_shapes
from profiles.timing import variables_kept
from profiles.walk import LayerCall, flatten_calls, functional_graph, graph_operations, tied_layers
from runtime.train_step import overwrites

STEPS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics", "call")
# what a user's class may override around the steps, which the wrapped model (a PipelinedModel) never calls;
# keras-hub's tasks override some of them to run their preprocessor, which the wrap refuses to hold
FRONT_DOORS = (
    "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch", "__call__",
    "make_train_function", "make_test_function", "make_predict_function",
)  # fmt: skip
_LIBRARIES = ("keras.", "keras_hub.", "keras_nlp.", "keras_cv.")
# how the losses layers add (add_loss) are split over a batch's parts: "exact" takes only those the split keeps
# exact, "per_microbatch" also a batch-wide one, each part's value weighted by its rows (``check_rows``)
ADDED_LOSSES = ("exact", "per_microbatch")
# what a layer's added loss is, found on the probe batch: the same on any rows (a penalty on weights), a mean
# over the rows, or a batch-wide value (a mixture of experts' load-balancing loss); in this order of rank
LOSS_KINDS = ("constant", "mean", "batch")
PROBE_ROWS = 4  # the probe batch; each op is run again on its first and its last half
_HALVES = ((0, PROBE_ROWS // 2), (PROBE_ROWS // 2, PROBE_ROWS))
# the contrasting probe batches: floats of the first half small and of one sign (each sign once), of the last
# half large and of both signs; the last half's size decides a batch-wide statistic (a mean's sign, a maximum)
_CONTRASTS = (1.0, -1.0)
_SMALL, _LARGE = 0.3, 30.0
_EPS_16_BITS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # float32 and wider: float32's eps


def check_steps(model: Any) -> None:
    """Raises InputError when ``model``'s own class (or a parent of its own) overrides a step or ``call``, or
    (outside Keras and keras-hub) a front door around the steps (``fit``, ``evaluate``, ... ``FRONT_DOORS``).

    Raises:
        ProfileError: for a model without a functional graph (a subclassed model), as ``profiles.walk``.
        InputError: naming the class and the overridden methods.

    Example:
        >>> check_steps(keras.Model(inputs, outputs))      # doctest: +SKIP
    """
    functional_graph(model)
    overridden = [
        f"{cls.__name__}.{name}"
        for cls in type(model).__mro__
        if not cls.__module__.startswith("keras.")
        for name in STEPS
        if name in vars(cls)
    ]
    if overridden:
        raise InputError(
            f"Model '{model.name}' is a {type(model).__name__} whose class overrides {', '.join(overridden)}: the "
            "pipelined model runs Keras' own steps over micro-batches and stages, so fit, evaluate and predict "
            "would skip that code. Expected a functional or Sequential model with Keras' steps: move the custom "
            "logic into the loss, a metric or a layer (add_loss), or train this model without wrapping it."
        )
    doors = [
        f"{cls.__name__}.{name}"
        for cls in type(model).__mro__
        if not cls.__module__.startswith(_LIBRARIES)
        for name in FRONT_DOORS
        if name in vars(cls)
    ]
    if doors:  # found by probing (stop 37): a fit that scaled its inputs was skipped, weights 0.11 apart
        raise InputError(
            f"Model '{model.name}' is a {type(model).__name__} whose class overrides {', '.join(doors)}: the wrapped "
            "model is a model of the runtime's own class, whose fit, evaluate, predict and their batch forms are "
            "Keras', so that code would not run. Expected a functional or Sequential model with Keras' own: do "
            "that work in the data pipeline or a callback, or train this model without wrapping it."
        )


def check_rows(
    model: Any,
    num_microbatches: int | str,
    *,
    num_replicas: int = 1,
    input_shapes: InputShapes | None = None,
    sequence_length: int | None = None,
    added_losses: str = "exact",
) -> RowCheck:
    """Raises InputError when an op of ``model`` mixes the rows of a batch where M micro-batches cannot;
    returns what each layer that adds a loss adds, for the stages to split it, and the probe batch.

    Args:
        model: a built Functional or Sequential keras.Model.
        num_microbatches: M, or "auto" (checked as M > 1); with M = 1 on one replica only changes of the
            row count are refused.
        num_replicas: D, the workers each training on its shard of the global batch: with D > 1 a shard is
            a part of the batch as a micro-batch is, and M = 1 is checked as M > 1.
        input_shapes, sequence_length: sizes for the model's unknown non-batch dimensions, as for
            ``plan_and_wrap``; without them every unknown dimension is 1.
        added_losses: "exact" refuses a layer whose added loss is a batch-wide value (neither a mean over the
            rows nor the same on any rows); "per_microbatch" accepts it (``ADDED_LOSSES``).

    Returns:
        A ``RowCheck``: {id(layer): its kind in ``LOSS_KINDS``} for every layer the probe saw add a loss
        (``add_loss``, in inference or, for a layer of the user's that takes ``training``, in training; an activity
        regularizer of the layer itself is checked apart), empty with M = 1 on one replica (the one part
        is the batch). The stages take each part's added loss times the part's share of the batch's rows:
        exact for a mean over the rows (where M divides the batch) and for a constant. And the probe batch,
        for ``check_rebuilt``.

    Raises:
        InputError: naming the first op (in the model's order) that mixes rows, or that fails on the
            probe batch, or whose added loss is batch-wide under ``added_losses="exact"``.

    Example:
        >>> check_rows(model, num_microbatches=4, sequence_length=16)      # doctest: +SKIP
    """
    functional = functional_graph(model)
    _check_stateless(functional)
    _check_overwritten(functional, num_replicas)
    calls, sources = flatten_calls(functional)
    _check_untied(functional, calls)
    if input_shapes is None and sequence_length is None:
        sequence_length = 1
    shapes = resolve_input_shapes(functional, input_shapes, sequence_length)
    if added_losses not in ADDED_LOSSES:
        raise InputError(f"added_losses must be one of {ADDED_LOSSES}. Received: added_losses={added_losses!r}.")
    with variables_kept(functional.non_trainable_variables):  # a layer run as in training moves them
        probe = _Probe(model.name, num_microbatches, num_replicas=num_replicas, added_losses=added_losses)
        for call in calls:
            probe.run(call, shapes)
        for tensor in functional.outputs:
            probe.check_output(calls, sources[id(tensor)])
        batch = [probe.produced[sources[id(t)].call][sources[id(t)].output].whole for t in functional.inputs]
        if probe.mixing_allowed:
            return RowCheck({}, batch, probe.global_draws, frozenset(probe.batched_lookups))
        for sign in _CONTRASTS:  # halves apart in sign and scale: a branch or a clip on a batch-wide statistic
            contrasting = _Probe(model.name, num_microbatches, contrast=sign, num_replicas=num_replicas)
            for call in calls:
                contrasting.run(call, shapes)
    return RowCheck(probe.loss_kinds, batch, probe.global_draws, frozenset(probe.batched_lookups))


class RowCheck(NamedTuple):
    """What ``check_rows`` found: what each layer's added loss is, the probe batch it ran the model on, and the
    layers that draw from Keras' global seed generator."""

    loss_kinds: dict[int, str]  # id(layer) -> its kind in LOSS_KINDS, for the layers that add a loss
    batch: list[Any]  # one tensor of PROBE_ROWS rows per model input, in the order of ``model.inputs``
    global_draws: set[int]  # id(op) of the ops whose call (in training, for a layer of the user's) drew from it
    # id(layer) of the Embedding layers of the graph whose ids the probe saw with the batch's rows (a lookup whose
    # ids lose their static batch size on the way, out of a TextVectorization, is still a row of ids per sample)
    batched_lookups: frozenset[int] = frozenset()


def check_recomputable(names: dict[str, int], recomputes: Callable[[int], bool]) -> None:
    """Raises InputError where a stage that recomputes its forward holds a layer that draws random values from
    Keras' global seed generator (``keras.random.normal(...)`` without a seed): the recompute would draw other
    values than the forward did, so the gradients would be of another forward than the loss (found by probing,
    stop 38: weights 0.17 off after one step). ``names``: {such a layer's name: its stage}."""
    for name, stage in names.items():
        if recomputes(stage):
            raise InputError(
                f"'{name}' draws random values from Keras' global seed generator (keras.random.* without a seed), "
                f"and stage {stage}, which holds it, recomputes its forward in its backward: the recompute would "
                "draw other values than the forward did. Expected a seed generator of the layer's own "
                "(self.seed_generator = keras.random.SeedGenerator(seed) in __init__, then seed=self.seed_generator "
                "in each draw), whose state the runtime replays; or recompute='never'."
            )


def check_rebuilt(original: Any, rebuilt: Any, batch: list[Any]) -> None:
    """Raises InputError where the rebuilt model (each layer made anew from its config on its device, given the
    original's weights) computes other outputs than the original on the probe batch ``batch`` (``RowCheck``), in
    inference: a layer whose state is neither in its config nor in its weights (an ``__init__`` argument its
    ``get_config`` leaves out, a tensor drawn in ``build``, sublayers Keras does not track) would train other
    numbers from the first step (found by probing, stop 38: predict 5.09 off at M = 1). A model whose inference
    draws random values (two runs of the original differ) is left alone. The models' non-trainable variables are
    put back after (seed states, a layer's own counts); state a layer keeps outside its variables is not."""
    functional = functional_graph(original)
    with variables_kept([*functional.non_trainable_variables, *rebuilt.non_trainable_variables]):  # seeds, counts
        first = _repeatable_inference(functional, batch)
        if first is None:
            return
        ours = _inference(rebuilt, batch)
    for position, (want, got) in enumerate(zip(first, ours, strict=True)):
        worst = _difference(got, _numpy(want))
        if worst is not None:
            raise InputError(
                f"Model '{original.name}' rebuilt for its devices computes other values than the original on a probe "
                f"batch of {PROBE_ROWS} rows: its output {position} differs by {worst:.3g} in inference. The runtime "
                "makes each layer anew from its config (Keras' get_config / from_config) and gives it the original's "
                "weights, so a layer whose state is in neither (an __init__ argument get_config leaves out, a tensor "
                "drawn in build, layers Keras does not track) comes out otherwise; keras.models.clone_model shows "
                "the same. Expected every layer's get_config to return all its __init__ arguments, and its state "
                "in weights (add_weight)."
            )


def check_row_count(model: Any, batch: list[Any], batch_size: int, num_microbatches: int) -> None:
    """Raises InputError where ``model``'s outputs on one micro-batch's rows differ from the same rows of the whole
    batch's, in inference: a layer of the user's that decides by the batch's row count (``ops.cond(ops.shape(x)[0]
    > 8, ...)``) above the probe batch's 4 rows, which ``check_rows`` cannot see (found by probing, stop 38-39:
    predict 3.4-5.0 off at B = 16, M = 2). The probe batch ``batch`` (``RowCheck``) is repeated to ``batch_size``
    rows; the micro-batch is its first ceil(B / M). Only for a model holding a layer of the user's (Keras' own
    layers do not branch on the row count); a model whose inference draws random values is left alone."""
    if num_microbatches < 2 or batch_size <= PROBE_ROWS:
        return
    functional = functional_graph(model)
    calls, _ = flatten_calls(functional)
    if all(_keras_own(call.operation) for call in calls if isinstance(call.operation, keras.layers.Layer)):
        return
    rows = -(-batch_size // num_microbatches)
    whole = [tf.gather(t, tf.range(batch_size) % PROBE_ROWS) for t in batch]
    with variables_kept(functional.non_trainable_variables):
        first = _repeatable_inference(functional, whole)
        if first is None:
            return
        part = _inference(functional, [t[:rows] for t in whole])
    for position, (want, got) in enumerate(zip(first, part, strict=True)):
        if not _batched(want, batch_size) or not _batched(got, rows):
            continue
        worst = _difference(got, _numpy(want)[:rows])
        if worst is not None:
            raise InputError(
                f"Model '{model.name}' computes other values for a micro-batch than for the same rows of its batch: "
                f"its output {position} on the first {rows} rows of a {batch_size}-row batch differs by {worst:.3g} "
                f"from the whole batch's, so with num_microbatches={num_microbatches} it would compute something "
                "else than the original. A layer of the user's decides by the batch's row count (a branch on "
                "ops.shape(x)[0]). Expected each row to depend on its own row alone: use num_microbatches=1, or "
                "keep the layer from depending on the batch's size."
            )


def _inference(model: Any, batch: list[Any]) -> list[Any]:
    """``model``'s flattened outputs on ``batch`` (a tensor per input, in ``model.inputs``' order), in inference."""
    return list(keras.tree.flatten(model(keras.tree.pack_sequence_as(input_structure(model), batch), training=False)))


def _repeatable_inference(model: Any, batch: list[Any]) -> list[Any] | None:
    """``_inference``, or None where a second run gives other outputs (the model draws random values there)."""
    first, second = _inference(model, batch), _inference(model, batch)
    if any(_difference(a, _numpy(b)) is not None for a, b in zip(first, second, strict=True)):
        return None
    return first


def _keras_own(operation: Any) -> bool:
    """A layer of Keras' own classes (and holding none of the user's, nor a Lambda, nor a function of the user's
    such as ``activation=my_fn``): the standard probe batch found its rows its own, and no Keras layer decides by a
    batch-wide value in inference, so the contrasting batches (``_CONTRASTS``) take its outputs from one run on
    the batch, its halves sliced from them, and its backward is not probed. (A Dense whose activation was the
    user's, mixing rows in its forward or its custom gradient, trained 0.11 apart at M = 2: found by probing,
    stop 39.)"""
    if not isinstance(operation, keras.layers.Layer):
        return False
    layers = flatten_layers(operation)
    return all(type(layer).__module__.startswith("keras.") for layer in layers) and not any(
        isinstance(layer, keras.layers.Lambda) or _holds_user_function(layer) for layer in layers
    )


def _holds_user_function(layer: Any) -> bool:
    """Whether ``layer`` holds a Python function of the user's as an attribute (``activation=my_fn``)."""
    return any(
        isinstance(value, types.FunctionType)
        and not str(getattr(value, "__module__", "") or "").startswith(("keras", "tensorflow"))
        for value in vars(layer).values()
    )


def _batched(value: Any, rows: int = PROBE_ROWS) -> bool:
    """Whether ``value`` has ``rows`` rows (the probe batch's by default)."""
    return value is not None and bool(value.shape) and value.shape[0] == rows


def _sliced(value: Any) -> tuple[Any, ...]:
    """The halves of a batched tensor's rows (a tensor without rows: itself, for each half)."""
    if not _batched(value):
        return tuple(value for _ in _HALVES)
    return tuple(value[a:b] for a, b in _HALVES)


def _check_stateless(model: Any) -> None:
    """Raises InputError for a stateful recurrent layer: its states hold a fixed batch size's rows and carry
    each row's last state into the same row of the next batch, which a pipeline's stages do not."""
    for layer in flatten_layers(model):
        if getattr(layer, "stateful", False):
            raise InputError(
                f"'{layer.name}' ({type(layer).__name__}) of model '{model.name}' is stateful (stateful=True): it "
                "keeps each row's last state for the same row of the next batch, across steps, which the pipeline "
                "does not carry (its stages run each micro-batch's forward on its own). Expected stateful=False: "
                "feed longer sequences instead, or train this model without the pipeline."
            )


def _check_overwritten(model: Any, num_replicas: int) -> None:
    """Raises InputError, with replicas, for a variable Keras' optimizer overwrites with its gradient
    (``overwrite_with_gradient``: float8 layers' scales and amax histories): the micro-batches of one replica take
    their values' maximum, as Keras' gradient accumulation does, but the replicas' all-reduce sums."""
    if num_replicas == 1:
        return
    for variable in model.trainable_variables:
        if overwrites(variable):
            raise InputError(
                f"'{variable.path}' of model '{model.name}' is overwritten with its gradient by the optimizer "
                f"(overwrite_with_gradient: a float8 layer's scale or amax history): the {num_replicas} workers' "
                "all-reduce sums gradients, which would sum those values. Expected one worker (micro-batches take "
                "their maximum, as Keras' gradient accumulation does), or a model without such variables."
            )


def _check_untied(model: Any, calls: list[LayerCall]) -> None:
    """Raises InputError where two layers of the flat graph hold one variable other than as ``tied_layers``
    (one layer holding the other as an attribute, which the rebuild keeps tied: keras-hub's ``MaskedLMHead``
    holds its backbone's token embedding). The runtime rebuilds each layer from its config on its device,
    which gives the second a copy of its own: the two would train apart (found by probing, stop 36:
    ``BertMaskedLM``'s token embedding updated by 0.69 of the original's, at any M, on one device too). A layer
    called twice (GPT2CausalLM's token embedding, for its logits) is one layer: it is cloned once."""
    operations = graph_operations(calls)
    owners: dict[int, Any] = {}
    for operation in operations.values():
        if not isinstance(operation, keras.layers.Layer):
            continue
        held = {id(v) for layer in tied_layers(operation, operations).values() for v in layer.weights}
        for variable in operation.weights:
            if id(variable) in held:
                continue
            owner = owners.setdefault(id(variable), operation)
            if owner is not operation:
                raise InputError(
                    f"'{operation.name}' ({type(operation).__name__}) of model '{model.name}' holds the variable "
                    f"'{variable.path}' of '{owner.name}' ({type(owner).__name__}): a weight tied between two "
                    "layers in a way the pipeline cannot keep. It rebuilds each layer from its config on its planned "
                    f"device, which would give '{operation.name}' a copy of its own, trained apart from the "
                    "original's. Expected each variable in one layer of the model's graph, or one layer holding "
                    "the other as an attribute of its own (as keras-hub's MaskedLMHead holds the token "
                    "embedding); untie the weights, or train this model without the pipeline."
                )


def _weights_kept(operation: Any) -> Any:
    """Puts the trainable variables of ``operation`` (and its sublayers) back after the block
    (``profiles.timing.variables_kept``): a layer run as in a training step may write them (spectral
    normalization writes its normalized kernel); ``check_rows`` puts the non-trainable ones back."""
    return variables_kept([v for layer in flatten_layers(operation) for v in own_variables(layer) if v.trainable])


def _checked_in_training(operation: Any) -> bool:
    """Whether the probe also runs ``operation`` as in a training step to compare its rows: a layer of a class of
    the user's (Keras' own layers compute each row from its own in training too, batch normalization aside) that
    takes ``training``, without random draws (a dropout's mask differs between the batch and its halves) or a
    batch normalization (which mixes rows in training and ``runtime.batchnorm`` handles) anywhere inside. (Keras'
    MultiHeadAttention takes the masks off its inputs: run twice on the same tensors it lost the mask the second
    time, 0.024 apart, until each call got fresh tensors.)"""
    if not isinstance(operation, keras.layers.Layer) or not takes_training(operation) or _keras_own(operation):
        return False  # a Keras wrapper around a layer of the user's (TimeDistributed) is run in training too
    layers = flatten_layers(operation)
    return not any(isinstance(layer, keras.layers.BatchNormalization) or seed_generators(layer) for layer in layers)


class _Value(NamedTuple):
    """One tensor of the probe: its value on the probe batch, on each half, its Keras mask and its kind."""

    whole: Any
    halves: tuple[Any, ...]
    mask: Any  # kept apart: a layer may take it off the tensor (MultiHeadAttention does)
    rows: bool  # True iff it has the batch's rows (axis 0), False for a tensor without rows


class _Probe:
    """Runs the calls of a flattened graph on the probe batch and on its halves, checking each output."""

    def __init__(
        self,
        model_name: str,
        num_microbatches: int | str,
        contrast: float | None = None,
        num_replicas: int = 1,
        added_losses: str = "exact",
    ) -> None:
        self.model_name = model_name
        self.added_losses = added_losses
        self.loss_kinds: dict[int, str] = {}  # id(layer) -> what its added loss is (``LOSS_KINDS``)
        self.added: float | None = None  # the loss the last call added (its own activity regularizer's aside)
        self.global_draws: set[int] = set()  # id(op) of the ops that drew from Keras' global seed generator
        self.batched_lookups: set[int] = set()  # id(Embedding) of the lookups whose ids had the batch's rows
        self.num_microbatches = num_microbatches
        self.mixing_allowed = num_microbatches == 1 and num_replicas == 1  # the one micro-batch is the batch
        # how the batch is split, for the messages: micro-batches, of each worker's shard with replicas
        workers = f" on each of {num_replicas} workers" if num_replicas > 1 else ""
        self.split = f"num_microbatches={num_microbatches!r}{workers}"
        self.part = "micro-batch" if num_replicas == 1 else "worker's micro-batch"
        self.alone = "num_microbatches=1" if num_replicas == 1 else "num_microbatches=1 on one worker"
        self.contrast = contrast  # None: standard normal floats; else a contrasting batch (_CONTRASTS), rows only
        self.rng = np.random.default_rng(0)
        self.produced: list[list[_Value]] = []  # per call, per output

    def run(self, call: LayerCall, shapes: dict[str, tuple[int, ...]]) -> None:
        if call.is_input:
            (tensor,) = call.node.output_tensors
            value = self._random((PROBE_ROWS, *shapes[call.operation.name]), tensor.dtype)
            self.produced.append([_Value(value, tuple(value[a:b] for a, b in _HALVES), None, True)])
            return
        inputs = [self.produced[s.call][s.output] for s in call.sources]
        if isinstance(call.operation, keras.layers.Embedding) and inputs and inputs[0].rows:
            self.batched_lookups.add(id(call.operation))

        def batch() -> dict[int, Any]:  # fresh tensors each call: a layer may take the mask off its inputs
            return {id(t): _with_mask(x.whole, x.mask) for t, x in zip(call.node.input_tensors, inputs)}

        if not self.mixing_allowed and self.contrast is None:
            self._check_training_state(call, batch())
        whole = self._call(call, batch())
        added = [self.added]
        self._check_shapes(call, whole)
        if self.contrast is not None and _keras_own(call.operation):  # rows of its own on any values: run once
            self.produced.append([_Value(v, _sliced(v), get_keras_mask(v), _batched(v)) for v in whole])
            return
        parts = []
        for h in range(len(_HALVES)):
            parts.append(self._call_on_half(call, inputs, h))
            added.append(self.added)
        outputs = []
        try:
            for position, value in enumerate(whole):
                halves = tuple(part[position] for part in parts)
                if value is None:  # an output the layer leaves out (keras-hub's XLNetEncoder returns x, None)
                    outputs.append(_Value(None, halves, None, False))
                    continue
                outputs.append(_Value(value, halves, get_keras_mask(value), self._judge(call, value, halves)))
        except InputError:
            again = self._call(call, batch())  # the same rows again: random draws, not mixed rows?
            pairs = [(a, b) for a, b in zip(whole, again, strict=True) if a is not None and b is not None]
            if any(_difference(a, _numpy(b)) is not None for a, b in pairs):
                self._draws(call)
            raise
        if self.contrast is None:
            trained = self._in_training(call, inputs, batch)
        if not self.mixing_allowed and self.contrast is None:
            self._check_regularizer(call, outputs)
            self._classify_losses(call, added, trained)
            if _checked_in_training(call.operation):
                self._check_training_rows(call, inputs, batch, outputs)
            if not _keras_own(call.operation):
                self._check_backward_rows(call, inputs, batch, outputs)
        self.produced.append(outputs)

    def _check_shapes(self, call: LayerCall, whole: list[Any]) -> None:
        """Raises InputError where an output's shape is not the one the model's graph gives it: the probe's sizes
        do not fit the op (an image of 1 x 1 where the model leaves its size open: TensorFlow's oneDNN convolution
        returned a tensor of other channels holding uninitialised memory, which read as random values)."""
        expected = call.node.output_tensors
        if len(expected) != len(whole):
            return
        for value, tensor in zip(whole, expected, strict=True):
            if value is None:
                continue
            shape, graph = tuple(value.shape), tuple(tensor.shape)
            if len(shape) == len(graph) and all(g is None or g == v for g, v in zip(graph[1:], shape[1:])):
                continue
            operation = call.operation
            if len(shape) != len(graph):  # no input size changes a rank (found by probing: keras-hub's XLNet)
                raise InputError(
                    f"'{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' returns values of "
                    f"shape {shape} where the model's graph records {graph} (its compute_output_shape): another "
                    "rank, so the graph the stages are cut from does not describe what the layer computes. Expected "
                    "a layer whose compute_output_shape agrees with its call: fix it in the layer's class, or train "
                    "this model without the pipeline."
                )
            raise InputError(
                f"Cannot check that '{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' "
                f"computes each row of a batch from that row alone: on the probe's input sizes it returns shape "
                f"{shape} where the model's graph gives {graph}, so those sizes do not fit it. Expected the input "
                "sizes the model is trained on: pass them (input_shapes= or sequence_length=; an open size is "
                "probed as 1)."
            )

    def _check_regularizer(self, call: LayerCall, outputs: list[_Value]) -> None:
        """Raises InputError where the layer's activity regularizer is not a sum over rows: the stage applies it
        to each micro-batch's rows and adds the parts (divided by the batch's row count, as Keras divides the
        whole's), exact for Keras' L1 and L2 and not for a mean or a maximum over the batch."""
        regularizer = getattr(call.operation, "activity_regularizer", None)
        if regularizer is None:
            return
        for value in outputs:
            if not value.rows:
                continue  # no rows to split: the stage refuses it at M > 1 (runtime.program)
            whole = _numpy(regularizer(value.whole))
            parts = sum(_numpy(regularizer(half)).astype(np.float64) for half in value.halves)
            worst = _difference(whole, parts)
            if worst is not None:
                operation = call.operation
                raise InputError(
                    f"The activity regularizer of '{operation.name}' ({type(operation).__name__}) of model "
                    f"'{self.model_name}' is not a sum over the batch's rows: on a probe batch it gives "
                    f"{float(whole):.6g} and the sum over its halves {float(parts):.6g}. With {self.split} each "
                    f"{self.part} applies it to its own rows and the parts are added, so the loss would differ from "
                    "the original's. Expected a regularizer that sums over rows (keras.regularizers.L1, L2, L1L2), "
                    f"or {self.alone}; a penalty on a batch-wide value (a mean activation) belongs in the loss."
                )

    def _in_training(
        self, call: LayerCall, inputs: list[_Value], batch: Callable[[], dict[int, Any]]
    ) -> list[float | None] | None:
        """Runs a layer of the user's that takes ``training`` as in a training step (its weights put back after):
        whether it draws from Keras' global seed generator there (``global_draws``), and the loss it adds on the
        probe batch and, where it adds one and M x D > 1, on each half (a mixture of experts adds its router loss
        only in training); None where it is not run so or adds no loss."""
        operation = call.operation
        if not takes_training(operation) or _keras_own(operation):
            return None
        try:
            with _weights_kept(operation):
                self._call(call, batch(), training=True)
                trained = [self.added]
                if trained[0] is None or self.mixing_allowed:
                    return None
                for h in range(len(_HALVES)):
                    self._call_on_half(call, inputs, h, training=True)
                    trained.append(self.added)
                return trained
        except InputError:  # it fails in training on probe data: the step will say why, as Keras would
            return None

    def _classify_losses(self, call: LayerCall, added: list[float | None], trained: list[float | None] | None) -> None:
        """Records what the loss the call adds is (``LOSS_KINDS``), from its values on the probe batch and on
        its halves (whole, then each half; None where it adds none), in inference (``added``) and in training
        (``trained``, ``_in_training``). Raises InputError for a batch-wide one under ``added_losses="exact"``."""
        operation = call.operation
        found = [(added, "")] if added[0] is not None else []
        if trained is not None:
            found.append((trained, " in a training step"))
        if not found:
            return
        ranks = [self.loss_kinds.get(id(operation), LOSS_KINDS[0])]
        for measured, where in found:
            whole, *halves = measured
            if any(h is None for h in halves):  # added on the batch, not on a part of it: batch-wide
                kind = "batch"
            elif all(_difference(whole, h) is None for h in halves):
                kind = "constant"
            else:
                mean = sum(h for h in halves if h is not None) / len(halves)
                kind = "mean" if _difference(whole, mean) is None else "batch"
            ranks.append(kind)
            if kind == "batch" and self.added_losses != "per_microbatch":
                shown = ", ".join("none" if h is None else f"{h:.6g}" for h in halves)
                raise InputError(
                    f"'{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' adds a loss "
                    f"(add_loss){where} that is a batch-wide value: on a probe batch of {PROBE_ROWS} rows it gives "
                    f"{whole:.6g} and on its halves {shown}, neither their mean nor the same value. With "
                    f"{self.split} each {self.part} would add its own, so the loss would differ from the "
                    "original's. Expected a loss that is a mean over the batch's rows (ops.mean of per-row values; "
                    "a sum divided by the batch's rows) or that does not depend on them; or "
                    f'added_losses="per_microbatch" to take each {self.part}\'s value weighted by its rows (as '
                    f"pipelines take a mixture of experts' router loss), or {self.alone}."
                )
        self.loss_kinds[id(operation)] = max(ranks, key=LOSS_KINDS.index)

    def _draws(self, call: LayerCall) -> None:
        operation = call.operation
        raise InputError(
            f"'{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' draws random values when "
            f"it is not training (two runs on the same rows gave other values), so with {self.split} each "
            f"{self.part} would draw its own and the outputs could not be the original's. Expected random draws "
            f"only in training, in Keras' random layers (Dropout, GaussianNoise, with a seed), or {self.alone}."
        )

    def _check_training_rows(
        self, call: LayerCall, inputs: list[_Value], batch: Callable[[], dict[int, Any]], outputs: list[_Value]
    ) -> None:
        """Raises InputError where the call, run as in a training step, mixes the rows its inference did not:
        a layer of the user's that centres its rows on the batch's mean only with ``training=True``. A layer whose
        training outputs differ between two runs on the same batch (random draws without a seed generator of its
        own) is left alone: its halves would differ by design."""
        with _weights_kept(call.operation):
            whole = self._call(call, batch(), training=True)
            again = self._call(call, batch(), training=True)
            if any(_difference(a, _numpy(b)) is not None for a, b in zip(whole, again, strict=True)):
                return
            parts = [self._call_on_half(call, inputs, h, training=True) for h in range(len(_HALVES))]
        for position, (value, seen) in enumerate(zip(whole, outputs, strict=True)):
            if not seen.rows:
                continue
            halves = [_numpy(part[position]) for part in parts]
            if tuple(value.shape) != tuple(seen.whole.shape) or any(h.shape[1:] != value.shape[1:] for h in halves):
                continue  # another shape in training: the step's own trace decides
            worst = _difference(value, np.concatenate(halves))
            if worst is not None:
                self._mixes(
                    call,
                    f"in a training step (training=True) its rows computed on half the batch differ by {worst:.3g}",
                )

    def _check_backward_rows(
        self, call: LayerCall, inputs: list[_Value], batch: Callable[[], dict[int, Any]], outputs: list[_Value]
    ) -> None:
        """Raises InputError where the call's backward mixes the rows its forward keeps apart: an
        ``ops.custom_gradient`` that scales the gradient by a batch-wide value (its norm), which the forward
        probe cannot see (found by probing, stop 38). For a random cotangent on its outputs' rows, each input
        row's gradient on half the batch against the whole batch's, and its weights' gradients summed over the
        halves against the whole's. Layers of the user's and Lambdas only (Keras' own differentiate row by
        row); run as in a training step where ``_checked_in_training`` says so."""
        operation = call.operation
        training = _checked_in_training(operation)
        cotangents = [
            self.rng.normal(size=tuple(v.whole.shape)) if v.rows and _numpy(v.whole).dtype.kind == "f" else None
            for v in outputs
        ]
        if not any(c is not None for c in cotangents):
            return
        weights = list(getattr(operation, "trainable_weights", []))

        floating = [
            id(t) for t, x in zip(call.node.input_tensors, inputs) if x.rows and _numpy(x.whole).dtype.kind == "f"
        ]

        def gradients(values: dict[int, Any], rows: slice) -> tuple[list[Any], list[Any]]:
            watched = {key: values[key] for key in floating}
            with tf.GradientTape() as tape:
                tape.watch(list(watched.values()))
                found = self._call(call, values, training=training)
                total = tf.add_n(
                    [
                        tf.reduce_sum(tf.cast(o, tf.float64) * c[rows])
                        for o, c in zip(found, cotangents, strict=True)
                        if c is not None and o is not None
                    ]
                )
            grads = [
                None if g is None else tf.convert_to_tensor(g)  # an embedding's are IndexedSlices
                for g in tape.gradient(total, list(watched.values()) + weights)
            ]
            return grads[: len(watched)], grads[len(watched) :]

        try:
            with _weights_kept(operation):
                whole = gradients(batch(), slice(None))
                parts = []
                for h, (start, stop) in enumerate(_HALVES):
                    parts.append(gradients(self._half(call, inputs, h), slice(start, stop)))
        except (InputError, LookupError, TypeError, ValueError, tf.errors.OpError):
            return  # no gradient to compare (an op without one): the step says why, as Keras would
        compared = []  # (what, the whole batch's gradient, the halves' as the whole's would be)
        for position, grad in enumerate(whole[0]):
            halves = [part[0][position] for part in parts]
            if grad is not None and all(h is not None for h in halves):
                joined = np.concatenate([_numpy(h) for h in halves])
                compared.append(("its inputs' gradients computed on half the batch differ", grad, joined))
        for position, grad in enumerate(whole[1]):
            halves = [part[1][position] for part in parts]
            if grad is not None and all(h is not None for h in halves):
                summed = np.sum([_numpy(h).astype(np.float64) for h in halves], axis=0)
                what = f"the gradient of '{weights[position].path}' summed over the halves differs"
                compared.append((what, grad, summed))
        # one scale for all of them: a gradient that is 0 up to rounding (an attention key's bias) differs from
        # its halves' by rounding relative to the others (6e-10 in GPT-2's); 16-bit compute rounds coarser
        scale = max((float(np.max(np.abs(_numpy(g)), initial=0.0)) for _, g, _ in compared), default=0.0)
        eps = _EPS_16_BITS.get(str(getattr(operation, "compute_dtype", "float32")), float(np.finfo(np.float32).eps))
        for what, grad, expected in compared:
            worst = float(np.max(np.abs(_numpy(grad).astype(np.float64) - expected), initial=0.0))
            if worst > max(1e-4, 16 * eps) * scale:
                self._mixes(call, f"in its backward, {what} by {worst:.3g}")

    def _check_training_state(self, call: LayerCall, values: dict[int, Any]) -> None:
        """Raises InputError where the call, run in training, changes a non-trainable variable the runtime does
        not handle (batch normalization's statistics are deferred, ``runtime.batchnorm``; seed states are the
        random layers'): each micro-batch's forward would change it, M times a step where Keras changes it
        once. The caller puts every non-trainable variable back after the probe."""
        operation = call.operation
        if not isinstance(operation, keras.layers.Layer):
            return
        handled = {id(g.state.value) for layer in flatten_layers(operation) for g in seed_generators(layer)}
        watched = [
            v
            for layer in flatten_layers(operation)
            if not isinstance(layer, keras.layers.BatchNormalization)
            for v in own_variables(layer)
            if not v.trainable and id(v.value) not in handled
        ]
        if not watched:
            return
        before = [np.array(v.numpy()) for v in watched]
        try:
            with _weights_kept(operation):
                self._call(call, values, training=True)
        except InputError:  # it fails in training on probe data: the step will say why, as Keras would
            return
        for variable, value in zip(watched, before, strict=True):
            if not np.array_equal(np.asarray(variable.numpy()), value):
                raise InputError(
                    f"'{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' changes its "
                    f"non-trainable variable '{variable.path}' when it runs in a training step: with {self.split} "
                    f"every {self.part}'s forward changes it from its own rows, where Keras changes it once a step "
                    "from the whole batch, so it would end elsewhere. Expected variables a step does not move "
                    f"(BatchNormalization's statistics the runtime handles), or {self.alone}."
                )

    def check_output(self, calls: list[LayerCall], source: Any) -> None:
        """A model output must have the batch's rows: the runtime returns and scores the batch's rows of it."""
        value = self.produced[source.call][source.output]
        if not value.rows:
            name = calls[source.call].operation.name
            raise InputError(
                f"Model '{self.model_name}' returns the output of '{name}' with shape {tuple(value.whole.shape)} for "
                f"a batch of {PROBE_ROWS} rows: the pipeline returns and scores one row per input row. Expected every "
                "model output to keep the batch axis first, one row per input: return a batched tensor (e.g. "
                "broadcast a per-batch value to the batch's rows) or compute this outside the model."
            )

    def _call(
        self, call: LayerCall, values: dict[int, Any], half: int | None = None, training: bool = False
    ) -> list[Any]:
        args, kwargs = call.node.arguments.fill_in(values)
        operation = call.operation
        if takes_training(operation):
            kwargs["training"] = training
        regularizer = getattr(operation, "activity_regularizer", None)  # checked apart (_check_regularizer)
        self.added = None
        before = global_seed_state()
        try:
            if regularizer is not None:
                operation.activity_regularizer = None
            outputs = operation(*args, **kwargs)
        except Exception as err:
            rows = PROBE_ROWS if half is None else _HALVES[half][1] - _HALVES[half][0]
            raise InputError(
                f"Cannot check that '{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' "
                f"computes each row of a batch from that row alone: it fails on {rows} rows of a {PROBE_ROWS}-row "
                f"batch with {type(err).__name__}: {_reason(err)}. Expected it to run on any number of rows; "
                "pass the input sizes the model accepts (input_shapes= or sequence_length=), or keep it from "
                "depending on the batch's size."
            ) from err
        finally:
            if regularizer is not None:
                operation.activity_regularizer = regularizer
            after = global_seed_state()
            if after is not None and (before is None or not np.array_equal(before, after)):
                self.global_draws.add(id(operation))  # drew from Keras' global seed generator
            if isinstance(operation, keras.layers.Layer):
                losses = [_numpy(x) for layer in flatten_layers(operation) for x in own_losses(layer)]
                self.added = float(np.sum([x.astype(np.float64) for x in losses])) if losses else None
                clear_losses(operation)  # the losses it added on probe data: leave none behind
        return list(keras.tree.flatten(outputs))

    def _call_on_half(self, call: LayerCall, inputs: list[_Value], half: int, training: bool = False) -> list[Any]:
        """The call on the rows ``half`` of the probe batch (``_half``)."""
        return self._call(call, self._half(call, inputs, half), half, training)

    def _half(self, call: LayerCall, inputs: list[_Value], half: int) -> dict[int, Any]:
        """{id(input tensor): what a micro-batch of the probe batch's rows ``half`` gives it} (``_part``)."""
        return {id(t): self._part(x, half) for t, x in zip(call.node.input_tensors, inputs)}

    def _part(self, value: _Value, half: int) -> Any:
        """What a micro-batch of the probe batch's rows ``half`` gives an op: those rows of a batched
        tensor (and of its mask), a tensor without rows as it is."""
        if not value.rows:
            return _with_mask(value.whole, value.mask)
        start, stop = _HALVES[half]
        return _with_mask(value.whole[start:stop], None if value.mask is None else value.mask[start:stop])

    def _judge(self, call: LayerCall, value: Any, halves: tuple[Any, ...]) -> bool:
        """True iff ``value`` has the batch's rows; raises InputError where the op mixes rows."""
        shape, parts = tuple(value.shape), [tuple(h.shape) for h in halves]
        sizes = [b - a for a, b in _HALVES]
        if shape and shape[0] == PROBE_ROWS and all(p == (n, *shape[1:]) for p, n in zip(parts, sizes)):
            worst = _difference(value, np.concatenate([_numpy(h) for h in halves]))
            if not self.mixing_allowed and worst is not None:
                self._mixes(call, f"its rows computed on half the batch differ from the whole batch's by {worst:.3g}")
            return True
        if all(p == shape for p in parts):
            worst = max((d for d in (_difference(value, _numpy(h)) for h in halves) if d is not None), default=None)
            if not self.mixing_allowed and worst is not None:
                what = f"its output of shape {shape} (no batch axis) computed on half the batch differs by {worst:.3g}"
                self._mixes(call, what)
            return False
        operation = call.operation
        raise InputError(
            f"'{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' changes the batch's row "
            f"count: it returns shape {shape} for a batch of {PROBE_ROWS} rows and {parts} for its halves, so the "
            "pipeline's micro-batches, outputs and loss would hold other rows than the original's. Expected every "
            "tensor to keep the batch axis first with one row per input row (or to have no batch axis): "
            "concatenate, reshape and transpose along the other axes, or do this outside the model."
        )

    def _mixes(self, call: LayerCall, what: str) -> None:
        operation = call.operation
        if self.contrast is not None:
            what += (
                " on a probe batch whose halves differ in sign and scale (as where a branch, a loop or a clip "
                "depends on a batch-wide value: its mean, its maximum)"
            )
        raise InputError(
            f"'{operation.name}' ({type(operation).__name__}) of model '{self.model_name}' mixes the rows of a "
            f"batch: {what}, so with {self.split} it would compute something else "
            "than the original on the whole batch. Expected each row to depend on its own row alone (batch "
            f"normalization aside): use {self.alone}, or move the batch-wide computation into the loss or the "
            "data pipeline."
        )

    def _random(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """Standard normal floats, integers 0 or 1 (valid token and class ids), as ``runtime.synthetic_batch``."""
        name = str(getattr(dtype, "name", dtype))
        if "string" in name:  # words from a small vocabulary (a lookup maps unknown ones to its OOV index)
            words = np.asarray(["0", "1", "a", "b c", ""], dtype=object)
            return tf.constant(words[self.rng.integers(0, len(words), shape)])
        if "int" in name or "bool" in name:
            return keras.ops.convert_to_tensor(self.rng.integers(0, 2, shape).astype(name))
        values = self.rng.normal(size=shape)
        if self.contrast is not None:
            half = PROBE_ROWS // 2
            values[:half] = self.contrast * _SMALL * (1.0 + 0.3 * np.abs(values[:half]))
            values[half:] *= _LARGE
        return keras.ops.convert_to_tensor(values.astype(name))


def _difference(actual: Any, expected: Any) -> float | None:
    """The largest difference between two values beyond rounding, or None where they agree.

    Floats agree within a tolerance of their dtype (1e-4, or 4 ulps where that is more, of the largest
    magnitude in ``actual``), with NaN equal to NaN; integers and booleans exactly.
    """
    a, b = _numpy(actual), np.asarray(expected)
    if a.dtype.kind not in "fc":
        return None if np.array_equal(a, b) else 1.0
    eps = _EPS_16_BITS.get(a.dtype.name, float(np.finfo(np.float32).eps))
    a, b = a.astype(np.float64), b.astype(np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("nan")
    a, b = np.nan_to_num(a), np.nan_to_num(b)
    worst = float(np.max(np.abs(a - b), initial=0.0))
    scale = float(np.max(np.abs(a), initial=0.0))
    return worst if worst > max(1e-4, 4 * eps) * scale else None


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def _with_mask(value: Any, mask: Any) -> Any:
    """``value`` with ``mask`` as its Keras mask (layers read it from the tensor)."""
    if mask is not None:
        set_keras_mask(value, mask)
    return value


def _reason(err: Exception) -> str:
    """The first line of an error that says why (Keras opens with "Exception encountered when calling ...")."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # Keras' bold
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered")] or lines
    return lines[0] if lines else ""
