"""A batch as micro-batches: the split copies the batch only where it must."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from runtime.microbatches import Microbatches


def _stacked(spec: tf.TensorSpec):
    """The traced split of one input into M = 4 micro-batches, and the op types its graph holds."""
    split = tf.function(lambda t: Microbatches(4, [t]).inputs[0]).get_concrete_function(spec)
    return split, {op.type for op in split.graph.get_operations()}


def test_microbatches_of_a_batch_m_divides_are_the_batch_reshaped() -> None:
    """B = 8, M = 4: the micro-batches are the batch reshaped, sharing its buffer (the split gathered
    every row, a copy of the batch: 8 MiB in benchmarks/runtime's memory section); B = 6: rows past B
    repeat real rows, gathered; a batch of unknown size picks one or the other when the step runs."""
    x = np.arange(24, dtype="float32").reshape(8, 3)
    split, ops = _stacked(tf.TensorSpec([8, 3]))
    assert "GatherV2" not in ops
    np.testing.assert_array_equal(split(x), x.reshape(4, 2, 3))
    repeated = np.concatenate([x[:6], x[:2]]).reshape(4, 2, 3)
    split, ops = _stacked(tf.TensorSpec([6, 3]))
    assert "GatherV2" in ops
    np.testing.assert_array_equal(split(x[:6]), repeated)
    split, _ = _stacked(tf.TensorSpec([None, 3]))
    np.testing.assert_array_equal(split(x), x.reshape(4, 2, 3))
    np.testing.assert_array_equal(split(x[:6]), repeated)
