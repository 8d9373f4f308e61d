"""One training step: every micro-batch's forwards, loss and backwards in the schedule's loop, then the
``R`` action of replicas, the weights' regularization and the deferred batch-norm updates (``finish``).

In the iteration, every action runs under its stage's device:

- ``F`` (stage s): calls the stage function on the micro-batch's boundary tensors, recorded on a tape of
  its own (or, with recomputation, unrecorded: only the inputs are kept; the last stage, whose backward
  comes next, always records). The last stage computes the micro-batch's loss on its device, with the
  gradients of the loss for the model's outputs (where its B starts).
- ``B`` (stage s, in reverse stage order): asks that tape for the gradients of the stage's inputs and
  weights, with the gradients of its outputs from the stages that read them; every gradient op is
  created under the stage's device. Weight gradients are summed per stage on its device, in the loop.
  With recomputation the stage function first runs again under a fresh tape, drawing the dropout masks
  of its forward (``StageProgram.recompute``).
- ``R`` (after the loop, with replicas): each stage's summed gradients, batch-norm moments and, on the
  last stage, the loss, summed with the same stage of the other replicas (``runtime.replicas``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from partitioner.errors import InputError
from profiles.internals import flatten_layers
from runtime.batchnorm import combine, update_moving_statistics
from runtime.losses import weight_penalty, weight_sums
from runtime.microbatches import collect, collector, take, unstacked
from runtime.stages import Stage

if TYPE_CHECKING:
    from runtime.executor import Executor


class TrainStep:
    """One training step: the iteration of one micro-batch (every stage's forward in order, the loss on
    the last stage, every stage's backward in reverse order), run for m = 0..M-1 in one loop
    (``Executor._loop``), then what follows the last (``finish``).

    The iterations overlap: stage s + 1 of micro-batch m runs beside stage s of micro-batch m + 1. Each
    stage runs its forwards in micro-batch order and, where it holds fewer than M micro-batches
    (``Executor.windows``: 1F1B's K - s, the last stage's 1), the forward of micro-batch m only after the
    backward of micro-batch m - window: the loop carries, per stage, tokens made after its last forward
    and its last ``window`` backwards; at least two iterations run at once, so a micro-batch's gradient
    sums run beside the next one's forward. Each stage runs its backwards one after the other too, as its row
    of the schedule does: each holds its working set (the gradients of one micro-batch's outputs and
    inputs; run at once, two backwards of the CNN of benchmarks/runtime held both: its first stage's step
    51-59 MiB against 46-48 one after the other, 1F1B M = 4, three processes each); a recomputing stage's
    share the seed states they draw from and each holds a micro-batch's activations (run at once, they
    held as many as the stage's forwards, and recomputation saved nothing). Weight gradients are
    summed in the loop, per stage on its device; the loss, the layer losses and, with an output mask, the
    valid steps on the last stage's; the model outputs and the batch-norm statistics of every
    micro-batch are collected for ``finish``.
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
        # the (stage, variable) pairs some micro-batch's backward gave a gradient: the others get None, as
        # from Keras' tape, and the optimizer leaves them alone (no weight decay, no step counted for them)
        self.reached: set[tuple[int, int]] = set()
        self.scale_loss = scale_loss
        self.loss_function = executor.loss_function(loss_fn, scale_loss)
        self.parts = executor.microbatches(inputs, True)
        self.y = self.parts.stack(y)
        self.weights = self.parts.stack(sample_weight)
        with tf.device(executor.stages[-1].device):  # the whole batch's weights, where the loss is
            self.weight_sums = weight_sums(sample_weight)
        self.traced = executor.trace("forward", self.parts)
        self.windows = executor.windows()
        self.model_inputs = {id(t) for t in executor.model.inputs}
        self.layer_losses: list[bool] = []  # per traced iteration: whether any stage returned a layer loss

    def run(self) -> tuple[tf.Tensor, Any, list[tf.Tensor], tf.Tensor]:
        # two iterations at least: a stage's sums of micro-batch m's gradients run beside the forward of
        # micro-batch m + 1 (the tokens keep the activations' bounds; the backward of m + 1 may make its gradients
        # before m's are added, as with GPipe's wider windows: docs/cost-model.md, "the gradient sums"). One
        # iteration at a time, one stage at M = 16 waited for its sums each micro-batch: benchmarks/runtime's
        # overlap MLP, 275 against 235 ms a step
        return self.finish(self.executor._loop(self.iteration, self.start(), parallel=max(2, *self.windows)))

    def start(self) -> dict[str, Any]:
        """The loop's carry before the first micro-batch (tokens only in the loop; sums of None unlooped)."""
        executor = self.executor
        looped = executor.num_microbatches > 1
        last = executor.programs[-1]
        collectors = []
        for program, results in zip(executor.programs, self.traced):
            stats = program.split(results)[2]
            with tf.device(program.stage.device):  # where they are written (microbatches.collector)
                collectors.append([[collector(spec, executor.num_microbatches) for spec in m] for m in stats])
        with tf.device(last.stage.device):
            outputs = [collector(spec, executor.num_microbatches) for spec in executor.returned_for_loss(self.traced)]
        carry: dict[str, Any] = {
            "forward": [[_token(s.device)] if looped else [] for s in executor.stages],
            # each stage's backwards one after the other: each holds its working set (recomputing: a
            # micro-batch's activations)
            "backward": [[_token(s.device)] if looped else [] for s in executor.stages],
            "window": [
                [_token(s.device) for _ in range(w)] if looped and w < executor.num_microbatches else []
                for s, w in zip(executor.stages, self.windows)
            ],
            "gradients": [[None] * len(s.trainable_variables) for s in executor.stages],
            # per stage and embedding variable: the micro-batches' sparse gradient rows, kept apart
            "rows": [{} for _ in executor.stages],
            "statistics": collectors,
            "outputs": outputs,
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
        micro = _Micro(m, {id(t): x for t, x in zip(executor.model.inputs, take(self.parts.inputs, m))})
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
        returned = executor.returned_for_loss([outputs])  # the model's outputs, the mask, the logits
        flat = returned[: len(executor.model.outputs)]
        mask = None if executor.mask is None else returned[len(flat)]
        loss, gradients, steps = self.loss_function(
            take(self.y, m),
            flat,
            mask,
            returned[len(executor.loss_tensors) :],
            take(self.weights, m),
            self.weight_sums,
            self.parts.rows(m),
            self.parts.share(m),
        )
        new["loss"] = _add(new["loss"], loss)
        if steps is not None:
            new["steps"] = _add(new["steps"], steps)
        new["outputs"] = [collect(c, m, x) for c, x in zip(new["outputs"], returned, strict=True)]
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
            [collect(c, micro.m, x) for c, x in zip(collectors, moments)]
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
            returned = self.executor.returned_for_loss([outputs])  # and for their logits, where they have them
            predictions = [t for t in returned[: len(self.executor.model.outputs)] if t.dtype.is_floating]
            targets += predictions + returned[len(self.executor.loss_tensors) :]
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
            self.reached.add((s, i))
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
        # a variable the optimizer overwrites with its "gradient" (Keras' float8 scales and amax histories): the
        # micro-batches' values are taken by their maximum, as Keras' gradient accumulation takes them
        overwritten = [i for i in new if totals[i] is not None and overwrites(stage.trainable_variables[i])]
        for i in overwritten:
            totals[i] = tf.maximum(totals[i], new.pop(i))
        summed = [i for i in new if totals[i] is not None]
        if summed:
            sums = self.executor.programs[s].accumulate()([totals[i] for i in summed], [new[i] for i in summed])
            for i, total in zip(summed, sums):
                totals[i] = total
        for i in new.keys() - set(summed):
            totals[i] = new[i]
        return totals, rows

    def finish(self, carry: dict[str, Any]) -> tuple[tf.Tensor, Any, list[tf.Tensor], tf.Tensor]:
        """After the last micro-batch, per stage on its device: with replicas, the ``R`` action (the
        stage's gradients, batch-norm moments and, on the last stage, the loss summed with the other
        replicas'); then the weights' regularization (once per step, with its gradients) and the deferred
        batch-norm updates; returns what ``Executor.train`` does."""
        executor = self.executor
        sums = [
            [g if (s, i) in self.reached else None for i, g in enumerate(grads)]
            for s, grads in enumerate(carry["gradients"])
        ]
        for s, i in self.sparse:  # every micro-batch's sparse rows, as one batch's
            values, indices = carry["rows"][s][i]
            variable = executor.stages[s].trainable_variables[i]
            with tf.device(executor.stages[s].device):
                sums[s][i] = _batch_rows(variable, values, indices, executor.programs[s].lookups.get(id(variable), []))
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
                    grads[:] = [
                        None if g is None else g if overwrites(v) else _scaled(g, correction)
                        for g, v in zip(grads, stage.trainable_variables, strict=True)
                    ]
        statistics = []  # per stage: [(layer, [[mean, variance, count] per part])], one entry per layer
        for program, collected in zip(executor.programs, carry["statistics"]):
            moments: dict[int, tuple[Any, list[Any]]] = {}
            for layer, collectors in zip(program.deferred_layers, collected):
                with tf.device(program.stage.device):  # read where they were written
                    parts = [unstacked(c, executor.num_microbatches) for c in collectors]
                moments.setdefault(id(layer), (layer, []))[1].extend(list(x) for x in zip(*parts))
            statistics.append(list(moments.values()))
        rows = self.parts.batch_rows  # what Keras' loss tracker weights the step's loss by: the global batch's rows
        if executor.collectives:
            loss, layer_loss, rows = self._reduce(sums, statistics, loss, layer_loss, count, rows)
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
                gradients += grads  # None where nothing reaches the variable: the optimizer skips it, as Keras
        with tf.device(last):
            loss = tf.add_n(losses)
        return loss, carry["outputs"], gradients, rows

    def _reduce(
        self,
        sums: list[list[Any]],
        statistics: list[list[Any]],
        loss: tf.Tensor,
        layer_loss: Any,
        count: tf.Tensor,
        rows: tf.Tensor,
    ) -> tuple[tf.Tensor, Any, tf.Tensor]:
        """The ``R`` action of every stage, in place: each replica's local means (gradients, loss, layer
        losses) times its ``count``, and its batch-norm moments as sums, summed over the replicas in one
        collective per stage; divided by the summed count they are the means over the global batch,
        exact for uneven shards. Returns the global (loss, layer loss, rows): the last stage sums the replicas'
        ``rows`` too."""
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
                tensors += [tf.cast(t, tf.float32) * n for t in tail]
                tensors += ([tf.cast(rows, tf.float32)] if s == last else []) + [n]
                summed = group.sum(tensors)
                n = summed.pop()
                if s == last:
                    rows = summed.pop()
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
        return loss, layer_loss, rows


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


def _token(device: str) -> tf.Tensor:
    """A scalar that orders actions: an action waits for a token made after another one."""
    with tf.device(device):
        return tf.zeros([])


def _after(token: tf.Tensor, done: Sequence[Any]) -> tf.Tensor:
    """A token made after ``done`` ran (a copy of ``token`` with control dependencies on them)."""
    with tf.control_dependencies(list(done)):
        return tf.identity(token)


def _embeddings(stage: Stage) -> list[int]:
    """Positions in ``stage.trainable_variables`` of the embeddings' tables: their gradients come as sparse rows."""
    tables = {
        id(layer.embeddings)
        for op in stage.operations
        for layer in flatten_layers(op)  # inside a layer too
        if isinstance(layer, keras.layers.Embedding)
    }
    return [i for i, v in enumerate(stage.trainable_variables) if id(v) in tables]


def _batch_rows(variable: Any, values: tf.TensorArray, indices: tf.TensorArray, lookups: Sequence[str]) -> Any:
    """The sparse rows of ``variable``'s gradient as the original's batch gives them, from each micro-batch's
    rows: one after the other where every lookup takes a row of ids per sample ("batched"); summed where
    every lookup takes the same ids whatever the sample (a position embedding: the batch's gradient has
    each of its rows once, summed over the samples); else refused (``runtime.program._lookups``)."""
    kinds = set(lookups)
    if kinds <= {"batched"}:
        return tf.IndexedSlices(values.concat(), indices.concat(), tf.shape(variable))
    if kinds == {"shared"}:
        return tf.IndexedSlices(tf.reduce_sum(values.stack(), axis=0), indices.read(0), tf.shape(variable))
    raise InputError(
        f"'{variable.path}' is looked up by {len(lookups)} embedding call(s) of kinds {sorted(kinds)}: ids given "
        "per sample (batched), ids shared by every sample (shared, as positions), or ids the runtime cannot place "
        "in either (unclear). Its optimizer updates each sparse row on its own (Adam, RMSprop, Adagrad, clipping), "
        "so the micro-batches' rows must be joined as the original's batch gives them, which is known only when "
        "every lookup of the table is batched, or every one shared. Expected num_microbatches=1, an optimizer "
        "that updates from the sum (SGD, with momentum), or one kind of lookup per table."
    )


def _row_arrays(variable: Any, num: int) -> tuple[tf.TensorArray, tf.TensorArray]:
    """Where the loop leaves each micro-batch's sparse rows of ``variable``: values and row indices."""
    values = tf.TensorArray(variable.dtype, size=num, infer_shape=False, element_shape=[None, *variable.shape[1:]])
    return values, tf.TensorArray(tf.int32, size=num, infer_shape=False, element_shape=[None])


def overwrites(variable: Any) -> bool:
    """True iff Keras' optimizer assigns ``variable`` its gradient instead of applying an update
    (``overwrite_with_gradient``: float8 layers' scales and amax histories)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _scaled(gradient: Any, factor: tf.Tensor) -> Any:
    """gradient x factor, for a dense gradient or an embedding's sparse rows (IndexedSlices)."""
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _add(total: Any, value: tf.Tensor) -> tf.Tensor:
    """total + value, where a total of None (unlooped, nothing summed yet) is 0."""
    return value if total is None else total + value


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
