"""A batch as micro-batches, and where a loop's iterations leave one tensor per micro-batch.

A batch of B rows is split into M micro-batches of ceil(B / M) rows, the rows past B repeating real rows,
so that every micro-batch has one static shape and each stage function is traced once; ``valid`` marks a
micro-batch's own rows (the loss and batch normalization's statistics leave the repeats out). Each input
is split on the device it is on (``PipelinedModel`` puts it on its InputLayer's device, where the plan
charges its M micro-batches: partitioner.cost, ``step_bytes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from partitioner.errors import InputError


def batch_size(inputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The batch's row count B, as a value Grappler cannot fold into a constant.

    With a batch of static size, every micro-batch's row mask, row count and share of the loss would
    fold into constants, and TensorFlow's function optimizer would then specialise (copy and optimise
    anew) a stage function for every call site that takes one: a first-step cost growing with M.
    """
    return tf.raw_ops.PlaceholderWithDefault(input=tf.shape(inputs[0])[0], shape=[])


class Microbatches:
    """A batch as M micro-batches of ceil(B / M) rows, stacked: each leaf [B, ...] of a structure becomes
    [M, ceil(B/M), ...], the rows past B repeating real rows, so that every micro-batch has one static
    shape (each stage function is traced once). The batch's own rows of micro-batch m are its first
    ``rows(m)``; ``valid`` [M, ceil(B/M)] marks them."""

    def __init__(self, num_microbatches: int, inputs: Sequence[tf.Tensor], whole: str | None = None) -> None:
        """``whole``: where given, the batch must split into M micro-batches without repeated rows, or the step
        fails with this message (at the trace where B is static, else before any micro-batch runs)."""
        self.num = num = num_microbatches
        self.batch = batch = batch_size(inputs)
        static = tf.convert_to_tensor(inputs[0]).shape[0] if inputs else None  # B, where static
        if whole is not None and num > 1:
            if static is not None and static % num:
                raise InputError(whole.format(rows=static))
            if static is None:  # every micro-batch's size, and so all the step, waits for the check
                check = tf.debugging.Assert(tf.equal(batch % num, 0), [whole.format(rows="B"), "B =", batch])
                with tf.control_dependencies([check]):
                    self.batch = batch = tf.identity(batch)
        self.size = (batch + num - 1) // num
        self.static_size = None if static is None else -(-static // num)  # ceil(B / M): the traced shape
        self.index = tf.range(self.size * num) % batch
        self.batch_rows = tf.cast(batch, tf.float32)
        self.valid = tf.reshape(tf.range(self.size * num) < batch, [num, self.size])
        self.valid.set_shape([num, self.static_size])
        self.inputs = [self._stacked_where_it_is(t) for t in inputs]

    def stack(self, structure: Any) -> Any:
        """Each leaf [B, ...] -> [M, ceil(B/M), ...] (None stays None).

        Where M divides B the leaf is only reshaped, which shares its buffer; else its rows are gathered,
        repeats included, a copy of the batch (a batch of unknown size decides when the step runs). The
        copy of a divisible batch was the step's largest tensor after the activations (8 MiB of the
        benchmark's 43 under 1F1B, benchmarks/runtime)."""
        if structure is None:
            return None

        def one(t: Any) -> tf.Tensor:
            t = tf.convert_to_tensor(t)
            shape = tf.concat([[self.num, self.size], tf.shape(t)[1:]], 0)
            rows = t.shape[0]
            if rows is None:
                divides = tf.equal(self.batch % self.num, 0)
                t = tf.cond(divides, lambda: t, lambda: tf.gather(t, self.index))
            elif rows % self.num:
                t = tf.gather(t, self.index)
            stacked = tf.reshape(t, shape)
            stacked.set_shape([self.num, self.static_size, *t.shape[1:]])
            return stacked

        return keras.tree.map_structure(one, structure)

    def _stacked_where_it_is(self, t: Any) -> tf.Tensor:
        """An input stacked on its own device (the enclosing device scope's where it has none)."""
        device = getattr(t, "device", "")
        with tf.device(device) if device else contextlib.nullcontext():
            return self.stack(t)

    def rows(self, m: Any) -> tf.Tensor:
        """How many of micro-batch m's rows are the batch's own (the rest repeat them)."""
        return own_rows(self.batch, self.size, m)

    def share(self, m: Any) -> tf.Tensor:
        """Micro-batch m's share of the batch's rows (float32)."""
        return tf.cast(self.rows(m), tf.float32) / self.batch_rows


def own_rows(batch: Any, size: Any, m: Any) -> tf.Tensor:
    """How many of micro-batch m's ``size`` rows are a batch of ``batch`` rows' own (the rest repeat them)."""
    return tf.clip_by_value(batch - m * size, 0, size)


def collector(spec: tf.TensorSpec, num_microbatches: int) -> Any:
    """Where the iterations leave one tensor each: a TensorArray in the loop; unlooped (M = 1), None
    (``collect`` then keeps the tensor itself).

    Make it under the device of the stage that writes it: the loop carries it from iteration to iteration
    where it was made (the lowered loop's Enter, Merge and Switch of a loop variable sit on its input's
    device), and a TensorArray carried on another device crosses to the writer and back in every
    iteration, which on GPUs copies every tensor written so far (M^2 copies of the outputs a step)."""
    if num_microbatches == 1:
        return None
    # read more than once (a micro-batch's rows for the metrics, then the stack): run eagerly
    # (compile(run_eagerly=True)) a TensorArray forgets an element once read, by default (a metric read zeros,
    # found by probing, stop 37); in a tf.function it is a TensorList, which never does
    return tf.TensorArray(spec.dtype, size=num_microbatches, element_shape=spec.shape, clear_after_read=False)


def take(stacked: Any, m: Any) -> Any:
    """Micro-batch m (a Python int or a scalar tensor) of a stacked structure (None stays None)."""
    return None if stacked is None else keras.tree.map_structure(lambda t: t[m], stacked)


def collect(collector: Any, m: Any, value: tf.Tensor) -> Any:
    """Leaves micro-batch m's ``value`` in a collector (``collector``); returns the collector to carry on."""
    return collector.write(m, value) if isinstance(collector, tf.TensorArray) else value


def whole(collector: Any) -> tf.Tensor:
    """A collector's tensors one after the other along the rows: [M * rows, ...]."""
    if not isinstance(collector, tf.TensorArray):
        return collector
    stacked = collector.stack()
    whole = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))
    rows = stacked.shape[0] * stacked.shape[1] if stacked.shape[1] is not None else None
    whole.set_shape([rows, *stacked.shape[2:]])
    return whole


def take_rows(collector: Any, m: Any, rows: Any) -> tf.Tensor:
    """The first ``rows`` rows of micro-batch m's tensor in a collector."""
    value = collector.read(m) if isinstance(collector, tf.TensorArray) else collector
    return value[:rows]


def unstacked(collector: Any, num: int) -> list[tf.Tensor]:
    """A collector's tensors, one per micro-batch."""
    return tf.unstack(collector.stack(), num=num) if isinstance(collector, tf.TensorArray) else [collector]
