"""A stage's program: its functions (training forward, inference forward, recomputing forward, the
sum of its weight gradients), each traced once for the micro-batch's shape and compiled on its device.

Each function runs the stage's nodes in order (``StageProgram._run``) on the stage's boundary tensors;
``split`` takes its results apart (returns, layer loss, deferred batch-norm statistics, seed states).
The schedule's loop (``runtime.executor``) and the train step (``runtime.train_step``) call them; this
module does not know the order they are called in. Each function sits behind a ``Boundary``: a call
TensorFlow does not inline into the step (but at M = 1), optionally compiled with XLA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from partitioner.errors import InputError
from profiles.internals import (
    clear_losses,
    embedding_calls_observed,
    flatten_layers,
    keras_history,
    keras_logits,
    own_losses,
    seed_generators,
    takes_training,
)
from runtime.batchnorm import is_plain_batch_norm, normalize, update_moving_statistics
from runtime.stages import Stage

if TYPE_CHECKING:
    from runtime.executor import ExecutionOptions


def _call_context(operation: Any, kwargs: dict[str, Any], training: bool) -> None:
    if takes_training(operation):
        kwargs["training"] = training


def _seed_generators(operations: Sequence[Any]) -> list[Any]:
    """Every seed generator (of dropout and other random layers) of the operations, each once."""
    found: dict[int, Any] = {}
    for operation in operations:
        for layer in flatten_layers(operation):
            for generator in seed_generators(layer):
                found.setdefault(id(generator.state), generator)
    return list(found.values())


def xla_blockers(stage: Stage) -> list[str]:
    """The layers of a stage that keep it from being compiled with XLA: recurrent layers (LSTM, GRU, any
    ``keras.layers.RNN``, inside ``Bidirectional`` too), whose while loop's TensorList intermediates, which
    the recorded forward hands to the backward, cannot leave an XLA cluster (TensorFlow's
    UnimplementedError). ``compile(jit_compile=True)`` leaves such a stage uncompiled and compiles the rest."""
    found = []
    for operation in stage.operations:
        if any(isinstance(layer, keras.layers.RNN) for layer in flatten_layers(operation)):
            found.append(operation.name)
    return found


class Boundary:
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

    def __init__(
        self,
        stage: Stage,
        returns: Sequence[Any],
        options: ExecutionOptions,
        model_outputs: Sequence[int] = (),
        last: bool = False,
    ) -> None:
        self.stage = stage
        self.returns = tuple(returns)  # symbolic tensors the stage function returns, in order
        # the positions in ``returns`` of the model's outputs: on the last stage, a traced one that carries Keras'
        # logits (a softmax's or sigmoid's output) has them returned too, after the returns (``logits``); on
        # another stage (an output it computes and sends on) such an output is refused (``_run``)
        self.model_outputs = tuple(model_outputs)
        self.last = last
        # per function kind: the model outputs with Keras' logits that this stage (not the last) computes
        self.sent_logits: dict[str, tuple[Any, ...]] = {}
        # per function kind: which model outputs (their index among the model's outputs) came with logits
        self.logits: dict[str, tuple[int, ...]] = {}
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
        # {name: kind} of the layers whose added loss the stage splits (runtime.supported.check_rows); none at M x D = 1
        self.loss_kinds = {
            op.name: options.loss_kinds[op.name]
            for op in stage.operations
            if self.num_parts > 1 and op.name in options.loss_kinds
        }
        # a stage with activity regularizers or split added losses takes the micro-batch's row mask and the
        # batch's row count: it weighs their parts by the micro-batch's own rows
        self.counts_rows = self.regularized or bool(self.loss_kinds)
        self.batched_lookups = options.batched_lookups  # Embedding layers whose ids the probe saw batched
        # and one with batch normalization the mask (its statistics skip the repeated rows)
        self.takes_mask = self.counts_rows or any(
            isinstance(op, keras.layers.BatchNormalization) for op in stage.operations
        )
        # per function kind: True iff it returns the stage's layer loss (after the returns)
        self.returns_layer_loss: dict[str, bool] = {}
        # per function kind: the layer whose add_loss cannot be split over micro-batches (M > 1), or None
        self.unsplittable: dict[str, str | None] = {}
        self._functions: dict[str, Any] = {}
        # id(an embedding's table) -> how each of its lookups in the training forward is made (``_lookups``)
        self.lookups: dict[int, list[str]] = {}

    def arguments(self, values: Sequence[tf.Tensor], valid: tf.Tensor, batch: tf.Tensor) -> list[tf.Tensor]:
        """The stage function's arguments for one micro-batch: its inputs, its row mask if it takes one,
        and the batch's row count (float32) if it applies activity regularizers."""
        return [*values, *([valid] if self.takes_mask else []), *([batch] if self.counts_rows else [])]

    def _run(
        self, kind: str, flat: Sequence[tf.Tensor], training: bool, stats: list[Any]
    ) -> tuple[list[tf.Tensor], tf.Tensor | None]:
        """The stage's nodes in order, on the function's arguments ``flat``; returns the stage's returns
        and its layer loss (or None). In training, batch normalizations (``runtime.batchnorm``) use the
        valid rows' statistics and append (layer, [mean, variance, count]) to ``stats`` instead of
        moving their own."""
        count = len(self.stage.inputs)
        valid = flat[count] if self.takes_mask else None
        batch = flat[count + 1] if self.counts_rows else None
        own_rows = tf.reduce_sum(tf.cast(valid, tf.int32)) if self.counts_rows else None  # repeats come last
        values = {id(t): x for t, x in zip(self.stage.inputs, flat[:count])}
        terms: list[tf.Tensor] = []
        self.unsplittable[kind] = None
        recording = (
            _lookups(self.lookups, flat[:count], self.batched_lookups)
            if kind == "forward"
            else contextlib.nullcontext()
        )
        with recording:
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
        returned = [values[id(t)] for t in self.returns]
        # Keras computes a cross-entropy from the logits behind a softmax or sigmoid output; the value returned
        # from this function loses them, so they are returned too (found by probing, stop 37: saturated softmax
        # outputs gave 11.53 where Keras gives 23.47, from probabilities clipped to 1e-7)
        found = [(i, keras_logits(returned[p])) for i, p in enumerate(self.model_outputs)]
        if not self.last:  # refused where a loss is taken (``check_logits_reach_the_loss``), not in predict
            self.sent_logits[kind] = tuple(self.returns[self.model_outputs[i]] for i, x in found if x is not None)
            found = []
        self.logits[kind] = tuple(i for i, logits in found if logits is not None)
        returned += [logits for _, logits in found if logits is not None]
        return returned, (tf.add_n(terms) if terms else None)

    def _layer_losses(
        self, kind: str, operation: Any, outputs: Any, regularizer: Any, rows: Any, batch: Any
    ) -> list[tf.Tensor]:
        """The losses one call added (``add_loss``, activity regularizers), as this micro-batch's part of
        the batch's: Keras divides an activity regularizer's value by the batch size, so the stage
        applies it to the micro-batch's own rows and divides by the whole batch's row count (exact for
        regularizers that sum over rows, as Keras' L1 and L2 do). Any other added loss is taken whole at
        M x D = 1; else times the micro-batch's share of the batch's rows where ``check_rows`` found what it is
        (``loss_kinds``: exact for a mean over the rows and for a constant), and where it did not the stage
        marks itself ``unsplittable`` (training and evaluation then refuse)."""
        terms: list[tf.Tensor] = []
        if isinstance(operation, keras.layers.Layer):
            losses = [x for layer in flatten_layers(operation) for x in own_losses(layer)]
            added = [tf.reduce_sum(tf.cast(x, tf.float32)) for x in losses]
            clear_losses(operation)  # the tensors belong to this function's graph: leave none behind
            if added and self.num_parts == 1:
                terms += added
            elif added and operation.name in self.loss_kinds:
                terms.append(tf.add_n(added) * tf.cast(rows, tf.float32) / batch)
            elif added:
                self.unsplittable[kind] = operation.name
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
        """A stage function's results -> (returns and the logits of the model outputs that have them
        (``logits``), layer loss or None, [mean, variance, count] per deferred batch-norm call, seeds); the last
        two only for the training forward."""
        count = len(self.returns) + len(self.logits.get(kind, ()))
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
            self._functions[name] = Boundary(
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
        stage's sums, one function per stage (``stage<s>_accumulate``: its adds run under that name scope).

        Always inlined into the loop and never compiled by XLA: inlined, each add can write the new sums
        into the buffer of the sums so far (the loop's carry, which nothing else reads), so the stage holds
        two copies of its gradients while it adds (the sums and the micro-batch's gradients) instead of
        three (a function call's result cannot take a buffer its caller holds). Measured on one stage of
        32 MiB of weights at M = 4 / 8: 66.7 / 65.5 MiB of step allocations inlined against 98.5 / 97.9
        called (benchmarks/memory_model/gradient_sums.py; ``ACCUMULATING_COPIES`` in partitioner/cost.py).
        An add is memory-bound: XLA would gain nothing on it."""

        def body(totals: list[tf.Tensor], gradients: list[tf.Tensor]) -> list[tf.Tensor]:
            return [t + g for t, g in zip(totals, gradients)]

        if "accumulate" not in self._functions:
            self._functions["accumulate"] = Boundary(body, f"stage{self.stage.index}_accumulate", inline=True)
        return self._functions["accumulate"]

    def restored(self) -> list[tf.Variable]:
        """The non-trainable variables a recomputing forward may change and must put back: all but the
        seed states (it draws from ``shadow_seeds``) and the statistics of the batch normalizations the
        training forward normalizes itself (``runtime.batchnorm``: they are moved after the step)."""
        kept = {
            id(w.value)
            for op in self.stage.operations
            for layer in flatten_layers(op)
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
        num_arguments = len(self.stage.inputs) + int(self.takes_mask) + int(self.counts_rows)

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


def check_logits_reach_the_loss(program: StageProgram, kind: str) -> None:
    """Raises InputError for a model output with Keras' logits (a softmax's or sigmoid's) that a stage before the
    last computes: the last stage, which takes the loss, gets its values but not the logits Keras' cross-entropies
    compute from (from the clipped probabilities they differ where the output saturates)."""
    if not program.sent_logits.get(kind):
        return
    output, stage = program.sent_logits[kind][0], program.stage.index
    history = keras_history(output)
    layer = history.operation.name if history is not None else output.name
    raise InputError(
        f"Model output '{layer}' is a softmax's or sigmoid's output computed on stage {stage}, before the last: "
        "Keras computes its cross-entropy from the logits behind it, which the pipeline passes only from the last "
        f"stage. Expected the output's layer on the last stage: pin it there (pins={{'{layer}': <the last "
        "stage's device>}), or give the output without the activation and the loss from_logits=True."
    )


def check_splittable(program: StageProgram, kind: str) -> None:
    """Refuses a stage whose layers add a loss that micro-batches or replicas cannot split (M x D > 1)."""
    name = program.unsplittable.get(kind)
    if name is not None:
        raise InputError(
            f"Layer '{name}' adds a loss (add_loss, or an activity regularizer of a scalar output) that cannot be "
            f"split over {program.num_parts} parts of the batch ({program.num_microbatches} micro-batches x "
            f"{program.num_parts // program.num_microbatches} replica(s)): the wrap's check of the model's rows "
            "did not see it added on its probe batch, so the runtime cannot tell whether it is a mean over the "
            "batch's rows. Use num_microbatches=1 on one replica, or add the loss on every call (the check then "
            "measures it), or give the layer an activity_regularizer on a batched output (split exactly) instead."
        )


@contextlib.contextmanager
def _lookups(found: dict[int, list[str]], arguments: Sequence[tf.Tensor], batched: frozenset[str]) -> Any:
    """While a stage's training forward is traced, records how each ``keras.layers.Embedding`` call (inside
    other layers too) looks its rows up, in ``found[id(table)]`` (``lookup_kind``; ``batched``: the names of the
    Embedding layers whose ids the wrap's probe saw with the batch's rows).

    ``internals.embedding_calls_observed`` sees each call: no public hook sees a lookup inside a layer
    of the user's.
    """
    rows = next((t.shape[0] for t in arguments if t.shape.rank), None)
    if rows is None:  # a trace for another micro-batch size: the first one's record stands
        yield
        return
    size: int = rows

    def observe(layer: Any, inputs: Any) -> None:
        kind = lookup_kind(tf.convert_to_tensor(inputs), arguments, size, seen_batched=layer.name in batched)
        found.setdefault(id(layer.embeddings), []).append(kind)

    found.clear()
    with embedding_calls_observed(observe):
        yield


def lookup_kind(ids: tf.Tensor, arguments: Sequence[tf.Tensor], rows: int, *, seen_batched: bool = False) -> str:
    """How an embedding lookup's ``ids`` relate to the micro-batch of ``rows`` rows (the stage function's
    ``arguments``), which says how the original's batch gives the lookup's sparse gradient rows:

    - "batched": a row of ids per sample (the leading dimension is the micro-batch's), computed from the
      micro-batch, or of rank 2 or more on micro-batches of 2 rows or more (positions broadcast over the
      batch): the original has a gradient row per sample and id, so the micro-batches' rows, one after the
      other, are the batch's;
    - "shared": not a row per sample and computed from no argument's values (a position embedding's
      ``arange``): every micro-batch looks up the same ids, which the original's gradient has once, each
      summed over the batch;
    - "unclear": anything else (ids computed from the batch's values without a row per sample, or constant
      ids whose leading dimension only happens to equal the micro-batch's): refused where it matters.

    ``seen_batched``: the wrap's probe ran the lookup's layer on ids with the batch's rows, and on their halves
    (``runtime.supported.check_rows``): ids computed from the micro-batch whose leading dimension lost its static
    size on the way (out of a TextVectorization's string ops) are a row per sample too (they were refused as
    unclear before stop 39).
    """
    per_sample = ids.shape.rank is not None and ids.shape.rank > 0 and ids.shape[0] == rows
    computed = _computed_from(ids, arguments)
    if per_sample and (computed or (ids.shape.rank >= 2 and rows >= 2)):
        return "batched"
    if seen_batched and computed and ids.shape.rank and ids.shape[0] is None:
        return "batched"
    if not per_sample and not computed:
        return "shared"
    return "unclear"


def _computed_from(tensor: tf.Tensor, arguments: Sequence[tf.Tensor]) -> bool:
    """True iff ``tensor``'s value is computed from one of ``arguments``' values (not only their shapes)."""
    targets = {a.ref() for a in arguments}
    seen: set[Any] = set()
    pending = [tensor]
    while pending:
        t = pending.pop()
        if t.ref() in targets:
            return True
        if t.ref() in seen or t.op.type in ("Shape", "ShapeN", "Size", "Rank"):
            continue
        seen.add(t.ref())
        pending.extend(t.op.inputs)
    return False
