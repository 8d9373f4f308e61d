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

Micro-batches have one shape, so each stage function is traced once: a batch of B rows is split
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
        self.deferred_layers: list[Any] = []  # batch-norm calls whose statistics the training forward returns
        # only a stage with batch normalization takes the micro-batch's row mask (its statistics skip repeats)
        self.takes_mask = any(isinstance(op, keras.layers.BatchNormalization) for op in stage.operations)
        self._functions: dict[str, Any] = {}

    def arguments(self, values: Sequence[tf.Tensor], valid: tf.Tensor) -> list[tf.Tensor]:
        """The stage function's arguments for one micro-batch: its inputs, and its row mask if it takes one."""
        return [*values, valid] if self.takes_mask else list(values)

    def _run(
        self, inputs: Sequence[tf.Tensor], valid: tf.Tensor | None, training: bool, stats: list[Any]
    ) -> list[tf.Tensor]:
        """The stage's nodes in order. In training, batch normalizations (``runtime.batchnorm``) use
        the valid rows' statistics and append (layer, [mean, variance, count]) to ``stats`` instead of
        moving their own."""
        values = {id(t): x for t, x in zip(self.stage.inputs, inputs)}
        for node in self.stage.nodes:
            args, kwargs = node.arguments.fill_in(values)
            operation = node.operation
            _call_context(operation, kwargs, training)
            if training and is_plain_batch_norm(operation, args, kwargs):
                outputs, moments = normalize(operation, args[0], valid)
                stats.append((operation, moments))
            else:
                outputs = operation(*args, **kwargs)
            for symbolic, value in zip(node.outputs, keras.tree.flatten(outputs)):
                values[id(symbolic)] = value
        return [values[id(t)] for t in self.returns]

    def split(self, results: Sequence[tf.Tensor]) -> tuple[list[tf.Tensor], list[list[tf.Tensor]], list[tf.Tensor]]:
        """A training forward's results -> (returns, [mean, variance, count] per deferred call, seeds)."""
        count, num_stats = len(self.returns), 3 * len(self.deferred_layers)
        stats = list(results[count : count + num_stats])
        return (
            list(results[:count]),
            [stats[i : i + 3] for i in range(0, num_stats, 3)],
            list(results[count + num_stats :]),
        )

    def _signature(self) -> list[tf.TensorSpec]:
        specs = [tf.TensorSpec((None, *t.shape[1:]), t.dtype) for t in self.stage.inputs]
        return [*specs, tf.TensorSpec((None,), tf.bool)] if self.takes_mask else specs

    def _compile(self, name: str, body: Any, signature: list[Any] | None) -> Any:
        """One tf.function per stage and kind, named ``stage<s>_<kind>`` (its executed graphs carry the name)."""
        if name not in self._functions:
            body.__name__ = f"stage{self.stage.index}_{name}"
            self._functions[name] = tf.function(
                body,
                input_signature=signature,
                jit_compile=self.jit_compile,
                experimental_attributes={"_noinline": True},
            )
        return self._functions[name]

    def forward(self, training: bool) -> Any:
        """f(*inputs, valid) -> [returns...]; when training, + batch-norm statistics + the seed states it began with."""
        count = len(self.stage.inputs)

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            stats: list[Any] = []
            valid = flat[count] if self.takes_mask else None
            if not training:
                return self._run(flat[:count], valid, False, stats)
            seeds = [v.read_value() for v in self.seed_variables]
            outputs = self._run(flat[:count], valid, True, stats)
            if self.batch_norm == "per_microbatch":
                for layer, moments in stats:
                    update_moving_statistics(layer, [moments])
                stats = []
            self.deferred_layers = [layer for layer, _ in stats]
            return outputs + [t for _, moments in stats for t in moments] + seeds

        return self._compile("forward" if training else "inference", body, self._signature())

    def accumulate(self) -> Any:
        """f(totals, gradients) -> [total + gradient]: a micro-batch's weight gradients added to the
        stage's sums in one call (one op in the step's graph instead of one per weight)."""

        def body(totals: list[tf.Tensor], gradients: list[tf.Tensor]) -> list[tf.Tensor]:
            return [t + g for t, g in zip(totals, gradients)]

        return self._compile("accumulate", body, None)

    def recompute(self) -> Any:
        """f(*inputs, valid, *seeds) -> [returns...]: the training forward again, leaving no trace.

        The dropout seeds are set to those of the first forward, and every non-trainable variable
        (batch-norm statistics) and seed state is put back afterwards, so the recomputed forward draws
        the same masks, updates nothing twice, and later forwards draw what they would have drawn.
        """
        count = len(self.stage.inputs)
        num_arguments = count + int(self.takes_mask)
        seed_specs = [tf.TensorSpec(v.shape, v.dtype) for v in self.seed_variables]

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            state = [*self.non_trainable, *self.seed_variables]
            saved = [tf.identity(v.read_value()) for v in state]
            with tf.control_dependencies(saved):
                for variable, seed in zip(self.seed_variables, flat[num_arguments:]):
                    variable.assign(seed)
            valid = flat[count] if self.takes_mask else None
            outputs = self._run(flat[:count], valid, True, [])  # statistics are the first forward's
            with tf.control_dependencies(outputs):
                restores = [v.assign(s) for v, s in zip(state, saved)]
            with tf.control_dependencies(restores):
                return [tf.identity(o) for o in outputs]

        return self._compile("recompute", body, [*self._signature(), *seed_specs])


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

            self._loss_functions[key] = tf.function(
                microbatch_loss, autograph=False, experimental_attributes={"_noinline": True}
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

    def split(self, batch: tf.Tensor, structure: Any) -> list[Any]:
        """Each leaf [B, ...] -> M micro-batches [ceil(B/M), ...]; rows past B repeat real rows."""
        m = self.num_microbatches
        size = (batch + m - 1) // m
        rows = tf.range(size * m) % batch

        def one(t: Any) -> list[tf.Tensor]:
            t = tf.convert_to_tensor(t)
            parts = list(tf.unstack(tf.reshape(tf.gather(t, rows), tf.concat([[m, size], tf.shape(t)[1:]], 0)), num=m))
            for part in parts:
                part.set_shape([None, *t.shape[1:]])
            return parts

        flat = [one(t) for t in keras.tree.flatten(structure)]
        return [keras.tree.pack_sequence_as(structure, [parts[i] for parts in flat]) for i in range(m)]

    def valid_rows(self, batch: tf.Tensor) -> list[tf.Tensor]:
        """Per micro-batch, [ceil(B/M)] booleans: True for the batch's own rows, False for repeats."""
        m = self.num_microbatches
        size = (batch + m - 1) // m
        return list(tf.unstack(tf.reshape(tf.range(size * m) < batch, [m, size]), num=m))

    # ----- steps ---------------------------------------------------------------------------------

    def forward(self, inputs: Sequence[tf.Tensor], training: bool) -> tuple[list[Any], list[tf.Tensor]]:
        """Forward only (evaluation and prediction): per micro-batch the model outputs, and the valid rows."""
        batch = batch_size(inputs)
        micro_inputs = self.split(batch, list(inputs))
        valid = self.valid_rows(batch)
        values: dict[tuple[int, int], tf.Tensor] = {}
        last_op: list[Any] = [None] * len(self.stages)
        for m in range(self.num_microbatches):
            for t, x in zip(self.model.inputs, micro_inputs[m]):
                values[(id(t), m)] = x
        results = []
        for m in range(self.num_microbatches):
            for program in self.programs:
                stage = program.stage
                with tf.device(stage.device), tf.control_dependencies(last_op[stage.index] or []):
                    fn = program.forward(training)
                    outputs = fn(*program.arguments([values[(id(t), m)] for t in stage.inputs], valid[m]))
                    outputs = outputs[: len(program.returns)]
                for symbolic, value in zip(program.returns, outputs):
                    values[(id(symbolic), m)] = value
                last_op[stage.index] = outputs
            outputs = [values[(id(t), m)] for t in self.model.outputs]
            if self.mask is not None:
                for output in outputs:
                    set_keras_mask(output, values[(id(self.mask), m)])
            results.append(keras.tree.pack_sequence_as(self.model._outputs_struct, outputs))
        return results, valid

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
        self.share = [tf.cast(n, tf.float32) / tf.cast(batch, tf.float32) for n in self.rows]
        self.valid = executor.valid_rows(batch)
        self.y = executor.split(batch, y) if y is not None else [None] * num
        self.weights = executor.split(batch, sample_weight) if sample_weight is not None else [None] * num
        self.model_inputs = {id(t) for t in executor.model.inputs}
        self.values: dict[tuple[int, int], tf.Tensor] = {}  # (id(symbolic tensor), m) -> its value
        for m, parts in enumerate(executor.split(batch, list(inputs))):
            for t, x in zip(executor.model.inputs, parts):
                self.values[(id(t), m)] = x
        self.pending: dict[tuple[int, int], list[tf.Tensor]] = {}  # (id(tensor), m) -> gradients from its readers
        # (s, m) -> (tape or None, outputs, seeds, the loss's gradients for the model outputs (last stage) or None)
        self.kept: dict[tuple[int, int], Any] = {}
        self.losses: list[Any] = [None] * num  # unscaled loss of each micro-batch, its share of the batch
        self.steps: list[Any] = [None] * num  # with an output mask: [valid steps, steps] of each micro-batch
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
            outputs, stats, seeds = program.split(program.forward(True)(*program.arguments(values, self.valid[m])))
        loss_gradients = self._loss(s, m, outputs)  # outside the tape: the backward starts from its gradients
        for layer, moments in zip(program.deferred_layers, stats):
            self.statistics.setdefault((s, id(layer)), (layer, []))[1].append(moments)
        for symbolic, value in zip(program.returns, outputs):
            self.values[(id(symbolic), m)] = value
        self.kept[(s, m)] = (tape, outputs, seeds, loss_gradients)
        self.last_op[s] = [*outputs, *(loss_gradients or [])]

    def backward(self, s: int, m: int) -> None:
        program, stage = self.executor.programs[s], self.executor.stages[s]
        values, watched_index = self._inputs(s, m)
        watched = [values[i] for i in watched_index]
        tape, outputs, seeds, loss_gradients = self.kept.pop((s, m))
        if tape is None:  # recomputation (never the last stage): the stage's forward again, under a tape, here
            with tf.GradientTape() as tape:
                tape.watch(watched)
                outputs = program.recompute()(*program.arguments(values, self.valid[m]), *seeds)
        targets: list[tf.Tensor] = []
        output_gradients: list[tf.Tensor] = []
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
            with tf.device(executor.stages[-1].device):
                valid, steps = tf.unstack(tf.add_n(self.steps))
                correction = tf.math.divide_no_nan(steps, valid)
                losses = [tf.add_n(losses) * correction]
            for stage, grads in zip(executor.stages, self.gradients):
                with tf.device(stage.device):
                    grads[:] = [None if g is None else g * tf.cast(correction, g.dtype) for g in grads]
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
