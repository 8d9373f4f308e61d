"""Keras' compiled metrics updated micro-batch by micro-batch, from the outputs the loop collected.

After the loop the last stage holds every micro-batch's model outputs (a TensorArray). Keras' metrics take
the batch's outputs as one tensor: stacking them is a copy of them all (for a language model's logits,
B x T x V, the step's largest tensor), and the metrics' temporaries are of the whole batch's size too (an
accuracy's argmax and comparison over the logits). Where every metric's state is a sum over the rows it
is given, updating it with each micro-batch's own rows in turn gives the batch's state: then the outputs
are never stacked and the temporaries are one micro-batch's (benchmarks/runtime, "Memory"). In
evaluation the compiled loss is taken so too, as each micro-batch's part of the batch's
(``runtime.losses.microbatch_part``, as in training), summed.

Which metrics: Keras' own classes (``keras.metrics``: means of per-sample values, confusion counts,
sums), a ``MeanMetricWrapper`` only around one of Keras' metric or loss functions, which return a value
per sample. A metric of the user's may keep a state that is not such a sum (the last batch's value, a
batch's maximum), so a model with one, or with outputs carrying a Keras mask, or with several outputs'
losses logged (their trackers weight a batch by its static size), is updated on the stacked batch as
Keras does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from partitioner.units import format_bytes
from profiles.internals import metric_function, metric_function_kwargs
from runtime.losses import not_per_row
from runtime.microbatches import own_rows

_KERAS_METRICS = "keras.src.metrics."
_KERAS_FUNCTIONS = ("keras.src.metrics.", "keras.src.losses.")


def sums_over_rows(metric: Any, y: Any = None, y_pred: Any = None) -> bool:
    """Whether ``metric``'s state after two updates is its state after one update with both's rows:
    one of Keras' own metric classes, a ``MeanMetricWrapper`` only around Keras' own functions that give one
    value per row from that row alone (with targets ``y`` and outputs ``y_pred``, checked on random values
    of their shapes, ``runtime.losses.not_per_row``: ``keras.losses.dice`` with its default ``axis=None``
    gives one value for the batch, and a mean of M micro-batches' values is not the batch's; so do Keras'
    own ``PearsonCorrelation``, ``ConcordanceCorrelation`` and ``CosineSimilarity`` with ``axis=0``).

    Example:
        >>> sums_over_rows(keras.metrics.SparseCategoricalAccuracy())                  # doctest: +SKIP
        True
    """
    if not type(metric).__module__.startswith(_KERAS_METRICS):
        return False
    if isinstance(metric, keras.metrics.MeanMetricWrapper):  # Keras' own too: PearsonCorrelation(axis=0) is one
        function = metric_function(metric)
        module = getattr(function, "__module__", None) or ""
        if not module.startswith(_KERAS_FUNCTIONS):
            return False
        kwargs = metric_function_kwargs(metric)
        pairs = zip(keras.tree.flatten(y), keras.tree.flatten(y_pred)) if y is not None and y_pred is not None else []
        return all(
            not_per_row(lambda t, p: function(t, p, **kwargs), target, output) is None for target, output in pairs
        )
    return True


def _what(metric: Any) -> str:
    """The class of a metric, or for a ``MeanMetricWrapper`` the function it wraps."""
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        function = metric_function(metric)
        module, name = getattr(function, "__module__", "?"), getattr(function, "__qualname__", repr(function))
        return f"a MeanMetricWrapper of {module}.{name}"
    return f"{type(metric).__module__}.{type(metric).__qualname__}"


def warn_stacked(metrics: Sequence[Any], executor: Any, collected: Sequence[Any]) -> None:
    """Warns that ``metrics`` (ones that do not sum over rows) are updated on the stacked outputs: M
    micro-batches of the model's outputs on the last stage after the loop, which the plan does not count."""
    num = executor.num_microbatches
    shapes = [(c.element_shape, c.dtype.size) for c in collected[: len(executor.model.outputs)]]
    if all(shape[1:].is_fully_defined() for shape, _ in shapes):
        per_row = sum(shape[1:].num_elements() * size for shape, size in shapes)
        rows = {shape[0] for shape, _ in shapes}
        known = None not in rows and len(rows) == 1
        amount = format_bytes(num * rows.pop() * per_row) if known else f"{format_bytes(per_row)} a row of the batch"
    else:
        amount = "the outputs of the whole batch"
    names = ", ".join(f"'{m.name}' ({_what(m)})" for m in metrics)
    warnings.warn(
        f"Metric {names} is not one of Keras' own over per-row values, whose state the runtime updates micro-batch "
        "by micro-batch "
        "(runtime.metrics.sums_over_rows): it is updated on the whole batch, as Keras does, so after the loop "
        f"the last stage ({executor.stages[-1].device}) stacks the model's outputs of all {num} micro-batches "
        f"({amount}), memory the plan does not count. Use Keras' metric classes (keras.metrics), or leave room on that "
        "device (plan_and_wrap(memory_headroom=...)).",
        stacklevel=3,
    )


class ByMicrobatch:
    """A batch's targets, sample weights and collected model outputs, micro-batch by micro-batch: each
    micro-batch's own rows (``runtime.microbatches``: the rows past B repeat real ones and are left out)."""

    def __init__(self, executor: Any, collected: list[Any], y: Any, sample_weight: Any, batch: tf.Tensor) -> None:
        self.executor, self.collected, self.y, self.sample_weight = executor, collected, y, sample_weight
        self.batch = batch
        num = executor.num_microbatches
        self.size = (batch + num - 1) // num
        self.num_used = (batch + self.size - 1) // self.size  # the micro-batches with rows of the batch

    def __call__(self, m: Any) -> tuple[Any, Any, Any]:
        """Micro-batch m's (targets, outputs, sample weights), its own rows."""
        rows = own_rows(self.batch, self.size, m)
        start = m * self.size
        outputs = self.executor.microbatch_outputs(self.collected, m, rows)
        return rows_of(self.y, start, rows), outputs, rows_of(self.sample_weight, start, rows)

    def share(self, m: Any) -> tf.Tensor:
        """Micro-batch m's share of the batch's rows (float32)."""
        return tf.cast(own_rows(self.batch, self.size, m), tf.float32) / tf.cast(self.batch, tf.float32)

    def run(self, step: Callable[[Any, tf.Tensor], tf.Tensor], total: tf.Tensor) -> tf.Tensor:
        """``total = step(m, total)`` for each micro-batch with rows, in turn; returns the last total.

        Micro-batch 0 runs outside the loop, which builds what the metrics and the loss build on their
        first update (their variables: a variable cannot be made in a loop); the rest in a ``tf.while_loop``
        that runs one micro-batch at a time (a metric's state is read, added to and written by each), so
        the step's trace stays flat in M.
        """
        total = step(0, total)
        _, total = tf.while_loop(
            lambda m, _: m < self.num_used,
            lambda m, t: (m + 1, step(m, t)),
            (tf.constant(1), total),
            parallel_iterations=1,
        )
        return total


def rows_of(structure: Any, start: Any, rows: Any) -> Any:
    """Rows [start, start + rows) of each leaf of a structure (None stays None)."""
    if structure is None:
        return None
    return keras.tree.map_structure(lambda t: tf.convert_to_tensor(t)[start : start + rows], structure)
