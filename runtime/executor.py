"""Executes a pipeline schedule: the loop over micro-batches, and the steps that run in it.

The concepts live in modules of their own: a stage's compiled functions (``runtime.program``), the batch
as micro-batches (``runtime.microbatches``), a micro-batch's part of the loss (``runtime.losses``), the
training step's actions F, B and, with replicas, R (``runtime.train_step``). This module holds the
options of a run (``ExecutionOptions``) and the ``Executor``: it makes each stage's program, and runs
an iteration per micro-batch in one ``tf.while_loop`` (``Executor._loop``; unlooped when M = 1) whose
body is traced once, so the step's graph does not grow with M. Forward-only steps (evaluation,
prediction) are its own ``forward``; ``train`` hands the step to ``runtime.train_step.TrainStep``.
After the loop each stage's optimizer update runs on its device (``runtime.pipeline``): the optimizer's
per-variable update (moments, bias correction, the assign) is issued under the variable's device.

The iterations overlap (stage s + 1 of micro-batch m beside stage s of micro-batch m + 1), in the
order the schedule (``partitioner.schedule``) allows: each stage runs its forwards in micro-batch order,
and holds at most the schedule's micro-batches in flight (``Schedule.windows``: M for GPipe before its
last stage, K - s for 1F1B; the last stage one, as both schedules' rows say, and whatever a custom
schedule says), the forward of micro-batch m waiting for the backward of m - window
(``Executor.windows``). Each stage runs its backwards one after the other, as its row does, so one
backward's working set at a time exists on it (the cost model's ``once``; a recomputing stage's, the
activations its backward computes again). Any Schedule whose rows keep
to that order runs, a custom one too; another is refused by ``Schedule.windows``.

Micro-batches have one static shape, so each stage function is traced once: a batch of B rows is split
into M micro-batches of ceil(B / M) rows, the rows past B repeating real rows. The repeated rows are
left out of the loss (each micro-batch's loss is its part of Keras' compiled loss over its own rows,
``runtime.losses``: for a mean, weighted by their share of the batch; so the step's loss and gradients
are the original model's on the whole batch) and out of batch normalization's statistics (a row mask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from partitioner.errors import InputError
from partitioner.schedule import SCHEDULES, Schedule, schedule_for
from profiles.internals import (
    automatic_control_dependencies_off,
    output_structure,
    set_keras_logits,
    set_keras_mask,
)
from runtime.batchnorm import BATCH_NORM, check_deferrable, check_per_microbatch
from runtime.losses import weight_penalty
from runtime.microbatches import Microbatches, collect, collector, take, take_rows, whole
from runtime.program import Boundary, StageProgram, check_logits_reach_the_loss, check_splittable
from runtime.replicas import Replicas, StageCollectives
from runtime.stages import Stage, output_masks
from runtime.train_step import TrainStep


@dataclass(frozen=True)
class ExecutionOptions:
    """How a PipelinedModel runs its steps (everything but the stages themselves)."""

    num_microbatches: int  # M
    # a name in partitioner.schedule.SCHEDULES ("gpipe", "1f1b"), or a Schedule for the stages and M (one read
    # from text, Schedule.parse) whose rows the loop can follow (Schedule.windows)
    schedule: str | Schedule = "gpipe"
    # per stage: True re-runs the stage's forward in its backward from the kept inputs (the last stage
    # never: its backward follows at once); empty: no stage recomputes
    recompute: tuple[bool, ...] = ()
    batch_norm: str = "deferred"  # "deferred": one moving-statistics update per step; "per_microbatch": M updates
    jit_compile: bool = False  # compile each stage's functions with XLA on its device
    num_replicas: int = 1  # D: copies of the pipeline whose stages sum their gradients (runtime.replicas)
    # {a layer's name in the rebuilt model: what its added loss is} for the layers whose add_loss the stages split
    # over the batch's parts, each part's value times its share of the rows (runtime.supported.check_rows)
    loss_kinds: Mapping[str, str] = field(default_factory=dict)
    # names (in the rebuilt model) of the Embedding layers whose ids the wrap's probe saw with the batch's rows
    # (runtime.supported.check_rows): their lookups are a row of ids per sample even where the ids' static batch
    # size is unknown (``program.lookup_kind``)
    batched_lookups: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        Replicas(self.num_replicas)  # an integer >= 1, or one clear error
        if not isinstance(self.schedule, Schedule) and self.schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}. Received: schedule={self.schedule!r}.")
        if self.batch_norm not in BATCH_NORM:
            raise InputError(f"batch_norm must be one of {BATCH_NORM}. Received: batch_norm={self.batch_norm!r}.")
        if isinstance(self.schedule, Schedule):
            if self.schedule.num_microbatches != self.num_microbatches:
                raise InputError(
                    f"The schedule is for M={self.schedule.num_microbatches} micro-batches but the step runs "
                    f"num_microbatches={self.num_microbatches}: build the schedule for M={self.num_microbatches}."
                )
            self.schedule.windows()  # one the loop cannot follow fails here, before any weight moves
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
        self.schedule = schedule_for(options.schedule, len(self.stages), options.num_microbatches)
        self.schedule_windows = self.schedule.windows()  # per stage; InputError for rows the loop cannot follow
        nodes = [node for stage in self.stages for node in stage.nodes]
        if options.batch_norm == "deferred":
            check_deferrable(nodes, options.num_microbatches, options.num_replicas)
        else:
            check_per_microbatch(nodes, options.num_replicas)
        # the one Keras mask every model output carries (runtime.rebuild refuses others), or None
        self.mask = next(iter(output_masks(model)), None)
        # what the last stage returns for the loss: the model's outputs, and their mask
        self.loss_tensors = (*model.outputs, *(() if self.mask is None else (self.mask,)))
        last = len(self.stages) - 1
        outputs = {id(t) for t in model.outputs}
        self.programs = [
            StageProgram(s, (*s.outputs, *self.loss_tensors), options, range(len(s.outputs), len(s.outputs) + n), True)
            if s.index == last
            else StageProgram(s, s.outputs, options, [p for p, t in enumerate(s.outputs) if id(t) in outputs])
            for s, n in ((s, len(model.outputs)) for s in self.stages)
        ]
        # which model outputs the last stage returns Keras' logits for (a softmax's or sigmoid's), after the
        # loss tensors: set when its functions are traced (``trace``), the same for every kind
        self.logit_outputs: tuple[int, ...] = ()
        self._loss_functions: dict[Any, Any] = {}
        # the R action: each stage's collectives with the same stage of the other replicas (none when D = 1)
        self.collectives = (
            [StageCollectives(s.index, s.device, options.num_replicas) for s in self.stages]
            if options.num_replicas > 1
            else []
        )

    def loss_function(self, loss_fn: Any, scale_loss: Any) -> Any:
        """f(y, flat_predictions, mask, logits, sample_weight, weight_sums, rows, share) -> (a micro-batch's part
        of the batch's loss, the gradient of its scaled part for each floating prediction and then for each of
        ``logits``, [valid steps, steps]).

        The part is ``loss_fn`` over the micro-batch's own first ``rows`` rows, given ``share`` (the
        micro-batch's share of the batch's rows) and ``weight_sums`` (the batch's sample weights summed,
        leaf by leaf), summed (a micro-batch with no rows of its own, when B < M, gives Keras an empty
        loss, summed to 0). With an output ``mask`` (None without), Keras' mean loss is the mean over the
        micro-batch's valid steps; times the share of its steps that are valid, it becomes the sum over
        its valid steps divided by the batch's steps, and ``TrainStep.finish`` divides the step's sum by
        the share of the batch's steps that are valid: the mean over the batch's valid steps, as the
        original computes it (the mean of the micro-batches' means is not, when they hold different
        numbers of valid steps). The gradient of ``scale_loss(loss)`` (the optimizer's loss scaling) is
        taken inside, so the last stage's backward starts from it and the step graph holds no backward
        of this function: one function, traced once, called once per micro-batch. (Differentiated from
        outside, its backward had unused outputs, the gradients of the targets and shares, and Grappler
        specialised a copy of it for every micro-batch.) ``logits`` are those of the predictions
        ``logit_outputs`` names, put back on them (``with_logits``): Keras' cross-entropies compute from them,
        and the backward starts from their gradients too."""
        key = (loss_fn, scale_loss)
        if key not in self._loss_functions:
            structure = output_structure(self.model)

            def microbatch_loss(
                y: Any,
                flat: list[tf.Tensor],
                mask: Any,
                logits: list[tf.Tensor],
                sample_weight: Any,
                weight_sums: Any,
                rows: tf.Tensor,
                share: tf.Tensor,
            ) -> Any:
                floating = [t for t in flat if t.dtype.is_floating] + list(logits)
                steps = None
                with tf.GradientTape() as tape:
                    tape.watch(floating)
                    predictions = self.with_logits(
                        [*(t[:rows] for t in flat), *([] if mask is None else [mask]), *(t[:rows] for t in logits)]
                    )
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

            self._loss_functions[key] = Boundary(microbatch_loss, "microbatch_loss", inline=self.num_microbatches == 1)
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

    def mean_over_replicas(self, value: tf.Tensor, count: tf.Tensor, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """A replica's mean ``value`` over its ``count`` rows (or valid steps) and its batch's ``rows`` -> the mean
        over every replica's and the global batch's rows, on the last stage's device (the two as given with one
        replica): evaluation's loss, and what Keras' loss tracker weights it by (each worker's own rows weighted
        an epoch's steps differently on each worker, found by probing, stop 36)."""
        if not self.collectives:
            return value, rows
        with tf.device(self.stages[-1].device):
            n = tf.cast(count, tf.float32)
            total, valid, summed = self.collectives[-1].sum(
                [tf.cast(value, tf.float32) * n, n, tf.cast(rows, tf.float32)], "evaluate"
            )
            return tf.cast(total / valid, value.dtype), summed

    # ----- micro-batches and the order of each stage's actions -----------------------------------

    def windows(self) -> list[int]:
        """Per stage, the most micro-batches it holds at once (forward run, backward not yet): the
        schedule's window (``Schedule.windows``: M for GPipe and 1 on its last stage, K - s for 1F1B); 1 for a
        recomputing stage whose recompute puts variables back (``StageProgram.restored``), so no forward runs
        meanwhile; 1 for the last stage of a custom schedule too: its backward of a micro-batch needs
        nothing but its forward, so running it at once delays nothing (left free, the loop let the last
        stage's forwards run ahead of its backwards, holding as many micro-batches' activations there as
        the executor's thread order happened to give)."""
        last = len(self.programs) - 1
        return [
            1 if s == last or (self.options.recomputes(s) and program.restored()) else self.schedule_windows[s]
            for s, program in enumerate(self.programs)
        ]

    def trace(self, kind: str, parts: Microbatches, losses: bool = True) -> list[list[tf.TensorSpec]]:
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
                check_splittable(program, kind)
                check_logits_reach_the_loss(program, kind)
            returns = program.split(results, kind)[0]
            specs.update({id(t): spec for t, spec in zip(program.returns, returns)})
            traced.append(results)
        self.logit_outputs = self.programs[-1].logits.get(kind, ())
        return traced

    def returned_for_loss(self, traced: Sequence[Sequence[Any]]) -> list[Any]:
        """Of the last stage's traced results (or values): the loss tensors (the model's outputs, the mask)
        and the logits of the outputs that have them, in that order: what the steps collect."""
        start = len(self.programs[-1].stage.outputs)
        return list(traced[-1][start : start + len(self.loss_tensors) + len(self.logit_outputs)])

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

    def forward(self, inputs: Sequence[tf.Tensor], losses: bool = False) -> tuple[Any, tf.Tensor | None]:
        """Forward only (evaluation and prediction), every micro-batch through every stage on its device.

        Returns:
            (the collected model outputs, one collector per output and the mask's: ``model_outputs`` makes
            them every micro-batch's one after the other, each [M * ceil(B/M), ...], the first B rows the
            batch's in order, the rest repeating them; ``microbatch_outputs`` one micro-batch's; the
            batch's layer losses (``add_loss``, activity regularizers) or None if there are none).
        """
        parts = self.microbatches(inputs, losses)
        traced = self.trace("inference", parts, losses)
        last = self.programs[-1]
        returned = self.returned_for_loss(traced)
        with tf.device(last.stage.device):  # where the collectors are written (microbatches.collector)
            collected = [collector(spec, self.num_microbatches) for spec in returned]
            carry = {"outputs": collected, "layer_loss": tf.zeros([])}
        has_layer_losses = []

        def iteration(m: Any, carry: dict[str, Any]) -> dict[str, Any]:
            values = {id(t): x for t, x in zip(self.model.inputs, take(parts.inputs, m))}
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
                    "outputs": [collect(c, m, x) for c, x in zip(carry["outputs"], self.returned_for_loss([outputs]))],
                    "layer_loss": carry["layer_loss"] + (tf.add_n(terms) if terms else 0.0),
                }

        carry = self._loop(iteration, carry, parallel=len(self.stages))
        with tf.device(last.stage.device):
            return carry["outputs"], (carry["layer_loss"] if any(has_layer_losses) else None)

    def microbatches(self, inputs: Sequence[tf.Tensor], losses: bool) -> Microbatches:
        """The batch's inputs as M micro-batches; where the step takes a loss (``losses``) and a stage splits an
        added loss that is a mean over the rows (``StageProgram.loss_kinds``), M must divide the batch: a
        micro-batch's repeated rows would count in its mean."""
        means = sorted(name for p in self.programs for name, kind in p.loss_kinds.items() if kind == "mean")
        whole = None
        if losses and means:
            whole = (
                f"Layer '{means[0]}' adds a loss that is a mean over the batch's rows (add_loss), which the pipeline "
                f"splits exactly only over whole micro-batches: a batch of {{rows}} rows does not split into "
                f"{self.num_microbatches}, and the repeated rows that fill the last micro-batch would count in "
                f"its mean. Expected batches of a multiple of {self.num_microbatches} rows: drop the remainder "
                "(dataset.batch(..., drop_remainder=True)), or wrap with num_microbatches=1."
            )
        return Microbatches(self.num_microbatches, inputs, whole)

    def microbatch_outputs(self, collected: Sequence[Any], m: Any, rows: Any) -> Any:
        """Micro-batch m's first ``rows`` rows (its own) of the collected model outputs, in the model's
        output structure, without their mask (``runtime.metrics`` is not used where there is one), with
        Keras' logits where the original's have them (``with_logits``)."""
        flat = [take_rows(c, m, rows) for c in collected]
        return keras.tree.pack_sequence_as(output_structure(self.model), self.with_logits(flat))

    def model_outputs(self, collected: Sequence[Any]) -> Any:
        """The collected model outputs (and output mask, and logits) -> the model's output structure, each
        [M * ceil(B/M), ...], with their mask and logits (``with_logits``)."""
        flat = [whole(c) for c in collected]
        outputs = self.with_logits(flat)
        if self.mask is not None:
            for output in outputs:
                set_keras_mask(output, flat[len(outputs)])
        return keras.tree.pack_sequence_as(output_structure(self.model), outputs)

    def with_logits(self, flat: Sequence[Any]) -> list[Any]:
        """The model outputs among ``flat`` (laid out as ``returned_for_loss``: outputs, mask, logits), each
        output whose logits follow carrying them as Keras' softmax and sigmoid leave them on their outputs
        (``profiles.internals.keras_logits``): Keras' cross-entropies then compute from the logits, as the
        original's do on its own outputs."""
        outputs = list(flat[: len(self.model.outputs)])
        logits = flat[len(self.loss_tensors) : len(self.loss_tensors) + len(self.logit_outputs)]
        for i, values in zip(self.logit_outputs, logits, strict=True):
            set_keras_logits(outputs[i], values)
        return outputs

    def train(
        self,
        inputs: Sequence[tf.Tensor],
        y: Any,
        sample_weight: Any,
        loss_fn: Any,
        scale_loss: Any,
        sparse_rows_summable: bool = True,
    ) -> Any:
        """Runs every micro-batch's forwards and backwards for one batch (``TrainStep``).

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
            (the batch's loss, the collected model outputs (one collector per output, and the mask's),
            which ``model_outputs`` makes the batch's and ``microbatch_outputs`` one micro-batch's, the
            gradients of every stage's trainable variables, stage after stage, each summed over the
            micro-batches on its stage's device, and the rows of the batch the loss is over: with replicas the
            global batch's, which Keras' loss tracker weights the step's loss by).
        """
        return TrainStep(self, inputs, y, sample_weight, loss_fn, scale_loss, sparse_rows_summable).run()


@contextlib.contextmanager
def _without_automatic_control_dependencies() -> Any:
    """Builds the loop's body without TensorFlow's automatic control dependencies.

    In a ``tf.function`` every op with side effects (here every stage function call: they read
    variables) gets a control edge to the body's outputs, so each iteration's loop variables would wait
    for all of the previous iteration: the micro-batches would run one after the other (measured: at
    most one micro-batch between a stage's forward and its backward, under GPipe and M = 8). The body
    orders itself instead: every call's results are consumed (tokens, sums, collected outputs); each
    stage's forwards, and its backwards, are chained by tokens (they write seed states and statistics;
    a backward holds its working set, a recomputing one a micro-batch's activations); no variable the loop
    reads is written before the loop ends (the optimizer runs after it). TensorFlow has no public switch
    for this: the graph attribute ``while_v2`` reads is private (``tests/runtime/test_loop.py`` checks
    that micro-batches overlap).
    """
    with automatic_control_dependencies_off():
        yield
