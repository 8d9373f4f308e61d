"""Executes a pipeline schedule: each stage's forward, backward and optimizer update on its device.

Every stage becomes one ``tf.function`` per kind (``runtime.stages``), traced once for the
micro-batch's static shape. Keras' compiled step runs the micro-batches in one ``tf.while_loop``
(``Executor._loop``; unlooped when M = 1) whose body is one micro-batch's *iteration*, traced once, so
the step's graph does not grow with M. In the iteration, every action runs under its stage's device:

- ``F`` (stage s): calls the stage function on the micro-batch's boundary tensors, recorded on a tape of
  its own (or, with recomputation, unrecorded: only the inputs are kept; the last stage, whose backward
  comes next, always records). The last stage computes the micro-batch's loss on its device, with the
  gradients of the loss for the model's outputs (where its B starts).
- ``B`` (stage s, in reverse stage order): asks that tape for the gradients of the stage's inputs and
  weights, with the gradients of its outputs from the stages that read them; every gradient op is
  created under the stage's device. Weight gradients are summed per stage on its device, in the loop.
  With recomputation the stage function first runs again under a fresh tape, drawing the dropout masks
  of its forward (``StageProgram.recompute``).
- After the loop each stage's optimizer update runs on its device: the optimizer's per-variable update
  (moments, bias correction, the assign) is issued under the variable's device.

The iterations overlap (stage s + 1 of micro-batch m beside stage s of micro-batch m + 1), in the
order the schedule (``partitioner.schedule``) allows: each stage runs its forwards in micro-batch order,
and holds at most the schedule's micro-batches in flight (``Schedule.max_in_flight``: M for GPipe,
K - s for 1F1B), the forward of micro-batch m waiting for the backward of m - window (``_TrainStep``).

Micro-batches have one static shape, so each stage function is traced once: a batch of B rows is split
into M micro-batches of ceil(B / M) rows, the rows past B repeating real rows. The repeated rows are
left out of the loss (each micro-batch's loss is its part of Keras' compiled loss over its own rows,
``runtime.losses``: for a mean, weighted by their share of the batch; so the step's loss and gradients
are the original model's on the whole batch) and out of batch normalization's statistics (a row mask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend import set_keras_mask  # what Keras' own layers call

from partitioner.errors import InputError
from partitioner.schedule import Schedule
from runtime.batchnorm import (
    BATCH_NORM,
    check_deferrable,
    combine,
    is_plain_batch_norm,
    normalize,
    update_moving_statistics,
)
from runtime.replicas import Replicas, StageCollectives
from runtime.stages import Stage, output_masks

SCHEDULES = ("gpipe", "1f1b")


def _call_context(operation: Any, kwargs: dict[str, Any], training: bool) -> None:
    if "training" in getattr(operation, "_call_context_args", {}):
        kwargs["training"] = training


def _seed_generators(operations: Sequence[Any]) -> list[Any]:
    """Every seed generator (of dropout and other random layers) of the operations, each once."""
    found: dict[int, Any] = {}
    for operation in operations:
        layers = operation._flatten_layers() if hasattr(operation, "_flatten_layers") else [operation]
        for layer in layers:
            for generator in getattr(layer, "_seed_generators", []):
                found.setdefault(id(generator.state), generator)
    return list(found.values())


def xla_blockers(stage: Stage) -> list[str]:
    """The layers of a stage that keep it from being compiled with XLA: recurrent layers (LSTM, GRU, any
    ``keras.layers.RNN``, inside ``Bidirectional`` too), whose while loop's TensorList intermediates, which
    the recorded forward hands to the backward, cannot leave an XLA cluster (TensorFlow's
    UnimplementedError). ``compile(jit_compile=True)`` leaves such a stage uncompiled and compiles the rest."""
    found = []
    for operation in stage.operations:
        layers = operation._flatten_layers() if hasattr(operation, "_flatten_layers") else [operation]
        if any(isinstance(layer, keras.layers.RNN) for layer in layers):
            found.append(operation.name)
    return found


def batch_size(inputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The batch's row count B, as a value Grappler cannot fold into a constant.

    With a batch of static size, every micro-batch's row mask, row count and share of the loss would
    fold into constants, and TensorFlow's function optimizer would then specialise (copy and optimise
    anew) a stage function for every call site that takes one: a first-step cost growing with M.
    """
    return tf.raw_ops.PlaceholderWithDefault(input=tf.shape(inputs[0])[0], shape=[])


class _Boundary:
    """A function the step calls and TensorFlow never inlines into it: a ``tf.function`` whose own body
    is one call of ``body``, traced as a function of its own.

    TensorFlow's graph passes visit every call site of the step's graph and turn the callee's
    definition into a graph there, before they read ``_noinline`` (Grappler's function optimizer,
    twice, and the inlining pass before it): with a callee of one call node that work is small at
    each call site, and ``body`` is optimised once, where the boundary function is instantiated on its
    device. Calls go to the traced concrete function of the arguments' shapes and dtypes (kept here,
    so a call does not recompute the arguments' tracing types; ``concrete`` also takes specs, to trace
    before a loop is built); ``reduce_retracing`` gives one more trace, for any batch size, at the
    first call with another micro-batch size (a remainder batch). With ``jit_compile`` the boundary
    function, the inner call inlined, is one XLA cluster on the device it is called on.

    With ``inline`` (one micro-batch: no loop, one call per step) TensorFlow may inline the function
    into the step, as plain Keras' step is one graph: the call boundaries cost a one-device
    transformer step about a fifth more than plain Keras, inlined 4% (measured side by side,
    benchmarks/runtime). The call runs under a name scope of the function's name, so the nodes of an
    inlined body still say which stage and kind they belong to (``runtime.placement``).
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

    def concrete(self, *args: Any) -> Any:
        """The traced function for arguments of these shapes and dtypes (tensors or ``tf.TensorSpec``s)."""
        key = tuple(
            (tuple(x.shape), x.dtype) if tf.is_tensor(x) or isinstance(x, tf.TypeSpec) else ("py", repr(x))
            for x in tf.nest.flatten(args)
        )
        concrete = self._concrete.get(key)
        if concrete is None:
            concrete = self._concrete[key] = self.function.get_concrete_function(*args)
        return concrete

    def __call__(self, *args: Any) -> Any:
        concrete = self.concrete(*args)
        with tf.name_scope(self.name):  # the call's name, and an inlined body's nodes', say what it is
            return concrete(*args)


class StageProgram:
    """The compiled functions of one stage: forward (training or not), and the recomputing forward."""

    def __init__(self, stage: Stage, returns: Sequence[Any], options: ExecutionOptions) -> None:
        self.stage = stage
        self.returns = tuple(returns)  # symbolic tensors the stage function returns, in order
        # XLA per stage, where XLA can compile the stage's recorded forward (``xla_blockers``)
        self.jit_compile = options.jit_compile and not xla_blockers(stage)
        self.batch_norm = options.batch_norm
        self.seed_generators = _seed_generators(stage.operations)
        self.seed_variables = [g.state.value for g in self.seed_generators]  # TensorFlow's variables
        # the seed states a recomputing forward draws from, one per generator: set to the first
        # forward's, they leave the generators' own states to the forwards of later micro-batches.
        # Made from a copy of the state's value: given the variable itself, keras.Variable wraps it,
        # and the recompute would rewind the state the forwards draw from
        self.shadow_seeds = []
        if options.recomputes(stage.index):
            with tf.device(stage.device):
                self.shadow_seeds = [
                    keras.Variable(g.state.value.read_value(), trainable=False, name=f"{g.name}_recompute")
                    for g in self.seed_generators
                ]
        self.normalized: set[int] = set()  # ids of the batch normalizations the training forward normalizes itself
        self.non_trainable = [
            v.value
            for v in {id(v): v for op in stage.operations for v in op.non_trainable_weights}.values()
            if v.dtype != "string"
        ]
        self.num_microbatches = options.num_microbatches
        # the parts a step's batch is split into: micro-batches, times replicas (runtime.replicas)
        self.num_parts = options.num_microbatches * options.num_replicas
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
                self.normalized.add(id(operation))
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
            if added and self.num_parts > 1:
                self.unsplittable[kind] = operation.name
            elif added:
                terms += [tf.reduce_sum(tf.cast(x, tf.float32)) for x in added]
        if regularizer is not None:
            for output in keras.tree.flatten(outputs):
                if not tf.is_tensor(output):
                    continue
                if output.shape.rank == 0:  # no rows to split: Keras takes it whole
                    if self.num_parts > 1:
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

    def restored(self) -> list[tf.Variable]:
        """The non-trainable variables a recomputing forward may change and must put back: all but the
        seed states (it draws from ``shadow_seeds``) and the statistics of the batch normalizations the
        training forward normalizes itself (``runtime.batchnorm``: they are moved after the step)."""
        kept = {
            id(w.value)
            for op in self.stage.operations
            for layer in (op._flatten_layers() if hasattr(op, "_flatten_layers") else [op])
            if id(layer) in self.normalized
            for w in layer.non_trainable_weights
        }
        seeds = {id(v) for v in self.seed_variables}
        return [v for v in self.non_trainable if id(v) not in kept and id(v) not in seeds]

    @contextlib.contextmanager
    def _drawing_from_shadows(self) -> Any:
        """While tracing, the stage's random layers draw from ``shadow_seeds`` instead of their own states."""
        own = [g.state for g in self.seed_generators]
        try:
            for generator, shadow in zip(self.seed_generators, self.shadow_seeds):
                generator.state = shadow
            yield
        finally:
            for generator, state in zip(self.seed_generators, own):
                generator.state = state

    def recompute(self) -> Any:
        """f(*arguments, *seeds) -> [returns..., layer loss if any]: the training forward again, leaving no trace.

        The random layers draw from ``shadow_seeds``, set to the seed states the first forward began
        with: the recomputed forward draws the same masks and leaves the layers' own states to the
        forwards of later micro-batches, which may run meanwhile. The non-trainable variables it may
        change (``restored``: none for dropout and the batch normalizations the runtime normalizes
        itself) are put back afterwards, so it updates nothing twice; a stage with such variables
        runs no forward while its recompute runs (``Executor.windows``).
        """
        num_arguments = len(self.stage.inputs) + int(self.takes_mask) + int(self.regularized)

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            state = self.restored()
            saved = [tf.identity(v.read_value()) for v in state]
            with tf.control_dependencies(saved):
                seeds = zip(self.shadow_seeds, flat[num_arguments:])
                seeded = [shadow.value.assign(seed, read_value=False) for shadow, seed in seeds]
            with tf.control_dependencies(seeded), self._drawing_from_shadows():
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
    num_replicas: int = 1  # D: copies of the pipeline whose stages sum their gradients (runtime.replicas)

    def __post_init__(self) -> None:
        Replicas(self.num_replicas)  # an integer >= 1, or one clear error
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
        if options.batch_norm == "deferred":
            check_deferrable([node for stage in self.stages for node in stage.nodes], options.num_microbatches)
        # the one Keras mask every model output carries (runtime.rebuild refuses others), or None
        self.mask = next(iter(output_masks(model)), None)
        # what the last stage returns for the loss: the model's outputs, and their mask
        self.loss_tensors = (*model.outputs, *(() if self.mask is None else (self.mask,)))
        last = len(self.stages) - 1
        self.programs = [
            StageProgram(s, (*s.outputs, *(self.loss_tensors if s.index == last else ())), options) for s in self.stages
        ]
        self._loss_functions: dict[Any, Any] = {}
        # the R action: each stage's collectives with the same stage of the other replicas (none when D = 1)
        self.collectives = (
            [StageCollectives(s.index, s.device, options.num_replicas) for s in self.stages]
            if options.num_replicas > 1
            else []
        )

    def loss_function(self, loss_fn: Any, scale_loss: Any) -> Any:
        """f(y, flat_predictions, mask, sample_weight, weight_sums, rows, share) -> (a micro-batch's part of
        the batch's loss, the gradient of its scaled part for each floating prediction, [valid steps, steps]).

        The part is ``loss_fn`` over the micro-batch's own first ``rows`` rows, given ``share`` (the
        micro-batch's share of the batch's rows) and ``weight_sums`` (the batch's sample weights summed,
        leaf by leaf), summed (a micro-batch with no rows of its own, when B < M, gives Keras an empty
        loss, summed to 0). With an output ``mask`` (None without), Keras' mean loss is the mean over the
        micro-batch's valid steps; times the share of its steps that are valid, it becomes the sum over
        its valid steps divided by the batch's steps, and ``_TrainStep.finish`` divides the step's sum by
        the share of the batch's steps that are valid: the mean over the batch's valid steps, as the
        original computes it (the mean of the micro-batches' means is not, when they hold different
        numbers of valid steps). The gradient of ``scale_loss(loss)`` (the optimizer's loss scaling) is
        taken inside, so the last stage's backward starts from it and the step graph holds no backward
        of this function: one function, traced once, called once per micro-batch. (Differentiated from
        outside, its backward had unused outputs, the gradients of the targets and shares, and Grappler
        specialised a copy of it for every micro-batch.)"""
        key = (loss_fn, scale_loss)
        if key not in self._loss_functions:
            structure = self.model._outputs_struct

            def microbatch_loss(
                y: Any,
                flat: list[tf.Tensor],
                mask: Any,
                sample_weight: Any,
                weight_sums: Any,
                rows: tf.Tensor,
                share: tf.Tensor,
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
                    loss = tf.reduce_sum(tf.cast(loss_fn(own[0], y_pred, own[1], share, weight_sums), tf.float32))
                    scaled = scale_loss(loss)
                gradients = tape.gradient(scaled, floating, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return loss, gradients, steps

            self._loss_functions[key] = _Boundary(microbatch_loss, "microbatch_loss", inline=self.num_microbatches == 1)
        return self._loss_functions[key]

    @property
    def num_microbatches(self) -> int:
        return self.options.num_microbatches

    @property
    def trainable_variables(self) -> list[Any]:
        """Every stage's trainable variables, stage after stage: the order ``train`` returns gradients in."""
        return [v for stage in self.stages for v in stage.trainable_variables]

    def weight_penalties(self) -> tf.Tensor | None:
        """The model's weight-regularizer penalties, each stage's computed on its device (None without any)."""
        penalties = []
        for stage in self.stages:
            with tf.device(stage.device):
                penalty = weight_penalty(stage)
            if penalty is not None:
                penalties.append(penalty)
        return tf.add_n(penalties) if penalties else None

    def mean_over_replicas(self, value: tf.Tensor, count: tf.Tensor) -> tf.Tensor:
        """A replica's mean ``value`` over its ``count`` rows (or valid steps) -> the mean over every
        replica's, on the last stage's device (the value itself with one replica): evaluation's loss."""
        if not self.collectives:
            return value
        with tf.device(self.stages[-1].device):
            n = tf.cast(count, tf.float32)
            total, rows = self.collectives[-1].sum([tf.cast(value, tf.float32) * n, n], "evaluate")
            return tf.cast(total / rows, value.dtype)

    def with_options(self, **changes: Any) -> Executor:
        """The same stages run with other options (new stage functions, traced afresh)."""
        return Executor(self.model, self.stages, replace(self.options, **changes))

    # ----- micro-batches and the order of each stage's actions -----------------------------------

    def microbatch_rows(self, structure: Any) -> int | None:
        """ceil(B / M) where the batch's size B is static (the shape the stage functions are traced for)."""
        leaves = keras.tree.flatten(structure)
        size = tf.convert_to_tensor(leaves[0]).shape[0] if leaves else None
        return None if size is None else -(-size // self.num_microbatches)

    def windows(self) -> list[int]:
        """Per stage, the most micro-batches it holds at once (forward run, backward not yet): the
        schedule's ``max_in_flight`` (M for GPipe, K - s for 1F1B); 1 for a recomputing stage whose
        recompute puts variables back (``StageProgram.restored``), so no forward runs meanwhile."""
        return [
            1 if self.options.recomputes(s) and program.restored() else self.schedule.max_in_flight(s)
            for s, program in enumerate(self.programs)
        ]

    def trace(self, kind: str, parts: _Microbatches, losses: bool = True) -> list[list[tf.TensorSpec]]:
        """Traces every stage's ``kind`` function ("forward" or "inference") for one micro-batch, stage
        after stage, and returns each stage's results as specs: the loop over micro-batches needs the
        number and shapes of what its iterations collect before it is built. With ``losses``, refuses a
        stage whose layer losses micro-batches cannot split."""
        specs = {id(t): tf.TensorSpec(x.shape[1:], x.dtype) for t, x in zip(self.model.inputs, parts.inputs)}
        valid, batch = tf.TensorSpec(parts.valid.shape[1:], tf.bool), tf.TensorSpec([], tf.float32)
        traced = []
        for program in self.programs:
            arguments = program.arguments([specs[id(t)] for t in program.stage.inputs], valid, batch)
            concrete = program.forward(kind == "forward").concrete(*arguments)
            results = [tf.TensorSpec(x.shape, x.dtype) for x in tf.nest.flatten(concrete.structured_outputs)]
            if losses:
                _check_splittable(program, kind)
            returns = program.split(results, kind)[0]
            specs.update({id(t): spec for t, spec in zip(program.returns, returns)})
            traced.append(results)
        return traced

    def _loop(self, iteration: Any, carry: Any, parallel: int) -> Any:
        """``iteration(m, carry) -> carry`` for m = 0..M-1: unlooped when M = 1, else in one
        ``tf.while_loop`` whose body is traced once (the step's graph does not grow with M) and in
        which up to ``parallel`` iterations run at once (stage s + 1 of micro-batch m beside stage s of
        micro-batch m + 1)."""
        num = self.num_microbatches
        if num == 1:
            return iteration(0, carry)
        with _without_automatic_control_dependencies():
            _, carry = tf.while_loop(
                lambda m, _: m < num,
                lambda m, c: (m + 1, iteration(m, c)),
                (tf.constant(0), carry),
                parallel_iterations=parallel,
                maximum_iterations=num,
            )
        return carry

    def _collector(self, spec: tf.TensorSpec) -> Any:
        """Where the iterations leave one tensor each: a TensorArray in the loop; unlooped, the tensor itself."""
        if self.num_microbatches == 1:
            return None
        return tf.TensorArray(spec.dtype, size=self.num_microbatches, element_shape=spec.shape)

    # ----- steps ---------------------------------------------------------------------------------

    def forward(self, inputs: Sequence[tf.Tensor], losses: bool = False) -> tuple[Any, tf.Tensor | None]:
        """Forward only (evaluation and prediction), every micro-batch through every stage on its device.

        Returns:
            (the model outputs of every micro-batch one after the other, each [M * ceil(B/M), ...]: the
            first B rows are the batch's in order, the rest repeat them; the batch's layer losses
            (``add_loss``, activity regularizers) or None if there are none).
        """
        parts = _Microbatches(self, inputs)
        traced = self.trace("inference", parts, losses)
        last = self.programs[-1]
        returned = traced[-1][len(last.stage.outputs) :][: len(self.loss_tensors)]
        collected = [self._collector(spec) for spec in returned]
        with tf.device(last.stage.device):
            carry = {"outputs": collected, "layer_loss": tf.zeros([])}
        has_layer_losses = []

        def iteration(m: Any, carry: dict[str, Any]) -> dict[str, Any]:
            values = {id(t): x for t, x in zip(self.model.inputs, _take(parts.inputs, m))}
            terms = []
            for program in self.programs:
                with tf.device(program.stage.device):
                    own = [values[id(t)] for t in program.stage.inputs]
                    arguments = program.arguments(own, parts.valid[m], parts.batch_rows)
                    outputs, layer_loss, _, _ = program.split(program.forward(False)(*arguments), "inference")
                terms += [] if layer_loss is None else [layer_loss]
                values.update({id(t): x for t, x in zip(program.returns, outputs)})
            with tf.device(last.stage.device):
                has_layer_losses.append(bool(terms))
                return {
                    "outputs": [_collect(c, m, values[id(t)]) for c, t in zip(carry["outputs"], self.loss_tensors)],
                    "layer_loss": carry["layer_loss"] + (tf.add_n(terms) if terms else 0.0),
                }

        carry = self._loop(iteration, carry, parallel=len(self.stages))
        with tf.device(last.stage.device):
            return self._outputs(carry["outputs"]), (carry["layer_loss"] if any(has_layer_losses) else None)

    def _outputs(self, collected: Sequence[Any]) -> Any:
        """The collected model outputs (and output mask) -> the model's output structure, each [M * ceil(B/M), ...]."""
        flat = [_whole(c) for c in collected]
        outputs = flat[: len(self.model.outputs)]
        if self.mask is not None:
            for output in outputs:
                set_keras_mask(output, flat[-1])
        return keras.tree.pack_sequence_as(self.model._outputs_struct, outputs)

    def train(
        self,
        inputs: Sequence[tf.Tensor],
        y: Any,
        sample_weight: Any,
        loss_fn: Any,
        scale_loss: Any,
        sparse_rows_summable: bool = True,
    ) -> Any:
        """Runs every micro-batch's forwards and backwards for one batch (``_TrainStep``).

        Args:
            inputs: the model's flat inputs, each [B, ...].
            y: targets in the model's output structure (or None).
            sample_weight: as Keras takes it (or None).
            loss_fn: (y, y_pred, sample_weight, share, weight_sums) -> a micro-batch's part of the batch's
                loss (``runtime.losses.microbatch_part``): ``share`` is its share of the batch's rows,
                ``weight_sums`` the batch's sample weights summed leaf by leaf (None without weights).
            scale_loss: loss -> the loss the gradients are taken of (the optimizer's loss scaling).
            sparse_rows_summable: whether the optimizer that takes the gradients updates from an
                embedding's sparse rows as from their sum (``optimizer_state.updates_sparse_rows_linearly``);
                where not, a sparse gradient is refused at M x D > 1 (at M = 1 it is handed on as it is).

        Returns:
            (the batch's loss, the model outputs as ``forward`` returns them, the gradients of every
            stage's trainable variables, stage after stage, each summed over the micro-batches on its
            stage's device).
        """
        return _TrainStep(self, inputs, y, sample_weight, loss_fn, scale_loss, sparse_rows_summable).run()


class _Microbatches:
    """A batch as M micro-batches of ceil(B / M) rows, stacked: each leaf [B, ...] of a structure becomes
    [M, ceil(B/M), ...], the rows past B repeating real rows, so that every micro-batch has one static
    shape (each stage function is traced once). The batch's own rows of micro-batch m are its first
    ``rows(m)``; ``valid`` [M, ceil(B/M)] marks them."""

    def __init__(self, executor: Executor, inputs: Sequence[tf.Tensor]) -> None:
        self.num = num = executor.num_microbatches
        self.batch = batch = batch_size(inputs)
        self.size = (batch + num - 1) // num
        self.static_size = executor.microbatch_rows(list(inputs))
        self.index = tf.range(self.size * num) % batch
        self.batch_rows = tf.cast(batch, tf.float32)
        self.valid = tf.reshape(tf.range(self.size * num) < batch, [num, self.size])
        self.valid.set_shape([num, self.static_size])
        self.inputs = self.stack(list(inputs))

    def stack(self, structure: Any) -> Any:
        """Each leaf [B, ...] -> [M, ceil(B/M), ...] (None stays None)."""
        if structure is None:
            return None

        def one(t: Any) -> tf.Tensor:
            t = tf.convert_to_tensor(t)
            shape = tf.concat([[self.num, self.size], tf.shape(t)[1:]], 0)
            stacked = tf.reshape(tf.gather(t, self.index), shape)
            stacked.set_shape([self.num, self.static_size, *t.shape[1:]])
            return stacked

        return keras.tree.map_structure(one, structure)

    def rows(self, m: Any) -> tf.Tensor:
        """How many of micro-batch m's rows are the batch's own (the rest repeat them)."""
        return tf.clip_by_value(self.batch - m * self.size, 0, self.size)

    def share(self, m: Any) -> tf.Tensor:
        """Micro-batch m's share of the batch's rows (float32)."""
        return tf.cast(self.rows(m), tf.float32) / self.batch_rows


@contextlib.contextmanager
def _without_automatic_control_dependencies() -> Any:
    """Builds the loop's body without TensorFlow's automatic control dependencies.

    In a ``tf.function`` every op with side effects (here every stage function call: they read
    variables) gets a control edge to the body's outputs, so each iteration's loop variables would wait
    for all of the previous iteration: the micro-batches would run one after the other (measured: at
    most one micro-batch between a stage's forward and its backward, under GPipe and M = 8). The body
    orders itself instead: every call's results are consumed (tokens, sums, collected outputs); each
    stage's forwards, and a recomputing stage's backwards, are chained by tokens (they write seed states
    and statistics); no variable the loop reads is written before the loop ends (the optimizer runs
    after it). TensorFlow has no public switch for this: the graph attribute ``while_v2`` reads is
    private (``tests/runtime/test_loop.py`` checks that micro-batches overlap).
    """
    graph = tf.compat.v1.get_default_graph()
    saved = graph._add_control_dependencies
    graph._add_control_dependencies = False
    try:
        yield
    finally:
        graph._add_control_dependencies = saved


def _take(stacked: Any, m: Any) -> Any:
    """Micro-batch m (a Python int or a scalar tensor) of a stacked structure (None stays None)."""
    return None if stacked is None else keras.tree.map_structure(lambda t: t[m], stacked)


def _collect(collector: Any, m: Any, value: tf.Tensor) -> Any:
    """Leaves micro-batch m's ``value`` in a collector (``Executor._collector``); returns the collector to carry on."""
    return collector.write(m, value) if isinstance(collector, tf.TensorArray) else value


def _whole(collector: Any) -> tf.Tensor:
    """A collector's tensors one after the other along the rows: [M * rows, ...]."""
    if not isinstance(collector, tf.TensorArray):
        return collector
    stacked = collector.stack()
    whole = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))
    rows = stacked.shape[0] * stacked.shape[1] if stacked.shape[1] is not None else None
    whole.set_shape([rows, *stacked.shape[2:]])
    return whole


def _parts(collector: Any, num: int) -> list[tf.Tensor]:
    """A collector's tensors, one per micro-batch."""
    return tf.unstack(collector.stack(), num=num) if isinstance(collector, tf.TensorArray) else [collector]


def _token(device: str) -> tf.Tensor:
    """A scalar that orders actions: an action waits for a token made after another one."""
    with tf.device(device):
        return tf.zeros([])


def _after(token: tf.Tensor, done: Sequence[Any]) -> tf.Tensor:
    """A token made after ``done`` ran (a copy of ``token`` with control dependencies on them)."""
    with tf.control_dependencies(list(done)):
        return tf.identity(token)


class _TrainStep:
    """One training step: the iteration of one micro-batch (every stage's forward in order, the loss on
    the last stage, every stage's backward in reverse order), run for m = 0..M-1 in one loop
    (``Executor._loop``), then what follows the last (``finish``).

    The iterations overlap: stage s + 1 of micro-batch m runs beside stage s of micro-batch m + 1. Each
    stage runs its forwards in micro-batch order and, where the schedule holds fewer than M micro-batches
    on it (``Executor.windows``: 1F1B's K - s), the forward of micro-batch m only after the backward of
    micro-batch m - window: the loop carries, per stage, tokens made after its last forward and its last
    ``window`` backwards. A recomputing stage runs its backwards in order too (they share the seed states
    they draw from). Weight gradients are summed in the loop, per stage on its device; the loss, the
    layer losses and, with an output mask, the valid steps on the last stage's; the model outputs and
    the batch-norm statistics of every micro-batch are collected for ``finish``.
    """

    def __init__(
        self,
        executor: Executor,
        inputs: Sequence[tf.Tensor],
        y: Any,
        sample_weight: Any,
        loss_fn: Any,
        scale_loss: Any,
        sparse_rows_summable: bool = True,
    ) -> None:
        self.executor = executor
        self.sparse_rows_summable = sparse_rows_summable
        # one micro-batch on one replica: an embedding's sparse gradient goes to the optimizer as it is,
        # as Keras hands it over (Adam squares each row before summing repeated rows)
        self.keeps_sparse = executor.num_microbatches == 1 and executor.options.num_replicas == 1
        # M > 1 on one replica, an optimizer that updates row by row: an embedding's sparse rows are kept
        # apart through the loop (``rows`` of the carry) and handed over together, as the original's batch
        # gives them; ``sparse`` holds the (stage, variable) pairs whose traced backward gave rows
        self.sparse_rows_apart = (
            not sparse_rows_summable and executor.num_microbatches > 1 and executor.options.num_replicas == 1
        )
        self.sparse: set[tuple[int, int]] = set()
        self.scale_loss = scale_loss
        self.loss_function = executor.loss_function(loss_fn, scale_loss)
        self.parts = _Microbatches(executor, inputs)
        self.y = self.parts.stack(y)
        self.weights = self.parts.stack(sample_weight)
        with tf.device(executor.stages[-1].device):  # the whole batch's weights, where the loss is
            self.weight_sums = keras.tree.map_structure(
                lambda w: None if w is None else tf.reduce_sum(tf.cast(w, tf.float32)), sample_weight
            )
        self.traced = executor.trace("forward", self.parts)
        self.windows = executor.windows()
        self.model_inputs = {id(t) for t in executor.model.inputs}
        self.layer_losses: list[bool] = []  # per traced iteration: whether any stage returned a layer loss

    def run(self) -> tuple[tf.Tensor, Any, list[tf.Tensor]]:
        return self.finish(self.executor._loop(self.iteration, self.start(), parallel=max(self.windows)))

    def start(self) -> dict[str, Any]:
        """The loop's carry before the first micro-batch (tokens only in the loop; sums of None unlooped)."""
        executor = self.executor
        looped = executor.num_microbatches > 1
        last = executor.programs[-1]
        collectors = []
        for program, results in zip(executor.programs, self.traced):
            stats = program.split(results)[2]
            collectors.append([[executor._collector(spec) for spec in moments] for moments in stats])
        carry: dict[str, Any] = {
            "forward": [[_token(s.device)] if looped else [] for s in executor.stages],
            "backward": [
                [_token(s.device)] if looped and executor.options.recomputes(s.index) and p.shadow_seeds else []
                for s, p in zip(executor.stages, executor.programs)
            ],
            "window": [
                [_token(s.device) for _ in range(w)] if looped and w < executor.num_microbatches else []
                for s, w in zip(executor.stages, self.windows)
            ],
            "gradients": [[None] * len(s.trainable_variables) for s in executor.stages],
            # per stage and embedding variable: the micro-batches' sparse gradient rows, kept apart
            "rows": [{} for _ in executor.stages],
            "statistics": collectors,
            "outputs": [
                executor._collector(spec)
                for spec in self.traced[-1][len(last.stage.outputs) :][: len(executor.loss_tensors)]
            ],
            "loss": None,
            "layer_loss": None,
            "steps": None,
        }
        if looped:
            for stage, sums, rows in zip(executor.stages, carry["gradients"], carry["rows"]):
                with tf.device(stage.device):
                    sums[:] = [tf.zeros(v.shape, v.dtype) for v in stage.trainable_variables]
                    if self.sparse_rows_apart:
                        rows.update(
                            {
                                i: _row_arrays(stage.trainable_variables[i], executor.num_microbatches)
                                for i in _embeddings(stage)
                            }
                        )
            with tf.device(last.stage.device):
                carry["loss"], carry["layer_loss"] = tf.zeros([]), tf.zeros([])
                carry["steps"] = tf.zeros([2]) if executor.mask is not None else []
        return carry

    def iteration(self, m: Any, carry: dict[str, Any]) -> dict[str, Any]:
        """Micro-batch m's forwards, loss and backwards; returns the carry after it."""
        executor = self.executor
        new = {key: list(value) if isinstance(value, list) else value for key, value in carry.items()}
        micro = _Micro(m, {id(t): x for t, x in zip(executor.model.inputs, _take(self.parts.inputs, m))})
        for program in executor.programs:
            s = program.stage.index
            waits = carry["forward"][s] + carry["window"][s][:1]
            with tf.device(program.stage.device), tf.control_dependencies(waits):
                done = self.forward(s, micro, new)
                new["forward"][s] = [_after(t, done) for t in carry["forward"][s]]
        with tf.device(executor.stages[-1].device):
            self.layer_losses.append(bool(micro.layer_losses))
            if micro.layer_losses:
                new["layer_loss"] = _add(carry["layer_loss"], tf.add_n(micro.layer_losses))
        for program in reversed(executor.programs):
            s = program.stage.index
            with tf.device(program.stage.device), tf.control_dependencies(carry["backward"][s]):
                done = self.backward(s, micro, new) or micro.done[s]
                new["backward"][s] = [_after(t, done) for t in carry["backward"][s]]
                if carry["window"][s]:
                    new["window"][s] = [*carry["window"][s][1:], _after(carry["window"][s][0], done)]
        return new

    def _inputs(self, s: int, micro: _Micro) -> tuple[list[tf.Tensor], list[int]]:
        stage = self.executor.stages[s]
        values = [micro.values[id(t)] for t in stage.inputs]
        watched = [
            i
            for i, (t, x) in enumerate(zip(stage.inputs, values))
            if x.dtype.is_floating and id(t) not in self.model_inputs
        ]
        return values, watched

    def _loss(self, s: int, micro: _Micro, outputs: Sequence[tf.Tensor], new: dict[str, Any]) -> list[tf.Tensor] | None:
        """On the last stage, micro-batch m's loss (its part of the batch's, added to the carry's) and
        the gradients of the scaled loss for the model's floating outputs, where the stage's backward
        starts; None on other stages."""
        executor = self.executor
        if s != len(executor.stages) - 1:
            return None
        m = micro.m
        start = len(executor.stages[s].outputs)
        flat = list(outputs[start : start + len(executor.model.outputs)])
        mask = None if executor.mask is None else outputs[-1]
        loss, gradients, steps = self.loss_function(
            _take(self.y, m),
            flat,
            mask,
            _take(self.weights, m),
            self.weight_sums,
            self.parts.rows(m),
            self.parts.share(m),
        )
        new["loss"] = _add(new["loss"], loss)
        if steps is not None:
            new["steps"] = _add(new["steps"], steps)
        new["outputs"] = [_collect(c, m, x) for c, x in zip(new["outputs"], outputs[start:])]
        return list(gradients)

    def forward(self, s: int, micro: _Micro, new: dict[str, Any]) -> list[tf.Tensor]:
        """Stage s's forward of the micro-batch, on a tape unless the stage recomputes; returns its results."""
        program = self.executor.programs[s]
        values, watched = self._inputs(s, micro)
        tape = None if self.executor.options.recomputes(s) else tf.GradientTape()
        with tape if tape is not None else contextlib.nullcontext():
            if tape is not None:
                tape.watch([values[i] for i in watched])
            arguments = program.arguments(values, self.parts.valid[micro.m], self.parts.batch_rows)
            results = program.forward(True)(*arguments)
        outputs, layer_loss, stats, seeds = program.split(results)
        if layer_loss is not None:
            micro.layer_losses.append(layer_loss)
        loss_gradients = self._loss(s, micro, outputs, new)  # outside the tape: the backward starts from its gradients
        new["statistics"][s] = [
            [_collect(c, micro.m, x) for c, x in zip(collectors, moments)]
            for collectors, moments in zip(new["statistics"][s], stats)
        ]
        for symbolic, value in zip(program.returns, outputs):
            # a model output the stage only passes on (it reads it from an earlier stage) keeps the value it
            # came in with: the backward takes its gradients for what the stage read, not for the copy returned
            micro.values.setdefault(id(symbolic), value)
        micro.kept[s] = (tape, outputs, layer_loss, seeds, loss_gradients)
        micro.done[s] = [*outputs, *(loss_gradients or [])]
        return micro.done[s]

    def backward(self, s: int, micro: _Micro, new: dict[str, Any]) -> list[tf.Tensor]:
        """Stage s's backward of the micro-batch, its weight gradients added to the stage's sums;
        returns the gradients it computed (none when nothing the stage computes reaches the loss)."""
        program, stage = self.executor.programs[s], self.executor.stages[s]
        values, watched_index = self._inputs(s, micro)
        watched = [values[i] for i in watched_index]
        tape, outputs, layer_loss, seeds, loss_gradients = micro.kept.pop(s)
        if tape is None:  # recomputation (never the last stage): the stage's forward again, under a tape, here
            with tf.GradientTape() as tape:
                tape.watch(watched)
                arguments = program.arguments(values, self.parts.valid[micro.m], self.parts.batch_rows)
                results = program.recompute()(*arguments, *seeds)
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
            grads = micro.pending.pop(id(symbolic), None)
            if grads:
                targets.append(value)
                output_gradients.append(grads[0] if len(grads) == 1 else tf.add_n(grads))
        if not targets:  # nothing this stage computes reaches the loss
            return []
        variables = list(stage.trainable_variables)
        with tf.name_scope(f"stage{s}_backward"):  # names the backward call (or its inlined nodes)
            result = tape.gradient(targets, watched + variables, output_gradients=output_gradients)
        for i, g in zip(watched_index, result[: len(watched)]):
            if g is not None:
                micro.pending.setdefault(id(stage.inputs[i]), []).append(g)
        new["gradients"][s], new["rows"][s] = self._accumulate(
            s, micro.m, new["gradients"][s], new["rows"][s], result[len(watched) :]
        )
        return [g for g in tf.nest.flatten(result, expand_composites=True) if g is not None]

    def _accumulate(
        self, s: int, m: Any, totals: list[Any], rows: dict[int, Any], gradients: Sequence[Any]
    ) -> tuple[list[Any], dict[int, Any]]:
        """Stage s's sums with micro-batch m's weight gradients added (unlooped, the first ones start them),
        and its sparse rows kept apart where the optimizer updates row by row (``sparse_rows_apart``)."""
        totals, rows = list(totals), dict(rows)
        stage = self.executor.stages[s]
        new: dict[int, Any] = {}
        for i, g in enumerate(gradients):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if self.keeps_sparse:  # the only micro-batch: nothing to sum
                    new[i] = g
                    continue
                if i in rows:  # kept apart: written at m, concatenated after the loop
                    values, indices = rows[i]
                    rows[i] = (
                        values.write(m, tf.cast(g.values, values.dtype)),
                        indices.write(m, tf.cast(g.indices, tf.int32)),
                    )
                    self.sparse.add((s, i))
                    continue
                if not self.sparse_rows_summable:
                    parts = self.executor.num_microbatches * self.executor.options.num_replicas
                    raise InputError(
                        f"'{stage.trainable_variables[i].path}' gets a sparse gradient (one row per token, an "
                        f"embedding's) and the optimizer updates each row on its own (Keras' sparse update: Adam, "
                        f"RMSprop, Adagrad, clipping square or clip a row before repeated rows are summed): summed "
                        f"over {parts} micro-batches or replicas first, the step would differ from the original's. "
                        "Expected num_microbatches=1 on one replica, or an optimizer that updates from the sum "
                        "(SGD, with momentum, without clipping)."
                    )
            new[i] = tf.convert_to_tensor(g)  # an embedding's IndexedSlices are made dense to be summed
        summed = [i for i in new if totals[i] is not None]
        if summed:
            sums = self.executor.programs[s].accumulate()([totals[i] for i in summed], [new[i] for i in summed])
            for i, total in zip(summed, sums):
                totals[i] = total
        for i in new.keys() - set(summed):
            totals[i] = new[i]
        return totals, rows

    def finish(self, carry: dict[str, Any]) -> tuple[tf.Tensor, Any, list[tf.Tensor]]:
        """After the last micro-batch, per stage on its device: with replicas, the ``R`` action (the
        stage's gradients, batch-norm moments and, on the last stage, the loss summed with the other
        replicas'); then the weights' regularization (once per step, with its gradients) and the deferred
        batch-norm updates; returns what ``Executor.train`` does."""
        executor = self.executor
        sums = [list(grads) for grads in carry["gradients"]]
        for s, i in self.sparse:  # every micro-batch's sparse rows, as one batch's
            values, indices = carry["rows"][s][i]
            variable = executor.stages[s].trainable_variables[i]
            with tf.device(executor.stages[s].device):
                sums[s][i] = tf.IndexedSlices(values.concat(), indices.concat(), tf.shape(variable))
        last = executor.stages[-1].device
        loss = carry["loss"]
        layer_loss = carry["layer_loss"] if any(self.layer_losses) else None
        count = self.parts.batch_rows  # what the step's loss is a mean over: rows, or valid steps with a mask
        if executor.mask is not None:  # sum over valid steps / batch's steps -> the mean over valid steps
            if layer_loss is not None:
                raise InputError(
                    "The model's output carries a Keras mask and its layers add losses (add_loss, activity "
                    "regularizers): the pipelined step weights the output loss by the batch's valid steps after "
                    "the backward and cannot keep the layer losses' gradients apart. Expected one of the two: "
                    "drop the mask before the output, or the layer losses."
                )
            with tf.device(last):
                valid, steps = tf.unstack(carry["steps"])
                correction = tf.math.divide_no_nan(steps, valid)
                loss, count = loss * correction, valid
            for stage, grads in zip(executor.stages, sums):
                with tf.device(stage.device):
                    grads[:] = [None if g is None else _scaled(g, correction) for g in grads]
        statistics = []  # per stage: [(layer, [[mean, variance, count] per part])], one entry per layer
        for program, collected in zip(executor.programs, carry["statistics"]):
            moments: dict[int, tuple[Any, list[Any]]] = {}
            for layer, collectors in zip(program.deferred_layers, collected):
                parts = [_parts(c, executor.num_microbatches) for c in collectors]
                moments.setdefault(id(layer), (layer, []))[1].extend(list(x) for x in zip(*parts))
            statistics.append(list(moments.values()))
        if executor.collectives:
            loss, layer_loss = self._reduce(sums, statistics, loss, layer_loss, count)
        losses = [loss] + ([] if layer_loss is None else [layer_loss])
        gradients = []
        for program, grads, layers in zip(executor.programs, sums, statistics):
            stage = program.stage
            with tf.device(stage.device):
                penalties = _regularization(stage, grads, self.scale_loss)  # the same on every replica: after R
                if penalties is not None:
                    losses.append(penalties)
                for layer, stats in layers:
                    update_moving_statistics(layer, stats)
                gradients += [tf.zeros_like(v) if g is None else g for v, g in zip(stage.trainable_variables, grads)]
        with tf.device(last):
            loss = tf.add_n(losses)
            outputs = executor._outputs(carry["outputs"])
        return loss, outputs, gradients

    def _reduce(
        self, sums: list[list[Any]], statistics: list[list[Any]], loss: tf.Tensor, layer_loss: Any, count: tf.Tensor
    ) -> tuple[tf.Tensor, Any]:
        """The ``R`` action of every stage, in place: each replica's local means (gradients, loss, layer
        losses) times its ``count``, and its batch-norm moments as sums, summed over the replicas in one
        collective per stage; divided by the summed count they are the means over the global batch,
        exact for uneven shards. Returns the global (loss, layer loss)."""
        executor = self.executor
        last = len(executor.stages) - 1
        for s, (group, grads, moments) in enumerate(zip(executor.collectives, sums, statistics)):
            with tf.device(group.device):
                n = tf.identity(count)
                present = [i for i, g in enumerate(grads) if g is not None]
                tensors = [grads[i] * tf.cast(n, grads[i].dtype) for i in present]
                for _, stats in moments:  # [count x mean, count x (variance + mean^2), count] per layer
                    mean, variance, total = combine(stats)
                    tensors += [total * mean, total * (variance + tf.square(mean)), total]
                tail = [loss, *([] if layer_loss is None else [layer_loss])] if s == last else []
                tensors += [tf.cast(t, tf.float32) * n for t in tail] + [n]
                summed = group.sum(tensors)
                n = summed.pop()
                for i, g in zip(present, summed):
                    grads[i] = g / tf.cast(n, g.dtype)
                done = len(present)
                for k, (layer, _) in enumerate(moments):
                    weighted_mean, weighted_square, total = summed[done + 3 * k : done + 3 * k + 3]
                    mean = weighted_mean / total
                    moments[k] = (layer, [[mean, weighted_square / total - tf.square(mean), total]])
                if s == last:
                    reduced = [t / n for t in summed[done + 3 * len(moments) :]]
                    loss, layer_loss = reduced[0], (reduced[1] if layer_loss is not None else None)
        return loss, layer_loss


@dataclass
class _Micro:
    """One micro-batch's tensors while its iteration is traced."""

    m: Any  # its index: a Python int unlooped, a scalar tensor in the loop
    values: dict[int, tf.Tensor]  # id(symbolic tensor) -> its value
    pending: dict[int, list[tf.Tensor]] = field(default_factory=dict)  # id(tensor) -> gradients from its readers
    # stage -> (tape or None, outputs, layer loss or None, seeds, the loss's gradients for the model outputs or None)
    kept: dict[int, Any] = field(default_factory=dict)
    done: dict[int, list[tf.Tensor]] = field(default_factory=dict)  # stage -> its forward's results
    layer_losses: list[tf.Tensor] = field(default_factory=list)


def _embeddings(stage: Stage) -> list[int]:
    """Positions in ``stage.trainable_variables`` of the embeddings' tables: their gradients come as sparse rows."""
    tables = {
        id(layer.embeddings)
        for op in stage.operations
        for layer in (op._flatten_layers() if hasattr(op, "_flatten_layers") else [op])  # inside a layer too
        if isinstance(layer, keras.layers.Embedding)
    }
    return [i for i, v in enumerate(stage.trainable_variables) if id(v) in tables]


def _row_arrays(variable: Any, num: int) -> tuple[tf.TensorArray, tf.TensorArray]:
    """Where the loop leaves each micro-batch's sparse rows of ``variable``: values and row indices."""
    values = tf.TensorArray(variable.dtype, size=num, infer_shape=False, element_shape=[None, *variable.shape[1:]])
    return values, tf.TensorArray(tf.int32, size=num, infer_shape=False, element_shape=[None])


def _scaled(gradient: Any, factor: tf.Tensor) -> Any:
    """gradient x factor, for a dense gradient or an embedding's sparse rows (IndexedSlices)."""
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _add(total: Any, value: tf.Tensor) -> tf.Tensor:
    """total + value, where a total of None (unlooped, nothing summed yet) is 0."""
    return value if total is None else total + value


def _check_splittable(program: StageProgram, kind: str) -> None:
    """Refuses a stage whose layers add a loss that micro-batches or replicas cannot split (M x D > 1)."""
    name = program.unsplittable.get(kind)
    if name is not None:
        raise InputError(
            f"Layer '{name}' adds a loss (add_loss, or an activity regularizer of a layer inside it or of a "
            f"scalar output) that cannot be split over {program.num_parts} parts of the batch "
            f"({program.num_microbatches} micro-batches x {program.num_parts // program.num_microbatches} "
            "replica(s)): the runtime cannot tell whether it is a mean or a sum over the batch's rows. Use "
            "num_microbatches=1 on one replica, or give the layer an activity_regularizer on a batched "
            "output (split exactly) instead."
        )


def weight_penalty(stage: Stage) -> tf.Tensor | None:
    """The sum of the stage's weight regularizers' penalties (``kernel_regularizer`` ...), or None."""
    terms = [t for op in stage.operations for t in getattr(op, "_get_regularization_losses", list)()]
    return tf.cast(tf.add_n(terms), tf.float32) if terms else None


def _regularization(stage: Stage, gradients: list[Any], scale_loss: Any) -> tf.Tensor | None:
    """Adds the gradients of the stage's weight regularizers to ``gradients``; returns their sum (or None)."""
    variables = list(stage.trainable_variables)
    with tf.GradientTape() as tape:
        penalty = weight_penalty(stage)
        if penalty is None:
            return None
        scaled = scale_loss(penalty)
    for i, g in enumerate(tape.gradient(scaled, variables)):
        if g is not None:  # sparse rows and a penalty's dense gradient sum to a dense one, as in Keras' tape
            gradients[i] = g if gradients[i] is None else tf.convert_to_tensor(gradients[i]) + tf.convert_to_tensor(g)
    return penalty
