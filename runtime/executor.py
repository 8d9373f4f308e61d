"""Executes a pipeline schedule: each stage's forward, backward and optimizer update on its device.

Every stage (``runtime.stages``) becomes one ``tf.function``, traced once and called once per
micro-batch, not inlined into the step, so the step's graph and its trace time grow with M only by
a few call ops per micro-batch. The executor emits the schedule's actions (``partitioner.schedule``)
into Keras' compiled step, in the schedule's global order, each action under its stage's device and
after the previous action of that device (a control dependency), so the device-by-device order is
the schedule's:

- ``F`` (stage s, micro-batch m): calls the stage function on the micro-batch's boundary tensors,
  recorded on a tape of its own (or, with recomputation, unrecorded: only the inputs are kept; the
  last stage, whose backward comes next, always records). The last stage computes the micro-batch's
  loss on its device, with the gradients of the loss for the model's outputs (where its B starts).
- ``B`` (stage s, micro-batch m): asks that tape for the gradients of the stage's inputs and weights,
  with the gradients of its outputs from the stages that read them; every gradient op is created
  under the stage's device. Weight gradients accumulate per stage on its device. With
  recomputation the stage function first runs again under a fresh tape, with the dropout seeds of
  its forward and every non-trainable variable (batch-norm statistics) restored afterwards.
- After the last action each stage's optimizer update runs on its device: the optimizer's per-variable
  update (moments, bias correction, the assign) is issued under the variable's device.

Micro-batches have one static shape, so each stage function is traced once: a batch of B rows is split
into M micro-batches of ceil(B / M) rows, the rows past B repeating real rows. The repeated rows are
left out of the loss (each micro-batch's loss is Keras' compiled loss over its own rows, weighted by
their share of the batch, so the step's loss and gradients are the original model's on the whole
batch) and out of batch normalization's statistics (a row mask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend import set_keras_mask  # what Keras' own layers call

from partitioner.errors import InputError
from partitioner.schedule import Schedule
from runtime.batchnorm import BATCH_NORM, is_plain_batch_norm, normalize, update_moving_statistics
from runtime.rebuild import seed_states
from runtime.stages import Stage, output_masks

SCHEDULES = ("gpipe", "1f1b")


def _call_context(operation: Any, kwargs: dict[str, Any], training: bool) -> None:
    if "training" in getattr(operation, "_call_context_args", {}):
        kwargs["training"] = training


def _seed_variables(operations: Sequence[Any]) -> list[tf.Variable]:
    """The state variables (TensorFlow's) of every seed generator (dropout and other random layers) of
    the operations."""
    found: dict[int, tf.Variable] = {}
    for operation in operations:
        for state in seed_states(operation):
            found[id(state)] = state.value
    return list(found.values())


def batch_size(inputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The batch's row count B, as a value Grappler cannot fold into a constant.

    With a batch of static size, every micro-batch's row mask, row count and share of the loss would
    fold into constants, and TensorFlow's function optimizer would then specialise (copy and optimise
    anew) a stage function for every call site that takes one: a first-step cost growing with M.
    """
    return tf.raw_ops.PlaceholderWithDefault(input=tf.shape(inputs[0])[0], shape=[])


class _Boundary:
    """A function the step calls once per micro-batch and TensorFlow never inlines into it: a
    ``tf.function`` whose own body is one call of ``body``, traced as a function of its own.

    TensorFlow's graph passes visit every call site of the step's graph and turn the callee's
    definition into a graph there, before they read ``_noinline`` (Grappler's function optimizer,
    twice, and the inlining pass before it): with a callee of one call node that work is small at
    each of the step's M x K call sites, and ``body`` is optimised once, where the boundary function
    is instantiated on its device. Calls go to the traced concrete function of the arguments'
    shapes and dtypes (kept here, so a call does not recompute the arguments' tracing types);
    ``reduce_retracing`` gives one more trace, for any batch size, at the first call with another
    micro-batch size (a remainder batch). With ``jit_compile`` the boundary function, the inner
    call inlined, is one XLA cluster on the device it is called on.

    With ``inline`` (one micro-batch: one call per step) TensorFlow may inline the function into the
    step, as plain Keras' step is one graph: the call boundaries cost a one-device transformer step
    about a fifth more than plain Keras, inlined 4% (measured side by side, benchmarks/runtime). The
    call runs under a name scope of the function's name, so the nodes of an inlined body still say
    which stage and kind they belong to (``runtime.placement``).
    """

    def __init__(self, body: Any, name: str, jit_compile: bool = False, inline: bool = False) -> None:
        body.__name__ = f"{name}_body"
        inner = tf.function(body, reduce_retracing=True, autograph=False)

        def call(*args: Any) -> Any:
            return inner(*args)

        call.__name__ = name
        self.function = tf.function(
            call,
            reduce_retracing=True,
            autograph=False,
            jit_compile=jit_compile,
            experimental_attributes={} if inline else {"_noinline": True},
        )
        self.name = name
        self._concrete: dict[Any, Any] = {}

    def __call__(self, *args: Any) -> Any:
        key = tuple(
            (tuple(x.shape), x.dtype) if tf.is_tensor(x) else ("py", repr(x)) for x in tf.nest.flatten(args)
        )
        concrete = self._concrete.get(key)
        if concrete is None:
            concrete = self._concrete[key] = self.function.get_concrete_function(*args)
        with tf.name_scope(self.name):  # the call's name, and an inlined body's nodes', say what it is
            return concrete(*args)


class StageProgram:
    """The compiled functions of one stage: forward (training or not), and the recomputing forward."""

    def __init__(self, stage: Stage, returns: Sequence[Any], options: ExecutionOptions) -> None:
        self.stage = stage
        self.returns = tuple(returns)  # symbolic tensors the stage function returns, in order
        self.jit_compile = options.jit_compile
        self.batch_norm = options.batch_norm
        self.seed_variables = _seed_variables(stage.operations)
        self.non_trainable = [
            v.value
            for v in {id(v): v for op in stage.operations for v in op.non_trainable_weights}.values()
            if v.dtype != "string"
        ]
        self.num_microbatches = options.num_microbatches
        self.deferred_layers: list[Any] = []  # batch-norm calls whose statistics the training forward returns
        # layers whose activity regularizer the stage applies itself, to the micro-batch's own rows
        self.regularized = any(getattr(op, "activity_regularizer", None) is not None for op in stage.operations)
        # only a stage with batch normalization or an activity regularizer takes the micro-batch's row
        # mask (statistics and regularizers skip the repeated rows); a regularized one also the batch size
        self.takes_mask = self.regularized or any(
            isinstance(op, keras.layers.BatchNormalization) for op in stage.operations
        )
        # per function kind: True iff it returns the stage's layer loss (after the returns)
        self.returns_layer_loss: dict[str, bool] = {}
        # per function kind: the layer whose add_loss cannot be split over micro-batches (M > 1), or None
        self.unsplittable: dict[str, str | None] = {}
        self._functions: dict[str, Any] = {}

    def arguments(self, values: Sequence[tf.Tensor], valid: tf.Tensor, batch: tf.Tensor) -> list[tf.Tensor]:
        """The stage function's arguments for one micro-batch: its inputs, its row mask if it takes one,
        and the batch's row count (float32) if it applies activity regularizers."""
        return [*values, *([valid] if self.takes_mask else []), *([batch] if self.regularized else [])]

    def _run(
        self, kind: str, flat: Sequence[tf.Tensor], training: bool, stats: list[Any]
    ) -> tuple[list[tf.Tensor], tf.Tensor | None]:
        """The stage's nodes in order, on the function's arguments ``flat``; returns the stage's returns
        and its layer loss (or None). In training, batch normalizations (``runtime.batchnorm``) use the
        valid rows' statistics and append (layer, [mean, variance, count]) to ``stats`` instead of
        moving their own."""
        count = len(self.stage.inputs)
        valid = flat[count] if self.takes_mask else None
        batch = flat[count + 1] if self.regularized else None
        own_rows = tf.reduce_sum(tf.cast(valid, tf.int32)) if self.regularized else None  # repeats come last
        values = {id(t): x for t, x in zip(self.stage.inputs, flat[:count])}
        terms: list[tf.Tensor] = []
        self.unsplittable[kind] = None
        for node in self.stage.nodes:
            args, kwargs = node.arguments.fill_in(values)
            operation = node.operation
            _call_context(operation, kwargs, training)
            regularizer = getattr(operation, "activity_regularizer", None)
            if training and is_plain_batch_norm(operation, args, kwargs):
                outputs, moments = normalize(operation, args[0], valid)
                stats.append((operation, moments))
            elif regularizer is not None:  # applied below, to the micro-batch's own rows only
                operation.activity_regularizer = None
                try:
                    outputs = operation(*args, **kwargs)
                finally:
                    operation.activity_regularizer = regularizer
            else:
                outputs = operation(*args, **kwargs)
            terms += self._layer_losses(kind, operation, outputs, regularizer, own_rows, batch)
            for symbolic, value in zip(node.outputs, keras.tree.flatten(outputs)):
                values[id(symbolic)] = value
        self.returns_layer_loss[kind] = bool(terms)
        return [values[id(t)] for t in self.returns], (tf.add_n(terms) if terms else None)

    def _layer_losses(
        self, kind: str, operation: Any, outputs: Any, regularizer: Any, rows: Any, batch: Any
    ) -> list[tf.Tensor]:
        """The losses one call added (``add_loss``, activity regularizers), as this micro-batch's part of
        the batch's: Keras divides an activity regularizer's value by the batch size, so the stage
        applies it to the micro-batch's own rows and divides by the whole batch's row count (exact for
        regularizers that sum over rows, as Keras' L1 and L2 do). Any other added loss is taken whole at
        M = 1; with M > 1 the stage cannot know whether it is a mean or a sum over the batch, and marks
        itself ``unsplittable`` (training and evaluation then refuse)."""
        terms: list[tf.Tensor] = []
        if isinstance(operation, keras.layers.Layer):
            added = [x for layer in operation._flatten_layers(include_self=True) for x in layer._get_own_losses()]
            operation._clear_losses()  # the tensors belong to this function's graph: leave none behind
            if added and self.num_microbatches > 1:
                self.unsplittable[kind] = operation.name
            elif added:
                terms += [tf.reduce_sum(tf.cast(x, tf.float32)) for x in added]
        if regularizer is not None:
            for output in keras.tree.flatten(outputs):
                if not tf.is_tensor(output):
                    continue
                if output.shape.rank == 0:  # no rows to split: Keras takes it whole
                    if self.num_microbatches > 1:
                        self.unsplittable[kind] = operation.name
                    else:
                        terms.append(tf.cast(regularizer(output), tf.float32))
                    continue
                terms.append(tf.cast(regularizer(output[:rows]), tf.float32) / batch)
        return terms

    def split(
        self, results: Sequence[tf.Tensor], kind: str = "forward"
    ) -> tuple[list[tf.Tensor], tf.Tensor | None, list[list[tf.Tensor]], list[tf.Tensor]]:
        """A stage function's results -> (returns, layer loss or None, [mean, variance, count] per
        deferred batch-norm call, seeds); the last two only for the training forward."""
        count = len(self.returns)
        layer_loss = results[count] if self.returns_layer_loss.get(kind) else None
        start = count + int(layer_loss is not None)
        num_stats = 3 * len(self.deferred_layers) if kind == "forward" else 0
        stats = list(results[start : start + num_stats])
        return (
            list(results[:count]),
            layer_loss,
            [stats[i : i + 3] for i in range(0, num_stats, 3)],
            list(results[start + num_stats :]) if kind == "forward" else [],
        )

    def _compile(self, name: str, body: Any) -> Any:
        """One tf.function per stage and kind, named ``stage<s>_<kind>`` (its executed graphs carry the name).

        It is traced for the micro-batch's static shape (Grappler then folds the shape arithmetic of
        the forward and of its gradient, as in the plain Keras step), and once more, for any batch
        size, at the first micro-batch of another size (a remainder batch): ``reduce_retracing``.
        """
        if name not in self._functions:
            self._functions[name] = _Boundary(
                body, f"stage{self.stage.index}_{name}", self.jit_compile, inline=self.num_microbatches == 1
            )
        return self._functions[name]

    def forward(self, training: bool) -> Any:
        """f(*arguments) -> [returns..., layer loss if any]; when training, + batch-norm statistics + the
        seed states it began with (``split`` takes them apart)."""
        kind = "forward" if training else "inference"

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            stats: list[Any] = []
            if not training:
                outputs, layer_loss = self._run(kind, flat, False, stats)
                return outputs + ([layer_loss] if layer_loss is not None else [])
            seeds = [v.read_value() for v in self.seed_variables]
            outputs, layer_loss = self._run(kind, flat, True, stats)
            if self.batch_norm == "per_microbatch":
                for layer, moments in stats:
                    update_moving_statistics(layer, [moments])
                stats = []
            self.deferred_layers = [layer for layer, _ in stats]
            outputs += [layer_loss] if layer_loss is not None else []
            return outputs + [t for _, moments in stats for t in moments] + seeds

        return self._compile(kind, body)

    def accumulate(self) -> Any:
        """f(totals, gradients) -> [total + gradient]: a micro-batch's weight gradients added to the
        stage's sums in one call (one op in the step's graph instead of one per weight)."""

        def body(totals: list[tf.Tensor], gradients: list[tf.Tensor]) -> list[tf.Tensor]:
            return [t + g for t, g in zip(totals, gradients)]

        return self._compile("accumulate", body)

    def recompute(self) -> Any:
        """f(*arguments, *seeds) -> [returns..., layer loss if any]: the training forward again, leaving no trace.

        The dropout seeds are set to those of the first forward, and every non-trainable variable
        (batch-norm statistics) and seed state is put back afterwards, so the recomputed forward draws
        the same masks, updates nothing twice, and later forwards draw what they would have drawn.
        """
        num_arguments = len(self.stage.inputs) + int(self.takes_mask) + int(self.regularized)

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            state = [*self.non_trainable, *self.seed_variables]
            saved = [tf.identity(v.read_value()) for v in state]
            with tf.control_dependencies(saved):
                for variable, seed in zip(self.seed_variables, flat[num_arguments:]):
                    variable.assign(seed)
            # batch-norm statistics are the first forward's
            outputs, layer_loss = self._run("recompute", flat[:num_arguments], True, [])
            outputs += [layer_loss] if layer_loss is not None else []
            with tf.control_dependencies(outputs):
                restores = [v.assign(s) for v, s in zip(state, saved)]
            with tf.control_dependencies(restores):
                return [tf.identity(o) for o in outputs]

        return self._compile("recompute", body)


@dataclass(frozen=True)
class ExecutionOptions:
    """How a PipelinedModel runs its steps (everything but the stages themselves)."""

    num_microbatches: int  # M
    schedule: str = "gpipe"  # "gpipe" or "1f1b"
    # per stage: True re-runs the stage's forward in its backward from the kept inputs (the last stage
    # never: its backward follows at once); empty: no stage recomputes
    recompute: tuple[bool, ...] = ()
    batch_norm: str = "deferred"  # "deferred": one moving-statistics update per step; "per_microbatch": M updates
    jit_compile: bool = False  # compile each stage's functions with XLA on its device

    def __post_init__(self) -> None:
        for name, allowed in (("schedule", SCHEDULES), ("batch_norm", BATCH_NORM)):
            value = getattr(self, name)
            if value not in allowed:
                raise InputError(f"{name} must be one of {allowed}. Received: {name}={value!r}.")
        if not all(isinstance(flag, bool) for flag in self.recompute):
            raise InputError(f"recompute must be one bool per stage. Received: recompute={self.recompute!r}.")
        object.__setattr__(self, "recompute", tuple(self.recompute))

    def recomputes(self, stage: int) -> bool:
        """True iff ``stage``'s backward runs its forward again (the last stage's never does)."""
        return stage < len(self.recompute) - 1 and self.recompute[stage]


class Executor:
    """Runs training, evaluation and prediction steps of a staged model by a schedule.

    Args:
        model: the flat rebuilt functional model.
        stages: its stages in pipeline order (``runtime.stages.cut_stages``).
        options: M, the schedule, recomputation, batch normalization and XLA.

    Example:
        >>> executor = Executor(rebuilt.model, cut_stages(...), ExecutionOptions(8, schedule="1f1b"))  # doctest: +SKIP
        >>> print(executor.schedule)                                                                   # doctest: +SKIP
    """

    def __init__(self, model: Any, stages: Sequence[Stage], options: ExecutionOptions) -> None:
        self.model = model
        self.stages = tuple(stages)
        self.options = options
        if options.recompute and len(options.recompute) != len(self.stages):
            raise InputError(
                f"recompute has {len(options.recompute)} entries for {len(self.stages)} stages: give one per stage."
            )
        self.schedule = Schedule.make(options.schedule, len(self.stages), options.num_microbatches)
        # the one Keras mask every model output carries (runtime.rebuild refuses others), or None
        self.mask = next(iter(output_masks(model)), None)
        loss_tensors = (*model.outputs, *(() if self.mask is None else (self.mask,)))
        last = len(self.stages) - 1
        self.programs = [
            StageProgram(s, (*s.outputs, *(loss_tensors if s.index == last else ())), options) for s in self.stages
        ]
        self._loss_functions: dict[Any, Any] = {}

    def loss_function(self, loss_fn: Any, scale_loss: Any) -> Any:
        """f(y, flat_predictions, mask, sample_weight, rows, share) -> (a micro-batch's loss as its share of
        the batch's, the gradient of its scaled loss for each floating prediction, [valid steps, steps]).

        The loss is ``loss_fn`` over the micro-batch's own first ``rows`` rows, summed (a micro-batch with
        no rows of its own, when B < M, gives Keras an empty loss, summed to 0), times ``share``. With
        an output ``mask`` (None without), Keras' loss is the mean over the micro-batch's valid steps;
        times the share of its steps that are valid, it becomes the sum over its valid steps divided by
        the batch's steps, and ``_TrainStep.finish`` divides the step's sum by the share of the batch's
        steps that are valid: the mean over the batch's valid steps, as the original computes it (the
        mean of the micro-batches' means is not, when they hold different numbers of valid steps). The
        gradient of ``scale_loss(loss)`` (the optimizer's loss scaling) is taken inside, so the last
        stage's backward starts from it and the step graph holds no backward of this function: one
        function, traced once, called once per micro-batch. (Differentiated from outside, its backward
        had unused outputs, the gradients of the targets and shares, and Grappler specialised a copy of it
        for every micro-batch.)"""
        key = (loss_fn, scale_loss)
        if key not in self._loss_functions:
            structure = self.model._outputs_struct

            def microbatch_loss(
                y: Any, flat: list[tf.Tensor], mask: Any, sample_weight: Any, rows: tf.Tensor, share: tf.Tensor
            ) -> Any:
                floating = [t for t in flat if t.dtype.is_floating]
                steps = None
                with tf.GradientTape() as tape:
                    tape.watch(floating)
                    predictions = [t[:rows] for t in flat]
                    if mask is not None:
                        own_mask = mask[:rows]
                        for t in predictions:
                            set_keras_mask(t, own_mask)
                        valid = tf.reduce_sum(tf.cast(own_mask, tf.float32))
                        steps = tf.stack([valid, tf.cast(tf.size(own_mask), tf.float32)])
                        share = share * tf.math.divide_no_nan(valid, steps[1])
                    own = [
                        None if part is None else keras.tree.map_structure(lambda t: t[:rows], part)
                        for part in (y, sample_weight)
                    ]
                    y_pred = keras.tree.pack_sequence_as(structure, predictions)
                    loss = tf.reduce_sum(tf.cast(loss_fn(own[0], y_pred, own[1]), tf.float32)) * share
                    scaled = scale_loss(loss)
                gradients = tape.gradient(scaled, floating, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return loss, gradients, steps

            self._loss_functions[key] = _Boundary(
                microbatch_loss, "microbatch_loss", inline=self.num_microbatches == 1
            )
        return self._loss_functions[key]

    @property
    def num_microbatches(self) -> int:
        return self.options.num_microbatches

    @property
    def trainable_variables(self) -> list[Any]:
        """Every stage's trainable variables, stage after stage: the order ``train`` returns gradients in."""
        return [v for stage in self.stages for v in stage.trainable_variables]

    def with_options(self, **changes: Any) -> Executor:
        """The same stages run with other options (new stage functions, traced afresh)."""
        return Executor(self.model, self.stages, replace(self.options, **changes))

    # ----- splitting a batch ---------------------------------------------------------------------

    def microbatch_rows(self, structure: Any) -> int | None:
        """ceil(B / M) where the batch's size B is static (the shape the stage functions are traced for)."""
        leaves = keras.tree.flatten(structure)
        size = tf.convert_to_tensor(leaves[0]).shape[0] if leaves else None
        return None if size is None else -(-size // self.num_microbatches)

    def split(self, batch: tf.Tensor, structure: Any) -> list[Any]:
        """Each leaf [B, ...] -> M micro-batches [ceil(B/M), ...]; rows past B repeat real rows."""
        m = self.num_microbatches
        size = (batch + m - 1) // m
        rows = tf.range(size * m) % batch
        static_size = self.microbatch_rows(structure)

        def one(t: Any) -> list[tf.Tensor]:
            t = tf.convert_to_tensor(t)
            parts = list(tf.unstack(tf.reshape(tf.gather(t, rows), tf.concat([[m, size], tf.shape(t)[1:]], 0)), num=m))
            for part in parts:
                part.set_shape([static_size, *t.shape[1:]])
            return parts

        flat = [one(t) for t in keras.tree.flatten(structure)]
        return [keras.tree.pack_sequence_as(structure, [parts[i] for parts in flat]) for i in range(m)]

    def valid_rows(self, batch: tf.Tensor, static_size: int | None = None) -> list[tf.Tensor]:
        """Per micro-batch, [ceil(B/M)] booleans: True for the batch's own rows, False for repeats."""
        m = self.num_microbatches
        size = (batch + m - 1) // m
        masks = list(tf.unstack(tf.reshape(tf.range(size * m) < batch, [m, size]), num=m))
        for mask in masks:
            mask.set_shape([static_size])
        return masks

    # ----- steps ---------------------------------------------------------------------------------

    def forward(
        self, inputs: Sequence[tf.Tensor], training: bool, losses: bool = False
    ) -> tuple[list[Any], list[tf.Tensor], tf.Tensor | None]:
        """Forward only (evaluation and prediction): per micro-batch the model outputs, the valid rows,
        and the batch's layer losses (``add_loss``, activity regularizers; None if there are none).

        ``losses=True`` (evaluation) refuses a loss that cannot be split over micro-batches."""
        batch = batch_size(inputs)
        rows = tf.cast(batch, tf.float32)
        micro_inputs = self.split(batch, list(inputs))
        valid = self.valid_rows(batch, self.microbatch_rows(list(inputs)))
        layer_losses: list[tf.Tensor] = []
        kind = "forward" if training else "inference"
        values: dict[tuple[int, int], tf.Tensor] = {}
        last_op: list[Any] = [None] * len(self.stages)
        for m in range(self.num_microbatches):
            for t, x in zip(self.model.inputs, micro_inputs[m]):
                values[(id(t), m)] = x
        predictions = []
        for m in range(self.num_microbatches):
            for program in self.programs:
                stage = program.stage
                with tf.device(stage.device), tf.control_dependencies(last_op[stage.index] or []):
                    fn = program.forward(training)
                    results = fn(*program.arguments([values[(id(t), m)] for t in stage.inputs], valid[m], rows))
                    if losses:
                        _check_splittable(program, kind)
                    outputs, layer_loss, _, _ = program.split(results, kind)
                    if layer_loss is not None:
                        layer_losses.append(layer_loss)
                for symbolic, value in zip(program.returns, outputs):
                    values[(id(symbolic), m)] = value
                last_op[stage.index] = outputs
            outputs = [values[(id(t), m)] for t in self.model.outputs]
            if self.mask is not None:
                for output in outputs:
                    set_keras_mask(output, values[(id(self.mask), m)])
            predictions.append(keras.tree.pack_sequence_as(self.model._outputs_struct, outputs))
        return predictions, valid, (tf.add_n(layer_losses) if layer_losses else None)

    def train(self, inputs: Sequence[tf.Tensor], y: Any, sample_weight: Any, loss_fn: Any, scale_loss: Any) -> Any:
        """Runs the schedule's forwards and backwards for one batch.

        Args:
            inputs: the model's flat inputs, each [B, ...].
            y: targets in the model's output structure (or None).
            sample_weight: as Keras takes it (or None).
            loss_fn: (y, y_pred, sample_weight) -> the mean loss of a micro-batch (Keras' compiled loss).
            scale_loss: loss -> the loss the gradients are taken of (the optimizer's loss scaling).

        Returns:
            (the batch's loss, per micro-batch the model outputs, the valid rows, the gradients of
            every stage's trainable variables, stage after stage, each summed over the micro-batches
            on its stage's device).
        """
        step = _TrainStep(self, inputs, y, sample_weight, loss_fn, scale_loss)
        for action in self.schedule.global_order():
            stage = self.stages[action.stage]
            with tf.device(stage.device), tf.control_dependencies(step.last_op[action.stage] or []):
                if action.kind == "F":
                    step.forward(action.stage, action.microbatch)
                elif action.kind == "B":
                    step.backward(action.stage, action.microbatch)
                else:
                    raise InputError(f"The runtime executes F and B actions; {action} is not one of them yet.")
        return step.finish()


class _TrainStep:
    """The tensors of one training step while its actions are emitted: values, tapes, pending gradients."""

    def __init__(
        self, executor: Executor, inputs: Sequence[tf.Tensor], y: Any, sample_weight: Any, loss_fn: Any, scale_loss: Any
    ) -> None:
        self.executor = executor
        self.loss_fn = loss_fn
        self.scale_loss = scale_loss
        num = executor.num_microbatches
        batch = batch_size(inputs)
        size = (batch + num - 1) // num
        # the batch's own rows of micro-batch m are its first rows[m] (the rest repeat earlier rows)
        self.rows = [tf.clip_by_value(batch - m * size, 0, size) for m in range(num)]
        self.batch_rows = tf.cast(batch, tf.float32)
        self.share = [tf.cast(n, tf.float32) / self.batch_rows for n in self.rows]
        self.valid = executor.valid_rows(batch, executor.microbatch_rows(list(inputs)))
        self.y = executor.split(batch, y) if y is not None else [None] * num
        self.weights = executor.split(batch, sample_weight) if sample_weight is not None else [None] * num
        self.model_inputs = {id(t) for t in executor.model.inputs}
        self.values: dict[tuple[int, int], tf.Tensor] = {}  # (id(symbolic tensor), m) -> its value
        for m, parts in enumerate(executor.split(batch, list(inputs))):
            for t, x in zip(executor.model.inputs, parts):
                self.values[(id(t), m)] = x
        self.pending: dict[tuple[int, int], list[tf.Tensor]] = {}  # (id(tensor), m) -> gradients from its readers
        # (s, m) -> (tape or None, outputs, layer loss or None, seeds, the loss's gradients for the model
        # outputs (last stage) or None)
        self.kept: dict[tuple[int, int], Any] = {}
        self.losses: list[Any] = [None] * num  # unscaled loss of each micro-batch, its share of the batch
        self.steps: list[Any] = [None] * num  # with an output mask: [valid steps, steps] of each micro-batch
        self.layer_losses: list[tf.Tensor] = []  # every stage's layer losses, each micro-batch's part
        self.predictions: list[Any] = [None] * num
        self.gradients: list[list[Any]] = [[None] * len(s.trainable_variables) for s in executor.stages]
        self.last_op: list[Any] = [None] * len(executor.stages)
        self.statistics: dict[tuple[int, int], tuple[Any, list[Any]]] = {}  # (s, id(layer)) -> (layer, moments)

    def _inputs(self, s: int, m: int) -> tuple[list[tf.Tensor], list[int]]:
        stage = self.executor.stages[s]
        values = [self.values[(id(t), m)] for t in stage.inputs]
        watched = [
            i
            for i, (t, x) in enumerate(zip(stage.inputs, values))
            if x.dtype.is_floating and id(t) not in self.model_inputs
        ]
        return values, watched

    def _loss(self, s: int, m: int, outputs: Sequence[tf.Tensor]) -> list[tf.Tensor] | None:
        """On the last stage, micro-batch m's loss (as its share of the batch's, kept in ``losses``) and
        the gradients of the scaled loss for the model's floating outputs, where the stage's backward
        starts; None on other stages."""
        executor = self.executor
        if s != len(executor.stages) - 1:
            return None
        start = len(executor.stages[s].outputs)
        flat = list(outputs[start : start + len(executor.model.outputs)])
        mask = None if executor.mask is None else outputs[-1]
        loss_fn = executor.loss_function(self.loss_fn, self.scale_loss)
        loss, gradients, self.steps[m] = loss_fn(self.y[m], flat, mask, self.weights[m], self.rows[m], self.share[m])
        if mask is not None:
            for output in flat:
                set_keras_mask(output, mask)
        self.predictions[m] = keras.tree.pack_sequence_as(executor.model._outputs_struct, flat)
        self.losses[m] = loss
        return list(gradients)

    def forward(self, s: int, m: int) -> None:
        program = self.executor.programs[s]
        values, watched = self._inputs(s, m)
        tape = None if self.executor.options.recomputes(s) else tf.GradientTape()
        with tape if tape is not None else contextlib.nullcontext():
            if tape is not None:
                tape.watch([values[i] for i in watched])
            results = program.forward(True)(*program.arguments(values, self.valid[m], self.batch_rows))
        _check_splittable(program, "forward")
        outputs, layer_loss, stats, seeds = program.split(results)
        if layer_loss is not None:
            self.layer_losses.append(layer_loss)
        loss_gradients = self._loss(s, m, outputs)  # outside the tape: the backward starts from its gradients
        for layer, moments in zip(program.deferred_layers, stats):
            self.statistics.setdefault((s, id(layer)), (layer, []))[1].append(moments)
        for symbolic, value in zip(program.returns, outputs):
            self.values[(id(symbolic), m)] = value
        self.kept[(s, m)] = (tape, outputs, layer_loss, seeds, loss_gradients)
        self.last_op[s] = [*outputs, *(loss_gradients or [])]

    def backward(self, s: int, m: int) -> None:
        program, stage = self.executor.programs[s], self.executor.stages[s]
        values, watched_index = self._inputs(s, m)
        watched = [values[i] for i in watched_index]
        tape, outputs, layer_loss, seeds, loss_gradients = self.kept.pop((s, m))
        if tape is None:  # recomputation (never the last stage): the stage's forward again, under a tape, here
            with tf.GradientTape() as tape:
                tape.watch(watched)
                results = program.recompute()(*program.arguments(values, self.valid[m], self.batch_rows), *seeds)
            outputs, layer_loss, _, _ = program.split(results, "recompute")
        targets: list[tf.Tensor] = []
        output_gradients: list[tf.Tensor] = []
        if layer_loss is not None:  # the stage's layer losses join the loss as they are (each is its part)
            targets.append(layer_loss)
            output_gradients.append(tf.cast(self.scale_loss(tf.ones([], tf.float32)), tf.float32))
        if loss_gradients is not None:  # the last stage: from the loss's gradients for the model's outputs
            start = len(stage.outputs)
            predictions = [t for t in outputs[start : start + len(self.executor.model.outputs)] if t.dtype.is_floating]
            targets += predictions
            output_gradients += loss_gradients
        for symbolic, value in zip(stage.outputs, outputs):
            grads = self.pending.pop((id(symbolic), m), None)
            if grads:
                targets.append(value)
                output_gradients.append(grads[0] if len(grads) == 1 else tf.add_n(grads))
        variables = list(stage.trainable_variables)
        if not targets:  # nothing this stage computes reaches the loss
            return
        with tf.name_scope(f"stage{s}_backward"):  # names the backward call (or its inlined nodes)
            result = tape.gradient(targets, watched + variables, output_gradients=output_gradients)
        for i, g in zip(watched_index, result[: len(watched)]):
            if g is not None:
                self.pending.setdefault((id(stage.inputs[i]), m), []).append(g)
        self._accumulate(s, result[len(watched) :])
        self.last_op[s] = [g for g in result if g is not None] or self.last_op[s]

    def _accumulate(self, s: int, gradients: Sequence[Any]) -> None:
        """Adds a micro-batch's weight gradients to stage s's sums (the first micro-batch's start them)."""
        totals = self.gradients[s]
        # an embedding's IndexedSlices are made dense to be summed
        new = {i: tf.convert_to_tensor(g) for i, g in enumerate(gradients) if g is not None}
        summed = [i for i in new if totals[i] is not None]
        if summed:
            sums = self.executor.programs[s].accumulate()([totals[i] for i in summed], [new[i] for i in summed])
            for i, total in zip(summed, sums):
                totals[i] = total
        for i in new.keys() - set(summed):
            totals[i] = new[i]

    def finish(self) -> tuple[tf.Tensor, list[Any], list[tf.Tensor], list[tf.Tensor]]:
        """After the last action, per stage on its device: the weights' regularization (once per step,
        with its gradients) and the deferred batch-norm updates; returns what ``Executor.train`` does."""
        executor = self.executor
        losses = [x for x in self.losses if x is not None]
        if executor.mask is not None:  # sum over valid steps / batch's steps -> the mean over valid steps
            if self.layer_losses:
                raise InputError(
                    "The model's output carries a Keras mask and its layers add losses (add_loss, activity "
                    "regularizers): the pipelined step weights the output loss by the batch's valid steps after "
                    "the backward and cannot keep the layer losses' gradients apart. Expected one of the two: "
                    "drop the mask before the output, or the layer losses."
                )
            with tf.device(executor.stages[-1].device):
                valid, steps = tf.unstack(tf.add_n(self.steps))
                correction = tf.math.divide_no_nan(steps, valid)
                losses = [tf.add_n(losses) * correction]
            for stage, grads in zip(executor.stages, self.gradients):
                with tf.device(stage.device):
                    grads[:] = [None if g is None else g * tf.cast(correction, g.dtype) for g in grads]
        losses += self.layer_losses
        gradients = []
        for stage, grads in zip(executor.stages, self.gradients):
            with tf.device(stage.device), tf.control_dependencies(self.last_op[stage.index] or []):
                penalties = _regularization(stage, grads, self.scale_loss)
                if penalties is not None:
                    losses.append(penalties)
                for (s, _), (layer, moments) in self.statistics.items():
                    if s == stage.index:
                        update_moving_statistics(layer, moments)
                gradients += [tf.zeros_like(v) if g is None else g for v, g in zip(stage.trainable_variables, grads)]
        with tf.device(executor.stages[-1].device):
            loss = tf.add_n(losses)
        return loss, self.predictions, self.valid, gradients


def _check_splittable(program: StageProgram, kind: str) -> None:
    """Refuses a stage whose layers add a loss that micro-batches cannot split (M > 1)."""
    name = program.unsplittable.get(kind)
    if name is not None:
        raise InputError(
            f"Layer '{name}' adds a loss (add_loss, or an activity regularizer of a layer inside it or of a "
            f"scalar output) that cannot be split over {program.num_microbatches} micro-batches: the runtime "
            "cannot tell whether it is a mean or a sum over the batch's rows. Use num_microbatches=1, or "
            "give the layer an activity_regularizer on a batched output (split exactly) instead."
        )


def _regularization(stage: Stage, gradients: list[Any], scale_loss: Any) -> tf.Tensor | None:
    """Adds the gradients of the stage's weight regularizers to ``gradients``; returns their sum (or None)."""
    variables = list(stage.trainable_variables)
    with tf.GradientTape() as tape:
        terms = [t for op in stage.operations for t in getattr(op, "_get_regularization_losses", list)()]
        if not terms:
            return None
        penalty = tf.cast(tf.add_n(terms), tf.float32)
        scaled = scale_loss(penalty)
    for i, g in enumerate(tape.gradient(scaled, variables)):
        if g is not None:
            gradients[i] = g if gradients[i] is None else gradients[i] + g
    return penalty
