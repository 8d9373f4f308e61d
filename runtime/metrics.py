"""Keras' compiled metrics updated micro-batch by micro-batch, from the outputs the loop collected.

After the loop the last stage holds every micro-batch's model outputs (a TensorArray). Keras' metrics take
the batch's outputs as one tensor: stacking them is a copy of them all (for a language model's logits,
B x T x V, the step's largest tensor), and the metrics' temporaries are of the whole batch's size too (an
accuracy's argmax and comparison over the logits). Where every metric's state is a sum over the rows it
is given, updating it with each micro-batch's own rows in turn gives the batch's state: then the outputs
are never stacked and the temporaries are one micro-batch's (benchmarks/runtime, "Memory").

Which metrics: Keras' own classes (``keras.metrics``: means of per-sample values, confusion counts,
sums), a ``MeanMetricWrapper`` only around one of Keras' metric or loss functions, which return a value
per sample. A metric of the user's may keep a state that is not such a sum (the last batch's value, a
batch's maximum), so a model with one, or with outputs carrying a Keras mask, or with several outputs'
losses logged (their trackers weight a batch by its static size), is updated on the stacked batch as
Keras does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from profiles.internals import metric_function

_KERAS_METRICS = "keras.src.metrics."
_KERAS_FUNCTIONS = ("keras.src.metrics.", "keras.src.losses.")


def sums_over_rows(metric: Any) -> bool:
    """Whether ``metric``'s state after two updates is its state after one update with both's rows:
    one of Keras' own metric classes, a ``MeanMetricWrapper`` only around Keras' own functions.

    Example:
        >>> sums_over_rows(keras.metrics.SparseCategoricalAccuracy())                  # doctest: +SKIP
        True
    """
    if not type(metric).__module__.startswith(_KERAS_METRICS):
        return False
    if type(metric) is keras.metrics.MeanMetricWrapper:
        module = getattr(metric_function(metric), "__module__", None) or ""
        return module.startswith(_KERAS_FUNCTIONS)
    return True


def update_by_microbatch(
    metrics: Any,
    num_used: tf.Tensor,
    microbatch: Callable[[Any], tuple[Any, Any, Any]],
) -> None:
    """Updates Keras' ``CompileMetrics`` with micro-batches 0 .. ``num_used`` - 1 in turn.

    ``microbatch(m)`` gives micro-batch m's (targets, outputs, sample weights), its own rows only.
    Micro-batch 0 updates outside the loop, which builds what the metrics build on their first update
    (their variables; a variable cannot be made in a loop); the rest, in a ``tf.while_loop`` that runs
    one micro-batch at a time (the state is read, added to and written by each), so the step's trace
    stays flat in M.
    """
    metrics.update_state(*microbatch(0))

    def body(m: tf.Tensor) -> tf.Tensor:
        metrics.update_state(*microbatch(m))
        return m + 1

    tf.while_loop(lambda m: m < num_used, body, [tf.constant(1)], parallel_iterations=1)


def rows_of(structure: Any, start: Any, rows: Any) -> Any:
    """Rows [start, start + rows) of each leaf of a structure (None stays None)."""
    if structure is None:
        return None
    return keras.tree.map_structure(lambda t: tf.convert_to_tensor(t)[start : start + rows], structure)
